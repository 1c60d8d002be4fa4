"""What keeps one training run honest, each part taking the ``DPTrainer`` as an argument: the mechanism planned once at
construction (:mod:`hf_dp.run.setup`), the per-example contract checked at run time (:mod:`hf_dp.run.contract`; its
independence probe: :mod:`hf_dp.run.independence`), the Poisson training loader and the data refusals
(:mod:`hf_dp.run.data`), checkpoints with a completion marker (:mod:`hf_dp.run.checkpointing`), every run's record of
steps spent, the forks of a checkpoint and a resumed run's ledger (:mod:`hf_dp.run.spent`), the model folder saved
(:mod:`hf_dp.run.release`), and the ledger that follows the model across runs (:mod:`hf_dp.run.lineage`)."""
