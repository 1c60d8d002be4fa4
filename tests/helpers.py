"""Shared tiny builders for the trainer tests (no Hub access: random configs, synthetic data).

* :func:`make_tokenizer` — a ``BertTokenizerFast`` over a 60-entry WordPiece vocab written to disk.
* :func:`make_model` — a tiny random ``BertForSequenceClassification`` (vocab 60, hidden 16, 2 layers).
* :func:`make_pair_dataset` — a *learnable* synthetic sentence-pair task with variable lengths
  (2–6 words per sentence): label 1 pairs are written with words w0…w4, label 0 pairs with w5…w9
  (each word comes from the other label's pool with probability ``noise``).
* :func:`dp_args` — ``DPTrainingArguments`` with quiet, fast, CPU-only defaults.
* :class:`StepCounter` — a callback that counts optimizer steps; :class:`StopAt` — one that stops after a step.
* :func:`spy_draws_and_noise` — record every Poisson draw and every noise vector of the runs of a test.
* :func:`tiny_llama`, :func:`preference_pairs` — a tiny random Llama (2 layers, width 16) from a config and synthetic
  prompt/chosen/rejected pairs of a few users, for the preference-tuning tests (hf_dp.dpo).
* :func:`transformers_warnings` — the warnings transformers' loggers emit inside a block.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random

import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast, DataCollatorWithPadding, TrainerCallback

from hf_dp import DPTrainingArguments

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB_SIZE = 60
WORDS = [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIAL))]  # 55 words
#: the recipes' flags for a tiny Llama from a config (recipes/sft.py, recipes/dpo.py tests; offline, seconds on CPU)
TINY_LLAMA_ARGS = ["--model_type", "llama", "--config_overrides",
                   "hidden_size=16,intermediate_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2"]


def tiny_llama(tok, seed: int = 0, cls=None, **overrides):
    """A tiny random Llama (``LlamaForCausalLM``, or ``cls``) over ``tok``'s vocabulary, from a config (no weights
    loaded: it starts at random)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=96,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **overrides)
    return (cls or LlamaForCausalLM)(cfg)


def random_words(r: random.Random, lo: int, hi: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def preference_pairs(n: int = 40, users: int = 8, seed: int = 0) -> list[dict]:
    """``n`` prompt/chosen/rejected pairs of random words, pair i from user ``u{i % users}``."""
    r = random.Random(seed)
    return [{"prompt": random_words(r, 2, 5), "chosen": " " + random_words(r, 1, 4),
             "rejected": " " + random_words(r, 1, 4), "user_id": f"u{i % users}"} for i in range(n)]


@contextlib.contextmanager
def transformers_warnings():
    """A list that gets every message transformers' loggers emit at warning level or above inside the block (their
    own verbosity set to warning meanwhile)."""
    from transformers.utils import logging as hf_logging

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    root, handler, level = logging.getLogger("transformers"), Keep(logging.WARNING), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)
        hf_logging.set_verbosity(level)


def tiny_config(**overrides) -> BertConfig:
    kw = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
        hidden_dropout_prob=0.0,
        # BERT's default 0.02 leaves this 16-wide net on a plateau: with only the last block trainable
        # the task is learned only after a late phase transition that 16 linearly-decayed steps never
        # reach. 0.3 gives informative random features, so a DP run learns from the first steps.
        initializer_range=0.3,
        attention_probs_dropout_prob=0.0,
    )
    kw.update(overrides)
    return BertConfig(**kw)


def make_model(seed: int = 0, **overrides) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_config(**overrides))


def make_tokenizer(directory) -> BertTokenizerFast:
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tokens = SPECIAL + WORDS
    with open(os.path.join(directory, "vocab.txt"), "w") as f:  # the classic WordPiece vocab file
        f.write("\n".join(tokens) + "\n")
    # transformers 5's BertTokenizerFast takes the vocabulary itself (``vocab=``), not ``vocab_file=``
    return BertTokenizerFast(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True)


@functools.lru_cache(maxsize=None)
def _pair_texts(n: int, seed: int, noise: float, pool: int) -> tuple:
    rng = random.Random(seed)
    pools = (WORDS[pool : 2 * pool], WORDS[:pool])  # label 0 words, label 1 words
    rows = []
    for i in range(n):
        label = rng.randint(0, 1)

        def sentence():
            out = []
            for _ in range(rng.randint(2, 6)):
                own = rng.random() >= noise
                out.append(rng.choice(pools[label if own else 1 - label]))
            return " ".join(out)

        rows.append((sentence(), sentence(), label))
    return tuple(rows)


