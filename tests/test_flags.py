"""The privacy table of every ``TrainingArguments`` field (hf_dp/flags.py, docs/privacy_flags.md).

* every field of the installed transformers' ``TrainingArguments`` is classified, and the registry names no
  field that does not exist (a new or removed field fails here until someone classifies it);
* the committed docs/privacy_flags.md is what the registry generates;
* every refusal fires for a DP run with its one-sentence message, and not for a ``--disable_dp`` run;
  each of these flags was accepted silently on 0b9495a except fp16 and include_num_input_tokens_seen.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from transformers import TrainingArguments

from hf_dp import DPTrainingArguments
from hf_dp.flags import ADJUSTED, POLICIES, REFUSED, REFUSED_WHEN, SAFE, markdown, unclassified

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "privacy_flags.md"


def test_every_training_arguments_field_is_classified():
    fields = [f.name for f in dataclasses.fields(TrainingArguments)]
    assert unclassified() == [], "classify these fields in hf_dp/flags.py (safe / adjusted / refused, with a reason)"
    assert sorted(set(POLICIES) - set(fields)) == [], "the registry names fields this transformers does not have"
    assert unclassified(fields + ["a_field_of_a_future_release"]) == ["a_field_of_a_future_release"]
    for name, p in POLICIES.items():
        assert p.status in (SAFE, ADJUSTED, REFUSED, REFUSED_WHEN), name
        assert p.reason and len(p.reason) > 10, name
        assert (p.refuse_if is not None) == (p.status in (REFUSED, REFUSED_WHEN)), name
        assert p.refuse_if is None or (p.message and "\n" not in p.message), name


def test_doc_is_generated_from_the_registry():
    assert DOC.read_text() == markdown(), "regenerate: python -m hf_dp.flags > docs/privacy_flags.md"


REFUSALS = {
    "auto_find_batch_size": True,
    "hub_strategy": "checkpoint",
    "data_seed": 3,
    "label_smoothing_factor": 0.1,
    "gradient_checkpointing": True,
    "activation_checkpointing": True,
    "torch_compile": True,
    "use_liger_kernel": True,
    "neftune_noise_alpha": 5.0,
    "train_sampling_strategy": "group_by_length",
    "optim_target_modules": ["attn"],
    "parallelism_config": {"tp_size": 2},
    "fsdp": "full_shard",
    "debug": "underflow_overflow",
    "include_num_input_tokens_seen": True,
    "fp16": True,
}


@pytest.mark.parametrize("flag", list(REFUSALS))
def test_refused_flags(flag, tmp_path):
    with pytest.raises(ValueError) as info:
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True, **{flag: REFUSALS[flag]})
    assert str(info.value) == POLICIES[flag].message


@pytest.mark.parametrize("flag", ["auto_find_batch_size", "hub_strategy", "data_seed", "label_smoothing_factor", "train_sampling_strategy", "debug"])
def test_refusals_are_for_dp_runs_only(flag, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), disable_dp=True, optim="adamw_torch", use_cpu=True, **{flag: REFUSALS[flag]})
    assert args.dp_enabled is False


@pytest.mark.parametrize("value", ["every_save", "end"])
def test_hub_strategies_that_push_the_final_folder_only_are_accepted(value, tmp_path):
    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, use_cpu=True, hub_strategy=value)
    assert str(getattr(args.hub_strategy, "value", args.hub_strategy)) == value and args.max_grad_norm == 0.0


def test_hf_push_ignores_checkpoint_folders():
    """The reason hub_strategy every_save/end is 'safe': HF's own push ignores checkpoint-* (and _*)."""
    import inspect

    from transformers import Trainer

    src = inspect.getsource(Trainer.push_to_hub) + inspect.getsource(Trainer._push_from_checkpoint)
    assert "PREFIX_CHECKPOINT_DIR" in src and '"_*"' in src
