"""Private hyper-parameter selection: ``DPTrainer.hyperparameter_search`` under DP (:mod:`hf_dp.tuning.search`, the
search; :mod:`hf_dp.tuning.space`, the search space and the law of the number of trials; :mod:`hf_dp.tuning.private_score`,
the DP score on held-out private data). Its accounting (the selection's total ε) is :mod:`hf_dp.privacy.selection`."""
