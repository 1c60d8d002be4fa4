#!/usr/bin/env python
"""DP fine-tuning on QNLI: ``recipes/glue.py`` with ``--task_name qnli`` preset (seed 000's QNLI protocol).

    python recipes/qnli.py --data_dir /path/to/glue --model_name_or_path minilm --epsilon 3

Every flag of glue.py works here; see recipes/README.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glue import main  # noqa: E402

QNLI_DEFAULTS = {"task_name": "qnli"}

if __name__ == "__main__":
    sys.exit(main(defaults=QNLI_DEFAULTS))
