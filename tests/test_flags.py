"""The privacy registry of TrainingArguments fields (hf_dp/flags.py) and its generated table.

* every dataclass field of the installed ``TrainingArguments`` is classified, and the registry names no
  field that does not exist (a stale entry is deleted rather than tolerated: the table is generated for
  the installed version, and enforcement skips nothing silently);
* docs/privacy_flags.md is exactly ``python -m hf_dp.flags_table --markdown``;
* every refusal is reached by an example and raises its registry sentence; refusals and adjustments only
  apply with DP; an unclassified field is refused with DP when set.
"""

from __future__ import annotations

import pathlib

import pytest

from hf_dp import flags, flags_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = dict(optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, delta=1e-3,
            per_device_train_batch_size=8, max_steps=4, report_to=[], use_cpu=True, disable_tqdm=True,
            save_strategy="no", dp_seed=0, trainable="all")

# one example per refused rule: (field, overrides); test_every_refusal_has_an_example checks coverage
REFUSAL_EXAMPLES = [
    ("max_steps", {"max_steps": 0}),
    ("optim_target_modules", {"optim_target_modules": ["attn"]}),
    ("label_smoothing_factor", {"label_smoothing_factor": 0.1}),
    ("fp16", {"fp16": True}),
    ("bf16", {"bf16": True}),
    ("activation_checkpointing", {"activation_checkpointing": True}),
    ("gradient_checkpointing", {"gradient_checkpointing": True}),
    ("torch_compile", {"torch_compile": True}),
    ("torch_compile_backend", {"torch_compile_backend": "inductor"}),
    ("torch_compile_mode", {"torch_compile_mode": "reduce-overhead"}),
    ("use_liger_kernel", {"use_liger_kernel": True}),
    ("neftune_noise_alpha", {"neftune_noise_alpha": 5.0}),
    ("auto_find_batch_size", {"auto_find_batch_size": True}),
    ("data_seed", {"data_seed": 3}),
    ("include_num_input_tokens_seen", {"include_num_input_tokens_seen": "non_padding"}),
    ("report_to", {"report_to": ["tensorboard"], "push_to_hub": True, "hub_model_id": "me/model"}),
    ("report_to", {"report_to": "trackio", "push_to_hub": True}),
    ("enable_jit_checkpoint", {"enable_jit_checkpoint": True}),
    ("hub_strategy", {"hub_strategy": "checkpoint"}),
    ("hub_strategy", {"hub_strategy": "all_checkpoints"}),
    ("parallelism_config", {"parallelism_config": {"tp_size": 2}}),
    ("label_names", {"label_names": ["start_positions", "end_positions"]}),
    ("train_sampling_strategy", {"train_sampling_strategy": "batch_rebalance"}),
    ("train_sampling_strategy", {"train_sampling_strategy": "sequential"}),
    ("fsdp_config", {"fsdp_config": {"version": 2}}),  # without --fsdp (--fsdp itself is adjusted: hf_dp.clipping.sharding)
    ("deepspeed", {"deepspeed": {"train_micro_batch_size_per_gpu": 8}}),
    ("debug", {"debug": "underflow_overflow"}),
    ("skip_memory_metrics", {"skip_memory_metrics": False}),
]


def _args(tmp_path, **overrides):
    from hf_dp import DPTrainingArguments

    return DPTrainingArguments(**{**BASE, "output_dir": str(tmp_path), **overrides})


def test_every_training_arguments_field_is_classified():
    names = [f.name for f in flags.hf_fields()]
    missing = [n for n in names if n not in flags.FLAGS]
    assert not missing, (
        f"transformers' TrainingArguments has fields that hf_dp/flags.py does not classify: {missing}. Read what "
        "Trainer does with each, add a rule to FLAGS (refused/adjusted/safe/outside, with the reason) and run "
        f"`{flags_table.REGENERATE}`; until then DPTrainingArguments refuses them under DP when set."
    )


