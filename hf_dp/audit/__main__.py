"""``python -m hf_dp.audit``: the audit's command line (:func:`hf_dp.audit.many_runs.main`)."""

from hf_dp.audit.many_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
