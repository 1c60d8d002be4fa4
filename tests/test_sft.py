"""DPSFTTrainer (issue 40): DP supervised fine-tuning through TRL's SFTTrainer, chat data, completion-only loss, one
user = one unit.

A tiny random Llama from a config, a 60-word WordPiece tokenizer with a chat template (assistant turns inside
``{% generation %}`` so that TRL's ``assistant_only_loss`` masks work), synthetic conversations. What is checked:
it trains end to end and evaluates; prompt tokens are never scored (labels, the per-conversation loss, its gradient);
a user's conversations are clipped together (per-user sensitivity: removing a user moves the clipped sum by <= C,
replacing one by <= 2C); privacy.json names the unit with N = the number of users and the card says "user-level DP
over conversations" and TRL's settings; every TRL flag DP cannot honour is refused in one sentence.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import WORDS, drawn, make_tokenizer, transformers_warnings  # noqa: E402

from hf_dp.models.loss import IGNORE_INDEX  # noqa: E402
from hf_dp.sft import SFT_FLAGS, DPSFTConfig, DPSFTTrainer  # noqa: E402
from hf_dp.sft.config import markdown, sft_fields  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

#: user turns open with [CLS], assistant turns with [MASK]; the assistant's words and closing [SEP] are its tokens
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}[MASK] {% generation %}{{ m['content'] }} [SEP]"
            "{% endgeneration %} {% else %}[CLS] {{ m['content'] }} {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}[MASK] {% endif %}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    t = make_tokenizer(tmp_path_factory.mktemp("tok"))
    t.chat_template = TEMPLATE
    t.eos_token = "[SEP]"
    return t


def llama(tok, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(cfg)


def words(r, lo, hi):
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def conversations(n=40, users=10, seed=0, turns=1):
    r = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = []
        for _ in range(turns):
            msgs += [{"role": "user", "content": words(r, 2, 6)}, {"role": "assistant", "content": words(r, 1, 5)}]
        rows.append({"messages": msgs, "user_id": f"u{i % users}"})
    return rows


def config(tmp_path, **over):
    kw = dict(output_dir=str(tmp_path / "out"), epsilon=3.0, per_device_train_batch_size=4, num_train_epochs=2,
              assistant_only_loss=True, use_cpu=True, report_to="none", learning_rate=1e-2, logging_steps=2,
              save_strategy="no", dp_seed=1, max_length=32, disable_tqdm=True, dataloader_num_workers=0)
    kw.update(over)
    return DPSFTConfig(**kw)


def make(tmp_path, tok, rows, eval_rows=None, **over):
    ev = Dataset.from_list(eval_rows) if eval_rows is not None else None
    return DPSFTTrainer(model=llama(tok), args=config(tmp_path, **over), train_dataset=Dataset.from_list(rows),
                        eval_dataset=ev, processing_class=tok)


# --------------------------------------------------------------------------------------------------- end to end
def test_a_user_level_run_trains_evaluates_and_its_release_names_the_users(tmp_path, tok):
    rows = conversations(n=40, users=10)
    eval_rows = [{"messages": c["messages"]} for c in conversations(n=8, seed=5)]
    tr = make(tmp_path, tok, rows, eval_rows, privacy_unit_column="user_id")
    assert tr.num_units == 10 and tr.privacy_spec.dataset_size == 10  # N = users, not the 40 conversations
    from hf_dp.run import independence

    loader = tr.get_train_dataloader()  # each conversation's loss is its own, on TRL's collator
    assert independence.probe_independence(loader.dataset, loader.collate_fn, tr.model, tr.dp, compute_loss=tr.compute_loss,
                                           prepare_inputs=tr._prepare_inputs) == "passed"
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.train()
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if n in before)
    metrics = tr.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and 0 < tr.get_epsilon() <= 3.0 + 1e-6
    tr.save_model()
    report = json.load(open(tmp_path / "out" / "privacy.json"))
    unit = report["privacy_unit"]
    assert (unit["level"], unit["column"], unit["num_units"], report["dataset_size"]) == ("unit", "user_id", 10, 10)
    assert "user-level DP over conversations" in unit["description"]
    assert report["sft"]["assistant_only_loss"] is True and report["sft"]["packing"] is False
    card = open(tmp_path / "out" / "README.md").read()
    assert "user-level DP over conversations" in card
    assert "SFTTrainer" in card and "assistant_only_loss=True" in card and "max_length=32" in card
    assert "40" not in unit["description"]  # the number of conversations (private under unit-level DP) is not named


def test_row_level_run_counts_conversations(tmp_path, tok):
    tr = make(tmp_path, tok, conversations(n=24), max_steps=1)
    assert tr.num_units == 24
    assert "one conversation" in tr.privacy_report()["unit_of_privacy"]


# --------------------------------------------------------------------------------------------- prompt never scored
def _prepared(tr, i=0):
    return tr.train_dataset[i]


@pytest.mark.parametrize("kind", ["messages", "prompt_completion"])
def test_changing_a_prompt_token_changes_no_scored_label(tmp_path, tok, kind):
    r = random.Random(3)
    if kind == "messages":
        base = [{"role": "user", "content": "w1 w2 w3 w4"}, {"role": "assistant", "content": "w7 w8 w9"},
                {"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": "w12 w13"}]
        changed = [dict(m) for m in base]
        changed[0]["content"], changed[2]["content"] = "w1 w40 w3 w4", "w41 w11"  # both user turns touched
        rows = [{"messages": base}, {"messages": changed}] + [{"messages": c["messages"]} for c in conversations(6)]
        over = {}
    else:
        rows = [{"prompt": "w1 w2 w3 w4", "completion": " w7 w8 w9"}, {"prompt": "w1 w40 w3 w4", "completion": " w7 w8 w9"}]
        rows += [{"prompt": words(r, 2, 5), "completion": " " + words(r, 1, 4)} for _ in range(6)]
        over = {"assistant_only_loss": False}  # completion_only_loss (None -> on for prompt-completion data)
    tr = make(tmp_path, tok, rows, max_steps=1, **over)
    a, b = _prepared(tr, 0), _prepared(tr, 1)
    assert a["input_ids"] != b["input_ids"] and len(a["labels"]) == len(b["labels"])
    assert a["labels"] == b["labels"]  # the scored labels (and which positions are scored) are unchanged
    scored = [i for i, x in enumerate(a["labels"]) if x != IGNORE_INDEX]
    changed_at = [i for i, (x, y) in enumerate(zip(a["input_ids"], b["input_ids"])) if x != y]
    assert scored and changed_at and not set(scored) & set(changed_at)  # the changed prompt tokens are never scored
    # the completion tokens, and only they, are scored: for messages, the assistant words and their [SEP]
    ids = a["input_ids"]
    if kind == "messages":
        assert [ids[i] for i in scored] == tok(" w7 w8 w9 [SEP] w12 w13 [SEP]", add_special_tokens=False)["input_ids"]
    else:
        # the completion, its EOS and the tokenizer's own closing [SEP] (plain text is tokenized with special tokens)
        assert [ids[i] for i in scored] == tok(" w7 w8 w9", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * 2


def test_the_dp_loss_of_a_conversation_is_its_completion_mean_and_prompts_get_no_gradient(tmp_path, tok):
    tr = make(tmp_path, tok, [{"messages": c["messages"]} for c in conversations(12, turns=2)], max_steps=1)
    rows = [{k: tr.train_dataset[i][k] for k in ("input_ids", "labels")} for i in range(4)]
    batch = tr.data_collator(rows)  # TRL's collator: right padding, labels -100
    from hf_dp.models.loss import per_example_loss

    tr.model.eval()
    logits = tr.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    logits.requires_grad_(True)
    losses = per_example_loss(logits, batch["labels"], tr.model.config, tr.objective, batch["attention_mask"])
    for j, row in enumerate(rows):  # by hand: the mean NLL of the row's own scored tokens, as TRL's loss on the row alone
        n = len(row["input_ids"])
        logp = torch.log_softmax(logits[j, : n - 1].double(), -1)
        targets = torch.tensor(row["labels"][1:n])
        keep = targets != IGNORE_INDEX
        want = -logp[keep.nonzero()[:, 0], targets[keep]].mean()
        assert torch.allclose(losses[j].double(), want, atol=1e-5), (j, float(losses[j]), float(want))
    losses.sum().backward()
    predicts_scored = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX
    assert logits.grad[~predicts_scored].abs().max() == 0  # no position that predicts a prompt token gets a gradient
    assert logits.grad[predicts_scored].abs().sum(-1).min() > 0


# ------------------------------------------------------------------------------------------- per-user sensitivity
def _clipped_sum(tr, rows, users):
    opt = tr.create_optimizer()
    opt.discard_pending()
    ids = {u: j for j, u in enumerate(dict.fromkeys(users))}
    batch = tr.data_collator([{k: r[k] for k in ("input_ids", "labels")} for r in rows])
    batch["_hf_dp_units"] = torch.tensor([ids[u] for u in users])
    tr.model.train()
    tr.training_step(tr.model, drawn(tr, batch))
    out = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params])
    opt.discard_pending()
    return out


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_one_users_conversations_move_the_clipped_sum_by_at_most_c_removed_and_2c_replaced(tmp_path, tok, engine):
    c = 0.01  # every user's gradient is clipped
    rows = conversations(n=30, users=6, turns=2)
    tr = make(tmp_path, tok, rows, privacy_unit_column="user_id", per_sample_max_grad_norm=c, clipping=engine)
    data = [tr.train_dataset[i] for i in range(len(tr.train_dataset))]
    users = [d["user_id"] for d in data]
    pick = [i for i, u in enumerate(users) if u in ("u0", "u1", "u2")][:7]  # three users, 2-3 conversations each
    full = _clipped_sum(tr, [data[i] for i in pick], [users[i] for i in pick])
    assert full.norm() <= 3 * c * (1 + 1e-5)
    for gone in ("u0", "u1"):
        keep = [i for i in pick if users[i] != gone]
        rest = _clipped_sum(tr, [data[i] for i in keep], [users[i] for i in keep])
        diff = float((full - rest).norm())
        assert 0.9 * c <= diff <= c * (1 + 1e-4), (gone, diff)  # the user's conversations together: C, not k*C
    # replacing u1's conversations by another user's (a different number of them): at most 2C
    other = [i for i, u in enumerate(users) if u == "u5"]
    swapped = [i for i in pick if users[i] != "u1"] + other
    replaced = _clipped_sum(tr, [data[i] for i in swapped], [users[i] if users[i] != "u5" else "u1" for i in swapped])
    diff = float((full - replaced).norm())
    assert c < diff <= 2 * c * (1 + 1e-4), diff


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("over,match", [
    ({"packing": True}, "--packing is not supported with DP"),
    ({"padding_free": True}, "--padding_free is not supported with DP"),
    ({"loss_type": "dft"}, "--loss_type dft is not supported with DP"),
    ({"activation_offloading": True}, "--activation_offloading is not supported with DP"),
    ({"router_aux_loss_coef": 0.01}, "--router_aux_loss_coef is not supported with DP"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing"),
    ({"chat_template_path": "some/model"}, "--chat_template_path naming a model or tokenizer is not supported"),
])
def test_trl_flags_dp_cannot_honour_are_refused_in_one_sentence(tmp_path, over, match):
    with pytest.raises(ValueError, match=match) as e:
        config(tmp_path, **over)
    assert "\n" not in str(e.value)
    config(tmp_path, disable_dp=True, optim="adamw_torch", epsilon=None, **over)  # a non-private baseline takes them


def test_trainer_arguments_dp_cannot_honour_are_refused(tmp_path, tok):
    from peft import LoraConfig

    rows = Dataset.from_list(conversations(8))
    with pytest.raises(ValueError, match="peft_config is not supported by DPSFTTrainer under DP: pass --trainable lora"):
        DPSFTTrainer(model=llama(tok), args=config(tmp_path), train_dataset=rows, processing_class=tok,
                     peft_config=LoraConfig(r=4))
    with pytest.raises(ValueError, match="compute_loss_func is not supported"):
        DPSFTTrainer(model=llama(tok), args=config(tmp_path), train_dataset=rows, processing_class=tok,
                     compute_loss_func=lambda *a, **k: 0)
    changed = config(tmp_path)
    changed.packing = True  # set after the config was made: refused by the trainer all the same
    with pytest.raises(ValueError, match="--packing is not supported with DP"):
        DPSFTTrainer(model=llama(tok), args=changed, train_dataset=rows, processing_class=tok)
    with pytest.raises(TypeError, match="DPSFTConfig"):
        from trl import SFTConfig

        DPSFTTrainer(model=llama(tok), args=SFTConfig(output_dir=str(tmp_path), use_cpu=True), train_dataset=rows,
                     processing_class=tok)


def test_evaluating_on_the_training_conversations_is_refused(tmp_path, tok):
    rows = Dataset.from_list(conversations(12))
    with pytest.raises(ValueError, match="overlaps"):
        DPSFTTrainer(model=llama(tok), args=config(tmp_path), train_dataset=rows, eval_dataset=rows, processing_class=tok)
    tr = DPSFTTrainer(model=llama(tok), args=config(tmp_path, max_steps=1), train_dataset=rows, processing_class=tok)
    with pytest.raises(ValueError, match="overlaps"):
        tr.evaluate(rows)  # the raw conversations, before TRL prepares them
    with pytest.raises(ValueError, match="overlaps"):
        tr.evaluate(tr.train_dataset)


def test_lora_via_trainable_trains_only_the_adapter(tmp_path, tok):
    tr = make(tmp_path, tok, conversations(16, users=4), trainable="lora", lora_r=2, max_steps=2,
              privacy_unit_column="user_id")
    trainable = [n for n, p in tr.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    tr.train()
    assert tr.privacy_report()["trainable"]


def test_the_tokenizers_longer_than_maximum_warning_is_not_logged_where_the_length_is_cut(tmp_path):
    """TRL tokenizes each conversation whole and then cuts it to max_length; transformers warns once per tokenizer that
    a text is longer than its model_max_length ("... will result in indexing errors"). Under DP that warning is not
    logged (the conversations are cut, or refused over the run's token bound); the baseline still logs it."""
    from hf_dp.flags import LENGTH_WARNING

    for dp in (True, False):
        t = make_tokenizer(tmp_path / f"tok{dp}")
        # every two-turn conversation is longer (12 tokens or more; TRL's 7-token probe of the template is not)
        t.chat_template, t.eos_token, t.model_max_length = TEMPLATE, "[SEP]", 10
        over = {} if dp else {"disable_dp": True, "optim": "adamw_torch", "epsilon": None}
        held_out = [{"messages": c["messages"]} for c in conversations(4, seed=3, turns=2)]
        with transformers_warnings() as logged:
            make(tmp_path, t, conversations(n=16, users=4, turns=2), held_out, **over)
        assert len([m for m in logged if LENGTH_WARNING in m]) == (0 if dp else 1), (dp, logged)


# --------------------------------------------------------------------------------------------------- the flag table
def test_every_sftconfig_flag_is_classified_and_the_doc_table_is_current():
    assert set(sft_fields()) == set(SFT_FLAGS), "classify the new SFTConfig fields in hf_dp/sft/config.py"
    with open(os.path.join(ROOT, "docs", "sft.md"), encoding="utf-8") as f:
        doc = f.read()
    assert markdown() in doc, "regenerate the table in docs/sft.md: python -m hf_dp.sft.config --markdown"


# ------------------------------------------------------------------------------- the default scores no prompt token
def _default_config(tmp_path, **over):
    """DPSFTConfig without assistant_only_loss / completion_only_loss: what a user who sets neither gets."""
    kw = dict(output_dir=str(tmp_path / "out"), epsilon=3.0, per_device_train_batch_size=4, max_steps=1, use_cpu=True,
              report_to="none", save_strategy="no", dp_seed=1, max_length=32, disable_tqdm=True)
    kw.update(over)
    return DPSFTConfig(**kw)


def _scored(tr, i=0):
    row = tr.train_dataset[i]
    return [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]


def test_the_default_scores_only_assistant_or_completion_tokens_per_data_kind(tmp_path, tok):
    """Issue 49 item 6: DPSFTConfig() kept TRL's assistant_only_loss=False, so on messages data every prompt token was
    scored (the README promises the assistant's tokens only). The default now depends on the data: messages -> the
    assistant's tokens; prompt-completion -> the completion (TRL's completion_only_loss); plain text -> every token.
    privacy.json and the card say which tokens were scored; none of the three fails."""
    assert DPSFTConfig.__dataclass_fields__["assistant_only_loss"].default is None  # "per data kind"
    msgs = [{"role": "user", "content": "w1 w2 w3 w4"}, {"role": "assistant", "content": "w7 w8 w9"}]
    rows = [{"messages": msgs}] + [{"messages": c["messages"]} for c in conversations(7)]
    tr = DPSFTTrainer(model=llama(tok), args=_default_config(tmp_path), train_dataset=Dataset.from_list(rows),
                      processing_class=tok)
    assert _scored(tr) == tok(" w7 w8 w9 [SEP]", add_special_tokens=False)["input_ids"]  # no user token scored
    tr.train()
    tr.save_model()
    sft = json.load(open(tmp_path / "out" / "privacy.json"))["sft"]
    assert sft["assistant_only_loss"] is True and sft["scored_tokens"] == "the assistant's tokens only"
    assert sft["assistant_only_loss_source"] == "default for conversational ('messages') data"
    card = " ".join(open(tmp_path / "out" / "README.md").read().split())
    assert "scored tokens: the assistant's tokens only (default for conversational ('messages') data)" in card

    r = random.Random(1)
    pc = [{"prompt": "w1 w2 w3 w4", "completion": " w7 w8 w9"}] + [
        {"prompt": words(r, 2, 5), "completion": " " + words(r, 1, 4)} for _ in range(7)]
    tr = DPSFTTrainer(model=llama(tok), args=_default_config(tmp_path), train_dataset=Dataset.from_list(pc),
                      processing_class=tok)  # TRL refused assistant_only_loss=True here: not conversational
    assert _scored(tr)[:3] == tok(" w7 w8 w9", add_special_tokens=False)["input_ids"]
    sft = tr.sft_settings()
    assert sft["assistant_only_loss"] is False and sft["scored_tokens"] == "the completion's tokens only"

    text = [{"text": words(r, 3, 8)} for _ in range(8)]
    tr = DPSFTTrainer(model=llama(tok), args=_default_config(tmp_path), train_dataset=Dataset.from_list(text),
                      processing_class=tok)
    assert tr.sft_settings()["scored_tokens"] == "every token"


def test_the_default_on_messages_with_a_template_without_generation_markers_is_one_sentence(tmp_path, tok):
    """A chat template without {% generation %} (and none TRL knows how to patch): the default cannot score the
    assistant's tokens only. One sentence naming both ways out, not TRL's traceback; assistant_only_loss=False then
    scores every token, and the record says so."""
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    rows = Dataset.from_list([{"messages": c["messages"]} for c in conversations(8)])
    with pytest.raises(ValueError) as e:
        DPSFTTrainer(model=llama(plain), args=_default_config(tmp_path), train_dataset=rows, processing_class=plain)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("on conversational ('messages') data DPSFTTrainer scores only the "
                                              "assistant's tokens by default (assistant_only_loss)"), msg
    assert "{% generation %}" in msg and "assistant_only_loss=False" in msg
    tr = DPSFTTrainer(model=llama(plain), args=_default_config(tmp_path, assistant_only_loss=False), train_dataset=rows,
                      processing_class=plain)
    sft = tr.sft_settings()
    assert sft["scored_tokens"] == "every token" and sft["assistant_only_loss_source"] == "given"


def _sft_preparation_log(tmp_path, rows) -> str:
    import io
    import logging

    from helpers import tiny_llama

    tok = make_tokenizer(tmp_path / "tok")
    tok.eos_token = "[SEP]"
    buf = io.StringIO()
    handler, root = logging.StreamHandler(buf), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        args = DPSFTConfig(output_dir=str(tmp_path / "out"), epsilon=3.0, per_device_train_batch_size=4,
                           num_train_epochs=1, use_cpu=True, report_to="none", save_strategy="no", dp_seed=1,
                           max_length=32, disable_tqdm=True)
        DPSFTTrainer(model=tiny_llama(tok), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return buf.getvalue()


def test_trls_prompt_prefix_warning_is_withheld_under_dp(tmp_path):
    """A second review: TRL's SFT preparation warned, quoting the decoded end of a private prompt whose last token
    merges with its completion's first ("... left out of the training sequence: 'w4 [SEP]'"), and whether it warned is
    a fact about the data. Under DP its messages are dropped and hf_dp's one line is the same either way."""
    rows = [{"prompt": f"w{i % 9} w{i % 7}", "completion": f" w{i % 5}"} for i in range(64)]
    merged = list(rows)
    merged[17] = {"prompt": "w3 w4", "completion": "w12 w2"}  # no space: "w4w12" tokenizes across the boundary
    log = _sft_preparation_log(tmp_path / "a", merged)
    assert "left out of the training sequence" not in log and "not a prefix" not in log, log
    plain = _sft_preparation_log(tmp_path / "b", rows)
    said = [ln for ln in log.splitlines() if "withheld" in ln]
    assert said and said == [ln for ln in plain.splitlines() if "withheld" in ln]


def test_a_row_whose_labels_do_not_align_with_its_tokens_is_refused_before_any_step(tmp_path, tok):
    """A third review: pre-tokenized rows keep their own 'labels' column (TRL keeps it), and one whose labels were
    shorter than its input_ids passed every check, then stopped the run at the step that drew it (after 2 noisy steps,
    ε 2.09 spent): whether a model is released would tell that row's presence. Refused at train() before any step."""
    rows = [{"input_ids": [2, 5 + i % 50, 6, 7, 8], "labels": [-100, 5 + i % 50, 6, 7, 8]} for i in range(40)]
    rows[17] = {"input_ids": [2, 5, 6, 7, 9, 9], "labels": [-100, 5, 6]}
    tr = DPSFTTrainer(model=llama(tok), args=config(tmp_path, max_steps=4, per_device_train_batch_size=30,
                                                    assistant_only_loss=False),
                      train_dataset=Dataset.from_list(rows), processing_class=tok)
    with pytest.raises(ValueError, match=r"^the data collator makes labels of shape \(1, 3\) for training row 17 "):
        tr.train()
    assert tr.state.global_step == 0


@pytest.mark.parametrize("kind", ["messages", "text"])
def test_the_record_names_the_tokens_scored_when_completion_only_loss_does_not_apply(tmp_path, tok, kind):
    """A third review: completion_only_loss=True on 'messages' (without assistant_only_loss) or 'text' rows — TRL
    applies it to prompt-completion rows only and scores every token — was recorded as "the completion's tokens only
    … the prompt's tokens are never scored", so the card said the users' own turns were not trained on."""
    from hf_dp.models.loss import IGNORE_INDEX

    rng = random.Random(1)
    rows = conversations(40) if kind == "messages" else [{"text": words(rng, 3, 8)} for _ in range(40)]
    tr = DPSFTTrainer(model=llama(tok), args=config(tmp_path, max_steps=1, assistant_only_loss=False,
                                                    completion_only_loss=True),
                      train_dataset=Dataset.from_list(rows), processing_class=tok)
    row = tr.train_dataset[0]
    assert sum(label != IGNORE_INDEX for label in row["labels"]) == len(row["input_ids"])  # what TRL scores
    settings = tr.sft_settings()
    assert settings["scored_tokens"] == "every token" and settings["completion_only_loss"] is False
    assert "prompt-completion rows only" in settings["completion_only_loss_source"]
