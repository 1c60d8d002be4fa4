"""The task-independent half of a recipe, shared by every recipe (``recipes/glue.py``, ``clm.py``, ``sft.py``):

* :mod:`~recipes.common.args`: layered defaults (protocol < preset < ``--config`` YAML/JSON < command line), args
  files, the flags the user set, :class:`~recipes.common.args.RecipeError`;
* :mod:`~recipes.common.help`: ``--help`` grouped (DP, data, model, a recipe's own groups such as ``--tune*`` or TRL's
  ``SFTConfig`` flags, recipe, training, other HF flags) with the effective defaults and each flag's meaning under DP;
* :mod:`~recipes.common.logs`: the log lines of a run — the planned steps and the time left, the per-unit training
  loss explained, quiet model-load reports;
* :mod:`~recipes.common.rows`: a training row named by its line in the user's file (errors), the unit-column check;
* :mod:`~recipes.common.model`: ``ModelArguments``, the offline ``minilm`` preset, ``from_pretrained`` with one
  error line;
* :mod:`~recipes.common.run`: the privacy checks before any expensive work, the planner's batch, resume, the
  predictions file, the Hub push, the summary, and the entry point (exit codes, one-line errors).

A recipe adds its task: data arguments and loading, the model head, metrics, the protocol defaults.
"""

import os as _os
import sys as _sys

# Written to a log file or a pipe (not a terminal), a progress bar is a new line at every refresh: ~460 lines per main
# job at tqdm's 0.1 s. There the bars refresh every 20 s (each still ends with its total time and rate); tqdm reads
# TQDM_MININTERVAL when it is first imported, and a value the user set wins.
if "tqdm" not in _sys.modules and not (hasattr(_sys.stderr, "isatty") and _sys.stderr.isatty()):
    _os.environ.setdefault("TQDM_MININTERVAL", "20")
