"""What keeps one training run honest: the per-example contract checked at run time (:mod:`hf_dp.run.contract`),
the Poisson training loader and the data refusals (:mod:`hf_dp.run.data`), checkpoints with a completion marker and
resume (:mod:`hf_dp.run.checkpointing`), and the ledger that follows the model across runs (:mod:`hf_dp.run.lineage`)."""
