"""Causal language modelling for the recipes (``recipes/clm.py``); not part of hf_dp.

* :mod:`~recipes.clm_support.data`: loading (txt / json / jsonl / csv files, or ``datasets``), the text and
  privacy-unit columns checked before tokenizing, the blocks (never packed across units);
* :mod:`~recipes.clm_support.model`: run_clm's model flags, the causal-LM check, token ids from the tokenizer, the
  block size;
* :mod:`~recipes.clm_support.metrics`: perplexity = exp(eval_loss);
* :mod:`~recipes.clm_support.sampling`: sampled continuations of a public prompt (post-processing of the model).
* :mod:`~recipes.clm_support.trl`: what the TRL recipes (``sft.py``, ``dpo.py``) share: TRL's script flags, the
  layered parse with ``--use_peft``, the data loading with the unit-column checks, the config and tokenizer.
"""

from .data import (DOCUMENT_COLUMN, add_document_ids, check_text_column, check_unit_column, count_units,
                   drop_empty_texts, evaluation_blocks, load_raw_datasets, no_progress_bar, training_blocks)
from .metrics import perplexity, with_perplexity
from .model import (DEFAULT_BLOCK_SIZE, ClmModelArguments, build_model, check_causal_lm, choose_block_size,
                    load_config_and_tokenizer, verdict_scope)
from .sampling import prompt_ids, sample_continuations

__all__ = [
    "DOCUMENT_COLUMN", "add_document_ids", "check_text_column", "check_unit_column", "count_units",
    "drop_empty_texts", "evaluation_blocks", "load_raw_datasets", "no_progress_bar", "training_blocks",
    "perplexity", "with_perplexity",
    "DEFAULT_BLOCK_SIZE", "ClmModelArguments", "build_model", "check_causal_lm", "choose_block_size",
    "load_config_and_tokenizer", "verdict_scope",
    "prompt_ids", "sample_continuations",
]
