"""Privacy audits: empirical lower bounds on ε that can expose a broken mechanism, never prove privacy.

* :mod:`hf_dp.audit.many_runs` — the mechanism (sampler, privatizer, update rule) driven directly over many trials,
  and the command line ``python -m hf_dp.audit``;
* :mod:`hf_dp.audit.banded` — the many-run audit of correlated noise (``--noise_bands``: the banded square root with
  cyclic Poisson sampling) and its broken variant with the cancellation over-stated;
* :mod:`hf_dp.audit.trainer_path` — the same trials through ``DPTrainer`` itself (``--path trainer``);
* :mod:`hf_dp.audit.stats` — the bound and the power both share;
* :mod:`hf_dp.audit.one_run_bound` — the one-run bound (Steinke, Nasr & Jagielski 2023); :mod:`hf_dp.audit.fdp` — the
  Gaussian-DP one-run estimate beside it (Mahloujifar et al. 2024); :mod:`hf_dp.audit.canary_kinds` — the input and
  gradient canaries; :mod:`hf_dp.audit.lm_canaries` — a causal LM's input canaries (scored by their loss);
* :mod:`hf_dp.audit.canaries` — the one-run audit inside a training run (``--audit_canaries``, ``--audit_kind``);
* :mod:`hf_dp.audit.one_run` — the one-run audit's command-line runs (``python -m hf_dp.audit --one_run``).
"""