def make_pair_dataset(tokenizer, n: int = 256, seed: int = 0, noise: float = 0.1, pool: int = 5):
    """A ``datasets.Dataset`` with input_ids / token_type_ids / attention_mask / labels (unpadded)."""
    from datasets import Dataset

    rows = _pair_texts(n, seed, noise, pool)
    enc = tokenizer([a for a, _, _ in rows], [b for _, b, _ in rows])
    return Dataset.from_dict(
        {
            "input_ids": enc["input_ids"],
            "token_type_ids": enc["token_type_ids"],
            "attention_mask": enc["attention_mask"],
            "labels": [y for _, _, y in rows],
        }
    )


def make_collator(tokenizer) -> DataCollatorWithPadding:
    return DataCollatorWithPadding(tokenizer)


def dp_args(output_dir, **overrides) -> DPTrainingArguments:
    kw = dict(
        output_dir=str(output_dir),
        optim="dp_adamw",
        epsilon=8.0,
        delta=1e-5,
        per_sample_max_grad_norm=1.0,
        learning_rate=5e-3,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        num_train_epochs=2,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dp_seed=1,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return DPTrainingArguments(**kw)


def mean_loss(model, dataset, collator, batch_size: int = 128) -> float:
    """Mean cross-entropy of ``model`` on ``dataset`` (eval mode, no grad)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(len(dataset), start + batch_size))]
            batch = collator(rows)
            labels = batch.pop("labels")
            logits = model(**batch).logits
            total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
            count += len(rows)
    model.train(was_training)
    return total / count


class StepCounter(TrainerCallback):
    """Counts optimizer steps (``on_optimizer_step``)."""

    def __init__(self):
        self.optimizer_steps = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer_steps += 1


class StopAt(TrainerCallback):
    """Stops training right after global step ``at`` (an interruption after that step's checkpoint, if it has one)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True
        return control


def spy_draws_and_noise(monkeypatch) -> tuple[list, list]:
    """(draws, noises): every Poisson draw (tuple of indices) and every noise vector the privatizer adds (flattened),
    in order, until ``monkeypatch`` undoes the spies."""
    from hf_dp.privacy.privatizer import PrivateOptimizer
    from hf_dp.privacy.sampler import PoissonBatchSampler

    draws, noises = [], []
    original_iter, original_noise = PoissonBatchSampler.__iter__, PrivateOptimizer.add_noise

    def spy_iter(self):
        for batch in original_iter(self):
            draws.append(tuple(batch))
            yield batch

    def spy_noise(self):
        out = original_noise(self)
        noises.append(torch.cat([(p.grad - p.summed_grad.view_as(p)).reshape(-1) for p in self.params]).clone())
        return out

    monkeypatch.setattr(PoissonBatchSampler, "__iter__", spy_iter)
    monkeypatch.setattr(PrivateOptimizer, "add_noise", spy_noise)
    return draws, noises


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def dpo_tokenizer(folder):
    """The preference tests' tokenizer (:func:`make_tokenizer` with ``[SEP]`` as its end-of-sequence token)."""
    t = make_tokenizer(folder)
    t.eos_token = "[SEP]"
    return t


def dpo_config(tmp_path, cls=None, **over):
    """A small DP config for the preference tests (``cls``: ``hf_dp.dpo.DPDPOConfig`` by default, or the reward
    trainer's): ε 3, 4 pairs a device batch, one epoch, a fixed ``dp_seed``, sequences of at most 64 tokens."""
    if cls is None:
        from hf_dp.dpo import DPDPOConfig as cls
    kw = dict(output_dir=str(tmp_path / "out"), epsilon=3.0, per_device_train_batch_size=4, num_train_epochs=1,
              use_cpu=True, report_to="none", learning_rate=1e-2, logging_steps=1, save_strategy="no", dp_seed=1,
              max_length=64, disable_tqdm=True, dataloader_num_workers=0)
    kw.update(over)
    return cls(**kw)


def drawn(trainer, batch) -> dict:
    """``batch`` (a micro-batch made by hand, or by the training collator outside the loader) as a new draw of
    ``trainer``'s Poisson loader: DPTrainer's step trains only on micro-batches its loader tagged, each once, with the
    tag's rows, in order within a step (hf_dp.run.step.check_drawn_by). Tests of the step's arithmetic feed it batches
    of their own making: each is micro-batch 0 of a new logical draw (the step being accumulated is forgotten)."""
    from hf_dp.run.data import _batch_rows
    from hf_dp.run.draws import DRAWN_KEY

    batch = {k: v for k, v in dict(batch).items() if k != DRAWN_KEY}
    trainer.dp.sampler.yielded += 1  # counted as the sampler's draw, so that the loader's later draws come after it
    trainer.dp.sampler.logical += 1
    trainer.dp.contract.accumulating = None
    return {**batch, DRAWN_KEY: (trainer.dp.contract.loader_token, trainer.dp.sampler.yielded,
                                 trainer.dp.sampler.logical, 0, _batch_rows(batch))}
