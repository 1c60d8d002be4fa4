"""Issue 49 item 3: the mechanism is planned from public inputs only (``--public_dataset_size``).

Under add/remove adjacency the number of training examples N (or units) differs between neighbouring datasets, so a
mechanism whose q = B/N, σ, steps T, planner's batch or divisor is computed from the actual count can leak membership
through them (Opacus issues 819 and 571). With a declared public size every one of them comes from it: two datasets
that differ in one example — or in one unit under ``--privacy_unit_column`` — give the identical mechanism (q, σ, T, B,
C, the divisor, the sampler's rate and steps per epoch, the training loader's length) and identical plan lines; the
actual count only changes how many rows each Poisson draw finds. Without one the run says once that N was treated as
public, and ``privacy.json`` and the card record where N came from and the neighbouring relation.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("single_thread")]

N, USERS = 64, 16


def _model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=32, num_labels=2))


def _rows(drop_row: int | None = None, drop_user: str | None = None):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (N, 8), generator=g)
    rows = [{"input_ids": ids[i].tolist(), "attention_mask": [1] * 8, "labels": int(ids[i, 0] > 27),
             "user_id": f"u{i % USERS}"} for i in range(N)]
    rows = [r for i, r in enumerate(rows) if i != drop_row and r["user_id"] != drop_user]
    return Dataset.from_list(rows)


def _args(tmp_path, **over):
    from hf_dp import DPTrainingArguments

    kw = dict(output_dir=str(tmp_path), optim="dp_adamw", epsilon=3.0, delta=1e-3, per_sample_max_grad_norm=1.0,
              per_device_train_batch_size=8, num_train_epochs=2, report_to=[], use_cpu=True, disable_tqdm=True,
              save_strategy="no", dp_seed=0, trainable="all", logging_strategy="no")
    kw.update(over)
    return DPTrainingArguments(**kw)


def _trainer(tmp_path, data, caplog=None, **over):
    from hf_dp import DPTrainer

    if caplog is not None:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_dp"):
            tr = DPTrainer(model=_model(), args=_args(tmp_path, **over), train_dataset=data)
        tr._plan_lines = [r.getMessage() for r in caplog.records if r.name.startswith("hf_dp")]
        return tr
    return DPTrainer(model=_model(), args=_args(tmp_path, **over), train_dataset=data)


def mechanism(tr) -> dict:
    """Everything the accountant's ε rests on, and what the run divides by, as the trainer built it."""
    from hf_dp.run import contract

    spec, opt = tr.privacy_spec, tr.create_optimizer()
    report = tr.privacy_report()
    return {
        "q": spec.sample_rate, "sigma": spec.noise_multiplier, "T": spec.planned_steps, "B": spec.expected_batch_size,
        "C": spec.max_grad_norm, "N": spec.dataset_size, "delta": spec.delta,
        "divisor": float(opt.expected_batch_size), "privatizer": (opt.noise_multiplier, opt.max_grad_norm),
        "sampler": (tr.dp.sampler.sample_rate, tr.dp.sampler.steps_per_epoch, tr.dp.sampler.micro_batches),
        "loader_steps": len(tr.get_train_dataloader()), "snapshot": contract.mechanism_snapshot(tr.args, tr.dp.mechanism, tr.model),
        "report": {k: report[k] for k in ("dataset_size", "sample_rate", "noise_multiplier", "planned_steps",
                                          "expected_batch_size", "max_grad_norm", "dataset_size_source",
                                          "neighbouring_relation", "unit_of_privacy", "privacy_unit")},
    }


@pytest.mark.parametrize("level", ["example", "unit"])
def test_neighbouring_datasets_with_the_same_declared_size_give_the_same_mechanism(tmp_path, caplog, level):
    unit = {"privacy_unit_column": "user_id"} if level == "unit" else {}
    declared = USERS if level == "unit" else N
    d = _rows()
    neighbour = _rows(drop_user="u3") if level == "unit" else _rows(drop_row=17)
    a = _trainer(tmp_path / "a", d, caplog, public_dataset_size=declared, **unit)
    b = _trainer(tmp_path / "b", neighbour, caplog, public_dataset_size=declared, **unit)
    assert (a.num_units, b.num_units) == ((USERS, USERS - 1) if level == "unit" else (N, N - 1))  # they differ
    ma, mb = mechanism(a), mechanism(b)
    assert ma == mb
    assert ma["N"] == declared and ma["q"] == 8 / declared and ma["divisor"] == 8.0
    assert a._plan_lines == b._plan_lines and any("hf_dp plan" in line for line in a._plan_lines)
    assert any("--public_dataset_size" in line and "declared" in line for line in a._plan_lines)
    report = ma["report"]
    assert report["dataset_size_source"] == "declared public (--public_dataset_size)"
    assert report["neighbouring_relation"] == ("add/remove one unit (all rows of one 'user_id')" if level == "unit"
                                               else "add/remove one example")
    # the defect: without the declaration q, σ, T and the plan follow the actual count
    c = _trainer(tmp_path / "c", d, caplog, **unit)
    e = _trainer(tmp_path / "e", neighbour, caplog, **unit)
    assert mechanism(c)["q"] != mechanism(e)["q"] and c._plan_lines != e._plan_lines


