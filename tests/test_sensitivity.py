"""The sensitivity the accountant uses, C, against the micro-batches an attacker would choose (issue 49).

Every test here drives DPTrainer's own step (``training_step``: the engine, the run's public token bounds, the split of
a micro-batch above them, the privatizer's clipped sum) with the noise left out, on micro-batches built to move other
examples' clip factors — many copies of one row next to one row of extreme length or of the other label, long rows
next to a short one, many one-row units next to a unit of many rows, huge activations — and asserts, for the sum S the
privatizer would add noise to:

* add/remove: ‖S(D + x) − S(D)‖ ≤ C (the accountant's sensitivity: the noise is σC);
* replace: ‖S(D + x) − S(D + x')‖ ≤ 2C.

Before issue 49, ghost clipping's rounding allowance was γ over the micro-batch's own rows × padded length, added to
every example's norm: one long row joining 128 copies of a short one lowered every copy's clip factor and moved the sum
by more than C (on 72a3f42, 256 copies here: BERT 1.08 C, GPT-2 1.89 C, a unit of 8 rows beside 256 one-row units 5.07 C;
2.37 C in the review); the allowance now comes from public bounds only
(:class:`hf_dp.clipping.common.TokenBounds`).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as T
from datasets import Dataset

from hf_dp import DPTrainer
from hf_dp.run.data import UNITS_KEY
from tests.helpers import dp_args, drawn

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

C = 1e-4  # every example is clipped: each contributes exactly its clipped share
VOCAB = 64
MAX_LEN = 160
ENGINES = ("ghost", "ghost_two_pass", "hooks")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


def bert(seed=0):
    torch.manual_seed(seed)
    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       max_position_embeddings=MAX_LEN, num_labels=2, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, initializer_range=0.3)
    return T.BertForSequenceClassification(cfg)


def gpt2(seed=0, tie=True):
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=MAX_LEN, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       tie_word_embeddings=tie)
    return T.GPT2LMHeadModel(cfg)  # tied input and output embeddings by default


def llama(seed=0):
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, max_position_embeddings=MAX_LEN, tie_word_embeddings=True, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    return T.LlamaForCausalLM(cfg)


def trainer(tmp_path, model, engine, units=False, **over):
    n = 256
    data = {"input_ids": [[5 + i % 50, 6, 7] for i in range(n)], "labels": [i % 2 for i in range(n)]}
    if units:
        data["user"] = [i // 2 for i in range(n)]
    kw = dict(noise_multiplier=1.0, epsilon=None, max_steps=1, trainable="all", per_device_train_batch_size=16,
              per_sample_max_grad_norm=C, clipping=engine, privacy_unit_column="user" if units else None)
    kw.update(over)
    tr = DPTrainer(model=model, args=dp_args(tmp_path / f"out-{engine}", **kw), train_dataset=Dataset.from_dict(data))
    tr.model.train()
    return tr


def batch(rows, causal: bool, labels=None, units=None):
    """A right-padded micro-batch of token-id lists as DPTrainer's collators give it."""
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    out["labels"] = ids.masked_fill(mask == 0, -100) if causal else torch.tensor(labels)
    if units is not None:
        first: dict = {}
        out[UNITS_KEY] = torch.tensor([first.setdefault(u, len(first)) for u in units])
    return out


def clipped_sum(tr, inputs) -> torch.Tensor:
    """The clipped sum DPTrainer's step hands the privatizer for one micro-batch (before any noise), float64."""
    opt = tr.create_optimizer()
    opt.discard_pending()
    tr.training_step(tr.model, drawn(tr, inputs))
    out = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params])
    opt.discard_pending()
    return out


def rand_rows(g, n, length):
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def compositions(causal: bool, max_len: int):
    """(name, D rows, D labels, x row, x label, x' row, x' label): what an attacker puts beside the example."""
    g = torch.Generator().manual_seed(0)
    short = rand_rows(g, 1, 8)[0]
    long_, long2 = rand_rows(g, 2, max_len)
    mixed = [rand_rows(g, 1, 1 + i % 8)[0] for i in range(128)]
    yield "256 copies of an 8-token row + one row of the maximum length", [short] * 256, [0] * 256, long_, 1, long2, 0
    yield "128 different short rows + one long row", mixed, [i % 2 for i in range(128)], long_, 1, short, 0
    yield "24 copies of a long row + one 1-token row", [long_] * 24, [0] * 24, short[:1], 1, long2[:2], 1
    yield "one row + one row", [short], [0], long_, 1, short[:2], 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_adding_or_replacing_one_row_moves_the_sum_by_at_most_C(tmp_path, arch, engine):
    model = {"bert": bert, "gpt2": gpt2, "llama": llama}[arch]()
    causal = arch != "bert"
    tr = trainer(tmp_path, model, engine)
    for name, D, yD, x, yx, x2, yx2 in compositions(causal, MAX_LEN):
        s_d = clipped_sum(tr, batch(D, causal, yD))
        s_dx = clipped_sum(tr, batch(D + [x], causal, yD + [yx]))
        s_dx2 = clipped_sum(tr, batch(D + [x2], causal, yD + [yx2]))
        add = float((s_dx - s_d).norm()) / C
        rep = float((s_dx - s_dx2).norm()) / C
        assert add <= 1.0, f"{arch}/{engine}, {name}: adding one row moved the clipped sum by {add:.6f} C"
        assert rep <= 2.0, f"{arch}/{engine}, {name}: replacing one row moved the clipped sum by {rep:.6f} C"


