"""Jinja2 templates for hf_dp model cards.

In the source tree this folder is the top-level ``model_cards/``; in an installed wheel setuptools' ``package-dir``
maps it to the sub-package ``hf_dp.model_cards`` so that :mod:`importlib.resources` finds the templates.
"""