def test_without_a_declared_size_the_run_says_once_that_n_was_treated_as_public(tmp_path, caplog):
    tr = _trainer(tmp_path, _rows(), caplog)
    said = [line for line in tr._plan_lines if "treated as public" in line]
    assert len(said) == 1 and "N = 64" in said[0] and "--public_dataset_size" in said[0], tr._plan_lines
    tr.save_model()
    privacy = json.loads((tmp_path / "privacy.json").read_text())
    assert privacy["dataset_size"] == N and privacy["dataset_size_source"] == "actual count (treated as public)"
    assert privacy["neighbouring_relation"] == "add/remove one example"
    card = " ".join((tmp_path / "README.md").read_text().split())
    assert "| neighbouring relation | add/remove one example |" in card
    assert "| N (training examples, the accountant's) | 64 — the actual count, treated as public" in card
    assert ("N = 64, the actual count of training examples (stated in this card and implied by q), is treated as "
            "public") in card
    # declared: the card says so, and that the actual count is not released
    out = tmp_path / "declared"
    tr = _trainer(out, _rows(drop_row=3), public_dataset_size=100)
    tr.save_model()
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["dataset_size"] == 100 and privacy["sample_rate"] == 8 / 100
    assert "63" not in json.dumps({k: v for k, v in privacy.items() if k not in ("trainable", "ledger", "run_id")})
    card = " ".join((out / "README.md").read_text().split())
    assert "| N (training examples, the accountant's) | 100 — a declared public size (`--public_dataset_size`)" in card
    assert "N = 100 is a declared public size (`--public_dataset_size`), not the count of the training data" in card


def test_a_training_set_larger_than_declared_keeps_the_declared_mechanism_and_warns(tmp_path, caplog):
    """The actual count only changes how many rows the draws find: q = B/N_public and the steps per epoch stay the
    declared size's (T public); a count far above it (here 4x) is said once to the operator (larger batches)."""
    tr = _trainer(tmp_path, _rows(), caplog, public_dataset_size=16, per_device_train_batch_size=4)
    spec = tr.privacy_spec
    assert spec.sample_rate == 4 / 16 and tr.dp.sampler.steps_per_epoch == 4 and spec.planned_steps == 8
    assert tr.dp.sampler.num_samples == N  # every actual example can be drawn, each at rate q
    warned = [line for line in tr._plan_lines if "larger than the declared" in line]
    assert len(warned) == 1, tr._plan_lines
    sizes = [len(batch) for batch in tr.dp.sampler]
    assert sum(sizes) / len(sizes) > 8  # about q·N = 16 rows per step, not B = 4


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "64"])
def test_a_declared_size_that_is_not_a_positive_whole_number_is_refused(tmp_path, bad):
    with pytest.raises(ValueError) as e:
        _args(tmp_path, public_dataset_size=bad)
    assert str(e.value) == ("--public_dataset_size must be a whole number >= 1 (the number of training examples, or of "
                            f"units with --privacy_unit_column, declared public), got {bad!r}")


def test_the_checks_use_the_declared_size(tmp_path):
    from hf_dp import DPTrainer

    with pytest.raises(ValueError, match=r"is larger than the dataset \(N = 4\)"):
        DPTrainer(model=_model(), args=_args(tmp_path, public_dataset_size=4), train_dataset=_rows())
    with pytest.raises(ValueError, match=r"not below 1/N = 1/500"):
        DPTrainer(model=_model(), args=_args(tmp_path, public_dataset_size=500, delta=1e-2), train_dataset=_rows())


def test_the_recipes_accept_and_use_the_declared_size(tmp_path):
    from recipes import clm, glue
    from recipes.common.args import RecipeError
    from recipes.common.run import check_privacy_settings, compute_budget

    args = glue.parse_args(["--task_name", "qnli", "--output_dir", str(tmp_path), "--public_dataset_size", "5000"])[2]
    assert args.public_dataset_size == 5000
    args = clm.parse_args(["--model_type", "gpt2", "--tokenizer_name", "x", "--output_dir", str(tmp_path),
                           "--public_dataset_size", "300", "--per_device_train_batch_size", "16", "--epsilon", "3"])[2]
    assert args.public_dataset_size == 300
    check_privacy_settings(args, 10)  # 10 actual units, B = 16 <= the declared 300: planned on 300
    args.public_dataset_size = 8
    with pytest.raises(RecipeError, match=r"larger than the training set \(N = 8\)"):
        check_privacy_settings(args, 1000)
    args.public_dataset_size, args.max_steps = 320, 20
    assert compute_budget(args, 7)[0] == compute_budget(args, 9999)[0]  # epochs from the declared N, not the actual


def test_the_card_never_names_the_actual_count_under_a_declared_size():
    """The review of issue 49: a card built from a 🤗 Dataset with Hub info appended "1,000 training examples" (the
    actual, private count) although --public_dataset_size declared N: two neighbouring datasets gave two cards."""
    from types import SimpleNamespace

    import datasets

    from hf_dp.hub.describe import card_fields

    def fields(n, declared):
        info = datasets.DatasetInfo(dataset_name="nyu-mll/glue", config_name="sst2")
        train = datasets.Dataset.from_dict({"x": list(range(n))}, info=info)
        args = SimpleNamespace(privacy_unit_column=None, public_dataset_size=declared)
        return card_fields(None, args, train)

    assert "1,000 training examples" in fields(1000, None)["data_description"]  # N treated as public: stated
    assert fields(1000, 5000) == fields(1001, 5000) and "training examples" not in fields(1000, 5000)["data_description"]
