"""Issue 50: the mechanism as one immutable value built from public inputs, the run's privacy state in one object
(``DPTrainer.dp``), no module writing a DPTrainer's attributes, and few functions taking a whole trainer."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re

import pytest
import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.privacy.mechanism import Mechanism
from hf_dp.run.state import PrivacyState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: DPTrainer's own modules: the class, and the trainers built on it (they set their own subclass' attributes)
OWN = ("hf_dp/trainer.py", "hf_dp/sft/", "hf_dp/dpo/")
#: names a function gives a trainer it was handed
TRAINER_NAME = re.compile(r"^(trainer|\w+_trainer|winner)$")
MAX_TRAINER_FUNCTIONS = 10


def _modules():
    for dirpath, _, files in os.walk(os.path.join(ROOT, "hf_dp")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
                yield rel, ast.parse(open(path, encoding="utf-8").read(), filename=rel)


def _own(rel: str) -> bool:
    return any(rel == o or (o.endswith("/") and rel.startswith(o)) for o in OWN)


def _targets(node):
    if isinstance(node, (ast.Assign,)):
        for t in node.targets:
            yield from _flatten(t)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        yield from _flatten(node.target)


def _flatten(t):
    if isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _flatten(e)
    else:
        yield t


def trainer_attribute_writes() -> list[str]:
    """Every ``trainer.x = …`` (a name a trainer is handed under), ``setattr(trainer, …)`` and ``del trainer.x`` in
    hf_dp outside DPTrainer's own modules."""
    found = []
    for rel, tree in _modules():
        if _own(rel):
            continue
        for node in ast.walk(tree):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and TRAINER_NAME.match(t.value.id):
                    found.append(f"{rel}:{node.lineno} {t.value.id}.{t.attr} =")
            if isinstance(node, ast.Delete):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and TRAINER_NAME.match(t.value.id):
                        found.append(f"{rel}:{node.lineno} del {t.value.id}.{t.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                    and node.args and isinstance(node.args[0], ast.Name) and TRAINER_NAME.match(node.args[0].id)):
                found.append(f"{rel}:{node.lineno} {node.func.id}({node.args[0].id}, …)")
    return found


def functions_taking_a_trainer() -> list[str]:
    """Functions (and methods) of hf_dp outside DPTrainer's own modules with a parameter that is a whole trainer."""
    found = []
    for rel, tree in _modules():
        if _own(rel):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
                if any(TRAINER_NAME.match(n) for n in names):
                    found.append(f"{rel}:{node.lineno} {node.name}")
    return found


def test_no_module_assigns_an_attribute_of_a_trainer():
    writes = trainer_attribute_writes()
    assert not writes, "assign to the run's state (trainer.dp, hf_dp.run.state) or return the value:\n" + "\n".join(writes)


def test_the_checks_see_what_they_check():
    """The two scans find what they look for (each would find the pattern it forbids)."""
    tree = ast.parse("def f(trainer, x):\n    trainer.ledger = x\n    setattr(trainer, 'a', 1)\n    trainer.dp.ledger = x\n")
    writes = [t for n in ast.walk(tree) for t in _targets(n)
              if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and TRAINER_NAME.match(t.value.id)]
    assert [w.attr for w in writes] == ["ledger"]  # trainer.dp.ledger is the state's attribute, not the trainer's


def test_few_functions_take_a_whole_trainer():
    found = functions_taking_a_trainer()
    assert len(found) <= MAX_TRAINER_FUNCTIONS, (
        f"{len(found)} functions take a trainer (at most {MAX_TRAINER_FUNCTIONS}: give them the pieces they use):\n"
        + "\n".join(found))


def test_trainer_module_stays_small():
    with open(os.path.join(ROOT, "hf_dp", "trainer.py"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 450


# ------------------------------------------------------------------------------------------------------- Mechanism
PUBLIC = dict(declared=True, per_device_batch=8, accumulation=2, world_size=1, delta=1e-5, epsilon=3.0,
              noise_multiplier=None, max_grad_norm=0.5, accountant="prv", max_steps=0, num_train_epochs=2.0)


def test_a_mechanism_planned_twice_from_the_same_public_inputs_is_equal_and_immutable():
    a, b = Mechanism.plan(n=4000, **PUBLIC), Mechanism.plan(n=4000, **PUBLIC)
    assert a == b and hash(a) == hash(b)
    assert a != Mechanism.plan(n=4001, **PUBLIC)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.spec = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.spec.noise_multiplier = 0.0
    assert a.sample_rate == pytest.approx(16 / 4000) and a.planned_steps == 2 * a.steps_per_epoch
    assert a.with_target_epsilon(5.0).target_epsilon == 5.0 and a.target_epsilon == 3.0


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(cfg)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (n, 6), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 6] * n,
                              "labels": torch.randint(0, 2, (n,), generator=g).tolist()})


def test_two_datasets_with_the_same_public_inputs_give_equal_mechanisms_and_privacy_json_reads_it(tmp_path):
    trainers = []
    for n, seed in ((300, 1), (287, 2)):  # different rows and counts, the same declared public size
        args = DPTrainingArguments(output_dir=str(tmp_path / f"r{seed}"), per_device_train_batch_size=10,
                                   num_train_epochs=1, epsilon=3.0, delta=1e-4, public_dataset_size=300,
                                   report_to=[], use_cpu=True, dp_max_length=8)
        trainers.append(DPTrainer(model=_model(), args=args, train_dataset=_data(n, seed)))
    a, b = (t.dp.mechanism for t in trainers)
    assert isinstance(trainers[0].dp, PrivacyState)
    assert a == b
    assert trainers[0].privacy_spec is a.spec and trainers[0].ledger.spec == a.spec  # the ledger accounts for it
    trainers[0].save_model()
    with open(tmp_path / "r1" / "privacy.json", encoding="utf-8") as f:
        written = json.load(f)
    for key, value in a.describe().items():
        assert written[key] == value, key


def test_a_printed_state_shows_no_private_fact(tmp_path):
    """A review of issue 50: ``repr(trainer.dp)`` (a default dataclass repr) printed every unit's rows, the actual
    count under a declared N and the sampling key; it names the public mechanism only."""
    rows = _data(120, 3).add_column("user", [f"u{i % 7}" for i in range(120)])
    args = DPTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=1,
                               epsilon=3.0, delta=1e-3, privacy_unit_column="user", public_dataset_size=10,
                               report_to=[], use_cpu=True, dp_max_length=8)
    tr = DPTrainer(model=_model(), args=args, train_dataset=rows)
    tr.dp.sampling_key = b"\x01" * 32
    text = repr(tr.dp) + str(tr.dp) + repr(tr.dp.units) + repr(tr.dp.contract) + repr(tr.dp.lineage)
    assert "Mechanism(" in repr(tr.dp)
    for private in ("rows=", "[0, 7", "120", "sampling_key", "\\x01", "of_row", "planned_dataset"):
        assert private not in text, private