def test_registry_names_only_existing_fields():
    names = {f.name for f in flags.hf_fields()}
    stale = sorted(set(flags.FLAGS) - names)
    assert not stale, f"hf_dp/flags.py classifies fields this transformers' TrainingArguments does not have: {stale}; delete them"


def test_rules_are_well_formed():
    for name, rules in flags.FLAGS.items():
        assert rules, name
        assert rules[-1].applies is None and rules[-1].when is None, f"{name}: the last rule must be unconditional"
        for r in rules[:-1]:
            assert r.applies is not None and r.when, f"{name}: every rule but the last needs a condition and its text"
        for r in rules:
            assert r.status in flags.STATUSES, name
            assert r.reason and "\n" not in r.reason, name
            assert r.adjust is None or r.status == flags.ADJUSTED, name
            if r.status == flags.REFUSED:  # the error message: names the flag, one sentence
                assert r.reason.startswith("--"), name
                assert r.reason.count(". ") == 0 and not r.reason.endswith("."), name


def test_doc_is_generated_from_the_registry():
    committed = (ROOT / "docs" / "privacy_flags.md").read_text()
    assert committed == flags_table.markdown(), f"docs/privacy_flags.md is stale: run `{flags_table.REGENERATE}`"


def test_cli_writes_the_table(capsys):
    assert flags_table.main(["--markdown"]) == 0
    assert capsys.readouterr().out == flags_table.markdown()
    assert flags_table.main([]) == 2


def _raw(**overrides):
    """Raw argument values as DPTrainingArguments.__post_init__ sees them (HF defaults, then BASE and overrides)."""
    import types

    values = {f.name: flags.field_default(f) for f in flags.hf_fields()}
    return types.SimpleNamespace(**{**values, **BASE, "output_dir": "out", **overrides})


def test_every_refused_rule_has_an_example():
    covered = set()
    for name, overrides in REFUSAL_EXAMPLES:
        rule = flags.rule_for(_raw(**overrides), name)
        assert rule.status == flags.REFUSED, (name, overrides)
        covered.add((name, flags.FLAGS[name].index(rule)))
    refused = {(n, i) for n, rules in flags.FLAGS.items() for i, r in enumerate(rules) if r.status == flags.REFUSED}
    assert refused == covered, f"refused rules without an example: {refused - covered}"
    for name in flags.FLAGS:  # and BASE (the defaults) is refused by none
        assert flags.rule_for(_raw(), name).status != flags.REFUSED, name


@pytest.mark.parametrize("name,overrides", REFUSAL_EXAMPLES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(REFUSAL_EXAMPLES)])
def test_refusal_raises_its_registry_sentence(name, overrides, tmp_path):
    with pytest.raises(ValueError) as info:
        _args(tmp_path, **overrides)
    reasons = [r.reason for r in flags.FLAGS[name] if r.status == flags.REFUSED]
    assert str(info.value) in reasons, str(info.value)
    assert "\n" not in str(info.value)


def test_each_report_to_refusal_is_its_own_case(tmp_path):
    tb, trackio = (r.reason for r in flags.FLAGS["report_to"][:2])
    with pytest.raises(ValueError, match="^--report_to tensorboard") as info:
        _args(tmp_path, report_to=["tensorboard"], push_to_hub=True)
    assert str(info.value) == tb
    with pytest.raises(ValueError, match="^--report_to trackio") as info:
        _args(tmp_path, report_to=["trackio"], push_to_hub=True)
    assert str(info.value) == trackio


def test_report_to_allowed_when_nothing_is_pushed_with_the_model(tmp_path, monkeypatch):
    _args(tmp_path, report_to=["tensorboard"])  # no push
    _args(tmp_path, report_to=["trackio"], push_to_hub=True, trackio_static_space_id=False)  # no Space sync on push
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path.parent / "tb_elsewhere"))
    _args(tmp_path / "out", report_to=["tensorboard"], push_to_hub=True)  # event files outside output_dir
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "out" / "runs"))
    with pytest.raises(ValueError, match="^--report_to tensorboard with --push_to_hub"):
        _args(tmp_path / "out", report_to=["tensorboard"], push_to_hub=True)


