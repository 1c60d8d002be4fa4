#!/usr/bin/env python
"""DP fine-tuning on QNLI — the README's main job: ``recipes/glue.py`` with QNLI's preset.

    python recipes/qnli.py --data_dir /path/to/glue --model_name_or_path minilm --epsilon 3

The preset (every flag of glue.py works here and overrides it; recipes/README.md "The main job's preset"):

* ``--task_name qnli``;
* ``--trainable last_k:2``: the last two encoder blocks + pooler + head, the frozen prefix cached below them. QNLI
  needs more than the top block: on a tune split of QNLI *train* (8,099 fit / 900 tune rows) two blocks reached
  68.4–68.7 % tune accuracy against 62.1 % for ``last_block`` at the same ε = 3 (benchmarks/RESULTS.md §0);
* ``--num_train_epochs 5``: the compute budget. Two blocks cost ~7× one block per step; 5 epochs keep the whole run
  within 8 minutes on 2 CPU cores, and scored as 10 epochs did on the tune split (68.4 vs 68.7 %). The planner still
  chooses the logical batch for that budget, or for the epochs or steps given (B = 512 for MiniLM on the 8,999 rows
  at 5 epochs), unless a batch size or accumulation is given.

``recipes/configs/qnli_paper.yaml`` is seed 000's protocol (bert-base-cased, ``last_block``, 10 epochs) written out.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glue import main  # noqa: E402

QNLI_DEFAULTS = {"task_name": "qnli", "trainable": "last_k:2", "num_train_epochs": 5.0}

if __name__ == "__main__":
    sys.exit(main(defaults=QNLI_DEFAULTS))