@pytest.mark.parametrize("mode", ["last_block", "lora", "lora:all-linear", "lora:c_fc"])
@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_the_bound_holds_for_partial_fine_tuning(tmp_path, mode, engine):
    trainable, _, targets = mode.partition(":")  # lora:T = LoRA on the modules --lora_target_modules T names
    tr = trainer(tmp_path, gpt2(), engine, trainable=trainable, lora_target_modules=[targets] if targets else None)
    if targets:  # the adapters sit where the flag says (all-linear: attention and MLP projections, not the LM head)
        adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in tr.model.named_parameters() if p.requires_grad}
        assert adapted == ({"c_attn", "c_proj", "c_fc"} if targets == "all-linear" else {targets}), adapted
    for name, D, yD, x, _, _, _ in compositions(True, MAX_LEN):
        add = float((clipped_sum(tr, batch(D + [x], True)) - clipped_sum(tr, batch(D, True))).norm()) / C
        assert add <= 1.0, f"{mode}/{engine}, {name}: {add:.6f} C"


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_bf16_is_refused(tmp_path, engine):
    """Under bf16 autocast (train()'s, not a direct training_step call) each example's gradient depends on the padded
    length and shape of its micro-batch: 256 copies + one long row moved the sum by 1.62 C (BERT ghost) and 1.38 C
    (Llama hooks) in the review of this change, bf16 weights by up to 3.7 C. DP training refuses both."""
    with pytest.raises(ValueError, match="--bf16 is not supported with DP training"):
        trainer(tmp_path, llama(), engine, bf16=True)
    with pytest.raises(ValueError, match=r"the model in float32 \(or float64\), got bfloat16 weights"):
        trainer(tmp_path, llama().to(torch.bfloat16), engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_huge_and_tiny_activations(tmp_path, engine):
    """Token rows of the (public) embedding table scaled by 1e4 and 1e-4: a copy's norm bound and its rounding terms
    are extreme, the bound still holds."""
    model = bert()
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight[10].mul_(1e4)
        model.bert.embeddings.word_embeddings.weight[11].mul_(1e-4)
    tr = trainer(tmp_path, model, engine)
    g = torch.Generator().manual_seed(3)
    for D, x in (([[10, 11, 12]] * 96, [10] * MAX_LEN), ([[11] * 4] * 96, rand_rows(g, 1, MAX_LEN)[0]),
                 ([[10] * 8] * 64, [11] * 3)):
        add = float((clipped_sum(tr, batch(D + [x], False, [0] * len(D) + [1])) - clipped_sum(tr, batch(D, False, [0] * len(D)))).norm()) / C
        assert math.isfinite(add) and add <= 1.0, f"{engine}: {add:.6f} C"


@pytest.mark.parametrize("engine", ENGINES)
def test_a_unit_of_many_rows_beside_many_one_row_units(tmp_path, engine):
    """User-level: D = 256 one-row units (copies of one 8-token row); x = one unit of 8 rows of 80 tokens (5.07 C
    before issue 49's fix). Adding x moves the sum by at most C, and so does adding one more one-row unit beside a unit
    of many rows."""
    tr = trainer(tmp_path, gpt2(), engine, units=True)
    g = torch.Generator().manual_seed(4)
    short = rand_rows(g, 1, 8)[0]
    big = rand_rows(g, 8, 80)
    D, uD = [short] * 256, list(range(256))
    s_d = clipped_sum(tr, batch(D, True, units=uD))
    s_dx = clipped_sum(tr, batch(D + big, True, units=uD + [999] * 8))
    add = float((s_dx - s_d).norm()) / C
    assert add <= 1.0, f"{engine}: adding a unit of 8 rows moved the clipped sum by {add:.6f} C"
    s_b = clipped_sum(tr, batch(big, True, units=[0] * 8))
    s_bx = clipped_sum(tr, batch(big + [short], True, units=[0] * 8 + [1]))
    add = float((s_bx - s_b).norm()) / C
    assert add <= 1.0, f"{engine}: adding a one-row unit moved the clipped sum by {add:.6f} C"


def test_a_micro_batch_above_the_public_bound_is_split_and_changes_nothing(tmp_path):
    """The run's bounds are public (from --dp_max_length / the model and the planned micro-batch); a Poisson
    micro-batch above them runs as several parts, each example's contribution unchanged, and a longer row is refused."""
    tr = trainer(tmp_path, bert(), "ghost", dp_max_length=64)
    bounds = tr.token_bounds
    assert bounds.max_length == 64 and bounds.max_tokens >= 64
    g = torch.Generator().manual_seed(5)
    rows = rand_rows(g, bounds.max_tokens // 64 + 3, 64)  # above the bound: split
    labels = [i % 2 for i in range(len(rows))]
    whole = clipped_sum(tr, batch(rows, False, labels))
    parts = sum(clipped_sum(tr, batch([r], False, [y])) for r, y in zip(rows, labels))
    torch.testing.assert_close(whole, parts, rtol=1e-4, atol=1e-4 * C)
    with pytest.raises(ValueError, match="dp_max_length"):
        clipped_sum(tr, batch(rand_rows(g, 1, 65), False, [0]))  # (a row of its own longer than the bound)


def test_a_split_keeps_each_unit_whole_and_renumbers_its_parts():
    from hf_dp.clipping.common import TokenBounds
    from hf_dp.run.data import split_to_bounds

    rows = 9
    units = torch.tensor([0, 1, 1, 2, 2, 2, 2, 2, 3])  # unit 2 (5 rows) alone exceeds 3 rows of 10 tokens
    inputs = {"input_ids": torch.arange(rows * 10).view(rows, 10), "attention_mask": torch.ones(rows, 10, dtype=torch.long),
              "labels": torch.arange(rows), UNITS_KEY: units, "flag": True}
    parts = split_to_bounds(inputs, TokenBounds(max_length=10, max_tokens=30))
    seen = []
    for part in parts:
        got = part["labels"].tolist()
        seen += got
        assert part["flag"] is True and part["input_ids"].shape == (len(got), 10)
        owners = units[got].tolist()
        assert part[UNITS_KEY].tolist() == [sorted(set(owners), key=owners.index).index(u) for u in owners]
        assert len(got) <= 3 or len(set(owners)) == 1  # over the bound only as one unit alone
    assert sorted(seen) == list(range(rows))
    for u in range(4):  # each unit's rows in one part
        assert sum(any(units[r] == u for r in part["labels"].tolist()) for part in parts) == 1
    assert split_to_bounds(inputs, TokenBounds(max_length=10, max_tokens=90)) == [inputs]  # within the bound: as it is
    with pytest.raises(ValueError, match="FSDP"):
        split_to_bounds(inputs, TokenBounds(max_length=10, max_tokens=30), fsdp=True)


def test_bounds_whose_allowance_is_not_meaningful_are_refused(tmp_path):
    """The review of this change: without --dp_max_length a long-context model (131,072 positions) gave max_tokens·2⁻²⁴
    > 1, γ negative, and one example moved the sum by up to 13 C. Such bounds are refused before training."""
    from hf_dp.clipping.common import TokenBounds, gamma

    model = llama()
    model.config.max_position_embeddings = 131072
    with pytest.raises(ValueError, match="rounding allowance .* set --dp_max_length"):
        trainer(tmp_path, model, "hooks")
    assert trainer(tmp_path, model, "ghost", dp_max_length=MAX_LEN).token_bounds.max_length == MAX_LEN
    with pytest.raises(ValueError, match="not meaningful"):
        gamma(2**23)
    with pytest.raises(ValueError, match="more than 7%"):
        TokenBounds(4096, 4096 * 300)


def test_padding_beyond_the_bound_is_not_refused_and_changes_nothing(tmp_path):
    """A collator that pads past --dp_max_length (pad_to_multiple_of) was refused at the step that drew a long row,
    revealing that row (the review of this change): the rows' own lengths are what is bounded; padding adds exact
    zeros to every sum."""
    tr = trainer(tmp_path, bert(), "ghost", dp_max_length=40)
    g = torch.Generator().manual_seed(6)
    D, x = rand_rows(g, 64, 6), rand_rows(g, 1, 40)[0]
    padded = batch(D + [x], False, [0] * 64 + [1])
    wide = {k: torch.nn.functional.pad(v, (0, 24)) if k in ("input_ids", "attention_mask") else v for k, v in padded.items()}
    s_wide, s_d = clipped_sum(tr, wide), clipped_sum(tr, batch(D, False, [0] * 64))
    assert float((s_wide - s_d).norm()) / C <= 1.0
    torch.testing.assert_close(s_wide, clipped_sum(tr, padded), rtol=1e-4, atol=1e-4 * C)
    with pytest.raises(ValueError, match="row of 41 tokens exceeds"):
        clipped_sum(tr, batch(rand_rows(g, 1, 41), False, [0]))
