"""``python -m hf_dp.plan`` (:mod:`hf_dp.plan.cli`)."""

import sys

from hf_dp.plan.cli import main

sys.exit(main())
