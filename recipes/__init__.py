"""The recipes: command-line programs on top of hf_dp (not part of the library; hf_dp never imports them).

* ``recipes/glue.py``: DP fine-tuning on GLUE, a DP version of transformers' run_glue.py; ``recipes/qnli.py``: the
  same with ``--task_name qnli`` preset;
* :mod:`recipes.common`: the task-independent plumbing every recipe shares (layered defaults, YAML / args files,
  ``--help``, model loading, the run checks, summary, push, predictions);
* :mod:`recipes.glue_support`: GLUE tasks, data loading and metrics;
* ``recipes/clm.py``: DP causal language modelling with a unit of privacy (row / document / user), a DP version of
  transformers' run_clm.py; :mod:`recipes.clm_support`: its data (blocks per unit), model, metrics and sampling.

Run a recipe as a script (``python recipes/glue.py ...``); it puts the checkout on ``sys.path`` so that
``import recipes.common`` (and ``import hf_dp``, without installing) work.
"""
