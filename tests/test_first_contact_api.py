"""Issue 53, the API's first contact: ``trainer.save_model(folder)`` writes a release without the pickled
``training_args.bin`` (checkpoints keep it), and evaluation on a CPU-only machine prints no ``pin_memory`` warning."""

from __future__ import annotations

import warnings

import torch
from datasets import Dataset
from transformers import BertConfig, BertForSequenceClassification

from hf_dp import DPTrainer, DPTrainingArguments


def _trainer(tmp_path, **kw):
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=32, num_labels=2)
    g = torch.Generator().manual_seed(1)
    data = Dataset.from_dict({"input_ids": torch.randint(5, 60, (80, 6), generator=g).tolist(),
                              "attention_mask": [[1] * 6] * 80, "labels": torch.randint(0, 2, (80,), generator=g).tolist()})
    args = DPTrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=2,
                               noise_multiplier=1.0, delta=1e-3, report_to=[], dp_max_length=8,
                               dataloader_pin_memory=True, save_strategy="steps", save_steps=2, **kw)
    return DPTrainer(model=BertForSequenceClassification(cfg), args=args, train_dataset=data,
                     eval_dataset=data.select(range(8)).map(lambda r: {"input_ids": [7] + r["input_ids"][1:]}))


def test_a_release_holds_no_training_args_and_a_checkpoint_keeps_them(tmp_path):
    tr = _trainer(tmp_path)
    tr.train()
    assert (tmp_path / "out" / "checkpoint-2" / "training_args.bin").is_file()  # resumes keep HF's files
    tr.save_model(str(tmp_path / "release"))
    names = {p.name for p in (tmp_path / "release").iterdir()}
    assert {"config.json", "privacy.json", "README.md"} <= names and "training_args.bin" not in names, names


def test_evaluation_on_cpu_prints_no_pin_memory_warning(tmp_path):
    tr = _trainer(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.evaluate()
        tr.predict(tr.eval_dataset)
    assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w.message) for w in caught]