def test_safe_values_of_conditional_flags_are_accepted(tmp_path):
    _args(tmp_path, train_sampling_strategy="group_by_length")
    args = _args(tmp_path, hub_strategy="end", train_sampling_strategy="random", label_names=["labels"],
                 debug="tpu_metrics_debug", label_smoothing_factor=0.0, include_num_input_tokens_seen="no",
                 lr_scheduler_type="cosine", dataloader_drop_last=True)
    assert str(getattr(args.hub_strategy, "value", args.hub_strategy)) == "end"


def test_max_grad_norm_is_adjusted_to_zero_with_dp_only(tmp_path):
    from hf_dp import DPTrainingArguments

    assert _args(tmp_path, max_grad_norm=5.0).max_grad_norm == 0.0
    plain = DPTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", disable_dp=True, use_cpu=True,
                                report_to=[], max_grad_norm=5.0)
    assert plain.max_grad_norm == 5.0


def test_refusals_do_not_apply_with_disable_dp(tmp_path):
    """--disable_dp runs are plain HF runs: every refused flag (that HF itself accepts here) is accepted."""
    from hf_dp import DPTrainingArguments

    DPTrainingArguments(output_dir=str(tmp_path), optim="adamw_torch", disable_dp=True, use_cpu=True, report_to=[],
                        auto_find_batch_size=True, label_smoothing_factor=0.1, train_sampling_strategy="group_by_length",
                        hub_strategy="checkpoint", skip_memory_metrics=False, include_num_input_tokens_seen=True,
                        neftune_noise_alpha=5.0, enable_jit_checkpoint=False, label_names=["labels", "x"],
                        optim_target_modules=["attn"], debug="underflow_overflow", max_steps=0)


def test_unclassified_field_is_refused_with_dp_when_set(tmp_path, monkeypatch):
    monkeypatch.delitem(flags.FLAGS, "eval_delay")
    _args(tmp_path)  # at its default: accepted
    with pytest.raises(ValueError) as info:
        _args(tmp_path, eval_delay=3)
    assert str(info.value).startswith("--eval_delay is a TrainingArguments field of transformers ")
    assert str(info.value).endswith("that hf_dp has not classified for privacy (hf_dp/flags.py), so it is not allowed with DP until it is")


def test_refused_rules_precede_hf_validation(tmp_path):
    """The registry runs on the raw values before HF's __post_init__: --deepspeed is refused with our sentence
    instead of HF importing deepspeed, and --torch_compile_mode is refused before HF turns on torch_compile."""
    with pytest.raises(ValueError, match="^--deepspeed is not supported with DP"):
        _args(tmp_path, deepspeed="ds_config.json")
    with pytest.raises(ValueError, match="^--torch_compile_mode turns on torch.compile"):
        _args(tmp_path, torch_compile_mode="max-autotune")


def test_jit_checkpoint_is_never_resumable_under_hf_dp(tmp_path):
    """Backs the refusal of --enable_jit_checkpoint: HF's JIT checkpoint (run here directly, as on SIGTERM) keeps an
    in-progress sentinel while DPTrainer writes the completion marker, then deletes it, so the checkpoint is incomplete.
    When this starts failing, the refusal can be lifted (hf_dp/flags.py)."""
    from transformers.trainer_jit_checkpoint import CheckpointManager

    from hf_dp import DPTrainer
    from hf_dp.run.checkpointing import checkpoint_problem
    from tests.test_misuse import bert, dataset

    trainer = DPTrainer(model=bert(), args=_args(tmp_path, max_steps=1), train_dataset=dataset())
    trainer.train()
    CheckpointManager(trainer).execute_jit_checkpoint()
    problem = checkpoint_problem(str(tmp_path / "checkpoint-1"))
    assert problem is not None and "checkpoint-is-incomplete.txt" in problem, problem
