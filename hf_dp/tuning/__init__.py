"""Private hyper-parameter selection: ``DPTrainer.hyperparameter_search`` under DP (:mod:`hf_dp.tuning.search`).
Its accounting (the selection's total ε) is :mod:`hf_dp.privacy.selection`."""
