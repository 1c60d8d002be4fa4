"""Every refusal of hf_dp.dpo (issue 51 item 6): one sentence, before any step, and a row of docs/misuse.md.

:data:`CASES` lists each refusal of the preference trainers and their configs (``DPDPOConfig``, ``DPRewardConfig``,
``DPDPOTrainer``, ``DPRewardTrainer``): the loss types and flags that couple pairs or read statistics of the batch,
the arguments DP cannot honour, a pair over the run's token bound, a reference model whose DP training the ledger does
not count, the training pairs evaluated. What is checked:

* each case raises its documented message (its start), in one line, where the table says (the config, the trainer's
  construction, or the call), on a tiny random Llama and a handful of synthetic pairs;
* nothing is left out: every refused loss type and flag of :mod:`hf_dp.dpo.config` has a case whose message is its
  reason, every argument a trainer refuses has one, and every ``raise`` in ``hf_dp/dpo/`` is reached by a case (but the
  few listed in :data:`NOT_REFUSALS`, which no input reaches or which are not about privacy);
* every case has its row in docs/misuse.md's "Preference tuning" table, quoting the whole message (``<…>`` a value,
  ``…`` the rest), every row there is a case (as tests/test_misuse.py checks the first table's ids), and README.md
  states their number;
* a non-private baseline (``--disable_dp``) takes the flags DP refuses.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import LlamaForSequenceClassification  # noqa: E402
from trl import DPOConfig, RewardConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import dpo_config, dpo_tokenizer, preference_pairs, tiny_llama  # noqa: E402

from hf_dp.dpo import (DPO_FLAGS, LOSS_TYPES, REWARD_FLAGS, DPDPOConfig, DPDPOTrainer, DPRewardConfig,  # noqa: E402
                       DPRewardTrainer)
from hf_dp.flags import REFUSED  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore")]
REPO = Path(__file__).resolve().parents[1]
DPO_DIR = REPO / "hf_dp" / "dpo"
SECTION = "## Preference tuning"


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return dpo_tokenizer(tmp_path_factory.mktemp("tok"))


def config(tmp_path, cls=DPDPOConfig, **over):
    return dpo_config(tmp_path, cls, **over)


class Ctx:
    """What a case's trigger builds from: a folder, the tokenizer, the raw training pairs (one object per case)."""

    def __init__(self, tmp_path, tok):
        self.tmp, self.tok = tmp_path, tok
        self.rows = Dataset.from_list(preference_pairs(16, users=4))

    def dpo(self, model=None, rows=None, given: dict | None = None, **over):
        """A DPDPOTrainer on ``rows`` (the case's pairs); ``given``: the trainer's other arguments; ``over``: the
        config's."""
        return DPDPOTrainer(model=model if model is not None else tiny_llama(self.tok), args=config(self.tmp, **over),
                            train_dataset=self.rows if rows is None else rows, processing_class=self.tok, **(given or {}))

    def reward(self, model=None, rows=None, given: dict | None = None, **over):
        over.setdefault("trainable", "all")
        model = model if model is not None else tiny_llama(self.tok, cls=LlamaForSequenceClassification, num_labels=1)
        return DPRewardTrainer(model=model, args=config(self.tmp, cls=DPRewardConfig, **over), processing_class=self.tok,
                               train_dataset=self.rows if rows is None else rows, **(given or {}))

    def long_pair(self):
        rows = preference_pairs(16, users=4)
        rows[5] = {"prompt": " ".join(["w3"] * 20), "chosen": " " + " ".join(["w4"] * 30), "rejected": " w5",
                   "user_id": "u1"}
        return Dataset.from_list(rows)

    def with_record(self, record: dict):
        model = tiny_llama(self.tok)
        model.config.hf_dp_privacy = record  # what hf_dp writes into a model's config when it trains it
        return model


def unclassified(registry: dict, field: str, build: Callable):
    """``build()`` with ``field`` left out of ``registry`` (a field a newer TRL adds that hf_dp has not classified)."""
    with mock.patch.dict(registry):
        del registry[field]
        return build()


@dataclass(frozen=True)
class Case:
    raised_by: str  # config, trainer, or the call (evaluate, hyperparameter_search)
    trigger: Callable[[Ctx], object]
    start: str  # the message's start (docs/misuse.md quotes the whole message)
    error: type = ValueError


_SORTS = "is not supported with DP: it sorts the batch's "
_NOT_BY = "{} is not supported by {} under DP: "
CASES: dict[str, Case] = {
    # DPDPOConfig (and the trainer, which checks the config again)
    "dpo-loss-aot": Case("config", lambda c: config(c.tmp, loss_type=["sigmoid", "aot"]),
                         f"--loss_type aot {_SORTS}policy and reference log-ratio differences"),
    "dpo-loss-aot-unpaired": Case("config", lambda c: config(c.tmp, loss_type="aot_unpaired"),
                                  f"--loss_type aot_unpaired {_SORTS}chosen and rejected log-ratios separately"),
    "dpo-loss-unclassified": Case("config", lambda c: config(c.tmp, loss_type=["sigmoid_plus"]),
                                  "--loss_type sigmoid_plus is not a DPO loss type hf_dp has classified for privacy"),
    "dpo-padding-free": Case("config", lambda c: config(c.tmp, padding_free=True),
                             "--padding_free is not supported with DP: it flattens the micro-batch's sequences into one"),
    "dpo-precompute-ref-log-probs": Case("config", lambda c: config(c.tmp, precompute_ref_log_probs=True),
                                         "--precompute_ref_log_probs is not supported with DP: TRL writes the reference "
                                         "model's log-probabilities of every private pair to a 🤗 Datasets cache file"),
    "dpo-router-aux-loss": Case("config", lambda c: config(c.tmp, router_aux_loss_coef=0.01),
                                "--router_aux_loss_coef is not supported with DP: a Mixture-of-Experts load-balancing "
                                "loss is a statistic of the whole batch's tokens"),
    "dpo-activation-offloading": Case("config", lambda c: config(c.tmp, activation_offloading=True),
                                      "--activation_offloading is not supported with DP: it moves saved activations "
                                      "through hooks"),
    "dpo-f-divergence-unknown": Case("config", lambda c: config(c.tmp, f_divergence_type="kl"),
                                     "--f_divergence_type kl is not one of TRL's f-divergences (reverse_kl, forward_kl, "
                                     "js_divergence, alpha_divergence)"),
    "dpo-beta-over-10": Case("config", lambda c: config(c.tmp, beta=20.0),
                             "--beta above 10 is not supported with DP: a pair's gradient scales with β·σ(−β·Δ)"),
    "dpo-config-field-unclassified": Case("config", lambda c: unclassified(DPO_FLAGS, "beta",
                                                                           lambda: config(c.tmp, beta=0.2)),
                                          "--beta is a DPOConfig field of trl "),
    "dpo-config-changed-after": Case("trainer", lambda c: _changed_after(c),
                                     f"--loss_type aot {_SORTS}"),
    # DPRewardConfig
    "reward-chat-template-path": Case("config", lambda c: config(c.tmp, cls=DPRewardConfig,
                                                                 chat_template_path="some/model"),
                                      "--chat_template_path naming a model or tokenizer is not supported with DP"),
    "reward-activation-offloading": Case("config", lambda c: config(c.tmp, cls=DPRewardConfig,
                                                                    activation_offloading=True),
                                         "--activation_offloading is not supported with DP: it moves saved activations "
                                         "through hooks"),
    "reward-config-field-unclassified": Case(
        "config", lambda c: unclassified(REWARD_FLAGS, "center_rewards_coefficient",
                                         lambda: config(c.tmp, cls=DPRewardConfig, center_rewards_coefficient=0.1)),
        "--center_rewards_coefficient is a RewardConfig field of trl "),
    # DPDPOTrainer
    "dpo-args-not-dp-config": Case("trainer", lambda c: DPDPOTrainer(
        model=tiny_llama(c.tok), args=DPOConfig(output_dir=str(c.tmp), use_cpu=True), train_dataset=c.rows,
        processing_class=c.tok), "DPDPOTrainer needs args=DPDPOConfig(...)", TypeError),
    "dpo-peft-config": Case("trainer", lambda c: c.dpo(given={"peft_config": _lora()}),
                            _NOT_BY.format("peft_config", "DPDPOTrainer") + "pass --trainable lora"),
    "dpo-data-collator": Case("trainer", lambda c: c.dpo(given={"data_collator": lambda b: b}),
                              _NOT_BY.format("data_collator", "DPDPOTrainer") + "its pair collator puts each pair's "
                              "chosen and rejected sequences in two consecutive rows"),
    "dpo-quantization-config": Case("trainer", lambda c: c.dpo(given={"quantization_config": {"load_in_4bit": True}}),
                                    _NOT_BY.format("quantization_config", "DPDPOTrainer") + "DP training needs float32 "
                                    "trainable parameters"),
    "dpo-fsdp": Case("trainer", lambda c: c.dpo(fsdp="full_shard"),
                     "--fsdp is not supported by DPDPOTrainer yet: FSDP's token bound counts rows, and each preference "
                     "pair is two"),
    "dpo-ref-model-reduced-precision": Case(
        "trainer", lambda c: c.dpo(given={"ref_model": tiny_llama(c.tok).to(torch.bfloat16)}, trainable="all"),
        "DP training needs the reference model (ref_model=) in float32 (or float64), got bfloat16 weights"),
    "dpo-audit-canaries": Case("trainer", lambda c: c.dpo(audit_canaries=100),
                               "--audit_canaries is not supported by DPDPOTrainer yet: its canaries are single rows"),
    "dpo-cache-frozen-features": Case("trainer", lambda c: c.dpo(cache_frozen_features=True, trainable="last_block"),
                                      "--cache_frozen_features is not supported by DPDPOTrainer: the frozen-prefix "
                                      "cache is built from rows of input_ids"),
    "dpo-vision-data": Case("trainer", lambda c: c.dpo(rows=_vision("image")),
                            "vision preference data is not supported by DPDPOTrainer under DP"),
    "dpo-eval-is-train": Case("trainer", lambda c: c.dpo(given={"eval_dataset": c.rows}),
                              "the eval dataset is (or overlaps) the private training set"),
    "dpo-evaluate-train": Case("evaluate", lambda c: c.dpo(max_steps=1).evaluate(c.rows),
                               "the eval dataset is (or overlaps) the private training set"),
    "dpo-pair-over-token-bound": Case("trainer", lambda c: c.dpo(rows=c.long_pair(), trainable="lora", lora_r=2,
                                                                 dp_max_length=24),
                                      "a preference pair is longer than the run's public token bound of 24 tokens"),
    "dpo-ref-model-dp-trained": Case(
        "trainer", lambda c: c.dpo(given={"ref_model": c.with_record({"runs": [{"run_id": "r1", "steps": 2}]})},
                                   trainable="all"),
        "ref_model= was trained with DP (run r1: 2 noisy steps), which this run's ledger does not count"),
    "dpo-ref-model-trained-without-dp-after": Case(
        "trainer", lambda c: c.dpo(given={"ref_model": c.with_record({"runs": [], "trained_without_dp_after": True})},
                                   trainable="all"),
        "ref_model= was trained without DP after a DP run, which this run's ledger does not count"),
    "dpo-hyperparameter-search": Case("hyperparameter_search", lambda c: c.dpo(max_steps=1).hyperparameter_search(),
                                      "hyperparameter_search is not supported by DPDPOTrainer under DP yet"),
    # DPRewardTrainer
    "reward-args-not-dp-config": Case("trainer", lambda c: DPRewardTrainer(
        model=tiny_llama(c.tok, cls=LlamaForSequenceClassification, num_labels=1),
        args=RewardConfig(output_dir=str(c.tmp), use_cpu=True), train_dataset=c.rows, processing_class=c.tok),
        "DPRewardTrainer needs args=DPRewardConfig(...)", TypeError),
    "reward-peft-config": Case("trainer", lambda c: c.reward(given={"peft_config": _lora()}),
                               _NOT_BY.format("peft_config", "DPRewardTrainer") + "pass --trainable lora"),
    "reward-data-collator": Case("trainer", lambda c: c.reward(given={"data_collator": lambda b: b}),
                                 _NOT_BY.format("data_collator", "DPRewardTrainer") + "its pair collator puts each "
                                 "pair's chosen and rejected sequences in two consecutive rows"),
    "reward-optimizer-cls-and-kwargs": Case(
        "trainer", lambda c: c.reward(given={"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1})}),
        _NOT_BY.format("optimizer_cls_and_kwargs", "DPRewardTrainer") + "DPTrainer builds its DP optimizer from --optim"),
    "reward-fsdp": Case("trainer", lambda c: c.reward(fsdp="full_shard"),
                        "--fsdp is not supported by DPRewardTrainer yet: FSDP's token bound counts rows, and each "
                        "preference pair is two"),
    "reward-audit-canaries": Case("trainer", lambda c: c.reward(audit_canaries=100),
                                  "--audit_canaries is not supported by DPRewardTrainer yet: its canaries are single "
                                  "rows"),
    "reward-cache-frozen-features": Case("trainer", lambda c: c.reward(cache_frozen_features=True,
                                                                       trainable="last_block"),
                                         "--cache_frozen_features is not supported by DPRewardTrainer: the "
                                         "frozen-prefix cache is built from rows of input_ids"),
    "reward-vision-data": Case("trainer", lambda c: c.reward(rows=_vision("images")),
                               "vision preference data is not supported by DPRewardTrainer under DP"),
    "reward-eval-is-train": Case("trainer", lambda c: c.reward(given={"eval_dataset": c.rows}),
                                 "the eval dataset is (or overlaps) the private training set"),
    "reward-evaluate-train": Case("evaluate", lambda c: c.reward(max_steps=1).evaluate(c.rows),
                                  "the eval dataset is (or overlaps) the private training set"),
    "reward-num-labels": Case("trainer", lambda c: c.reward(model=tiny_llama(c.tok, cls=LlamaForSequenceClassification,
                                                                             num_labels=2)),
                              "a reward model scores each sequence with one number, but the model has num_labels=2"),
    "reward-nonfinite-margin": Case("trainer", lambda c: c.reward(rows=Dataset.from_list(
        [{**r, "margin": float("nan") if i == 3 else 0.5} for i, r in enumerate(c.rows)])),
        "a preference pair's margin is NaN or infinite"),
    "reward-pair-over-token-bound": Case("trainer", lambda c: c.reward(rows=c.long_pair(), dp_max_length=24),
                                         "a preference pair is longer than the run's public token bound of 24 tokens"),
    "reward-hyperparameter-search": Case("hyperparameter_search",
                                         lambda c: c.reward(max_steps=1).hyperparameter_search(),
                                         "hyperparameter_search is not supported by DPRewardTrainer under DP yet"),
}
#: the raises in hf_dp/dpo/ that are not refusals of an input: (file, function) -> why no case reaches them
NOT_REFUSALS = {
    ("config.py", "<module>"): "TRL not installed: the sft extra's install hint",
    ("pairs.py", "scores"): "an f_divergence_type TRL does not compute is refused by the config first "
                            "(dpo-f-divergence-unknown)",
    ("pairs.py", "pair_losses"): "every loss type LOSS_TYPES allows has its branch (tests/test_dpo.py computes each)",
}


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4)


def _vision(column: str):
    return Dataset.from_list([{**p, column: None} for p in preference_pairs(8)])


def _changed_after(c: Ctx):
    """A config changed after it was made: the trainer checks it again."""
    args = config(c.tmp)
    args.loss_type = ["aot"]
    return DPDPOTrainer(model=tiny_llama(c.tok), args=args, train_dataset=c.rows, processing_class=c.tok)


#: each case's message and where it was raised (the innermost frame: file, line), filled as the cases run
MESSAGES: dict[str, str] = {}
RAISED_AT: dict[str, tuple[str, int]] = {}


def trigger(case_id: str, tmp_path, tok) -> BaseException:
    case = CASES[case_id]
    with pytest.raises(case.error) as info:
        case.trigger(Ctx(tmp_path, tok))
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    RAISED_AT[case_id], MESSAGES[case_id] = (frame.filename, frame.lineno), str(info.value)
    return info.value


def run_missing(tmp_path, tok) -> None:
    """Trigger the cases not run yet in this process (a test run alone)."""
    for case_id in CASES:
        if case_id not in RAISED_AT:
            trigger(case_id, tmp_path / case_id, tok)


@pytest.mark.parametrize("case_id", list(CASES))
def test_each_refusal_is_one_sentence_before_any_work(case_id, tmp_path, tok):
    message = str(trigger(case_id, tmp_path, tok))
    assert message.startswith(CASES[case_id].start), message
    assert "\n" not in message and message.count(". ") == 0, message


def _raises() -> list[tuple[str, str, int, int]]:
    """Every ``raise`` statement of hf_dp/dpo/*.py: (file, enclosing function or <module>, first line, last line)."""
    out = []
    for path in sorted(DPO_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))

        def walk(node, where):
            for child in ast.iter_child_nodes(node):
                name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
                if isinstance(child, ast.Raise) and child.exc is not None:
                    out.append((path.name, where, child.lineno, child.end_lineno))
                walk(child, name)

        walk(tree, "<module>")
    return out


def test_every_refusal_of_hf_dp_dpo_has_a_case(tmp_path, tok):
    reasons = {c.start for c in CASES.values()}
    rules = [*LOSS_TYPES.values(), *(r for registry in (DPO_FLAGS, REWARD_FLAGS) for rs in registry.values() for r in rs)]
    for rule in rules:  # each refused loss type and flag: its reason is a case's message
        if rule.status == REFUSED:
            assert any(rule.reason.startswith(s) for s in reasons), f"no case for the refusal {rule.reason!r}"
    for name, cls in (("trainer.py", "DPDPOTrainer"), ("reward.py", "DPRewardTrainer")):  # each refused argument
        tree = ast.parse((DPO_DIR / name).read_text(encoding="utf-8"))
        given = [k.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "given" for t in node.targets) and isinstance(node.value, ast.Dict)
                 for k in node.value.keys]
        assert given, f"{name}: the trainer's refused arguments (given = {{...}}) were not found"
        for arg in given:
            assert any(s.startswith(_NOT_BY.format(arg, cls)) for s in reasons), f"no case for {cls}({arg}=...)"
    run_missing(tmp_path, tok)  # where each case is raised
    sites = list(RAISED_AT.values())
    missed = []
    for name, where, first, last in _raises():
        if (name, where) in NOT_REFUSALS:
            continue
        if not any(Path(f) == DPO_DIR / name and first <= line <= last for f, line in sites):
            missed.append(f"hf_dp/dpo/{name}:{first} (in {where})")
    assert not missed, f"raises of hf_dp/dpo that no case of CASES reaches (add a case and a docs/misuse.md row): {missed}"


def _rows() -> dict[str, str]:
    doc = (REPO / "docs" / "misuse.md").read_text(encoding="utf-8")
    assert SECTION in doc, f"docs/misuse.md has no '{SECTION}' section"
    section = doc[doc.index(SECTION):]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return {m.group(1): line for line in section.splitlines() if (m := re.match(r"^\| `([\w-]+)` \|", line))}


def quoted(cell: str) -> re.Pattern:
    """The message a row quotes (its first long backticked text) as a pattern: ``<…>`` a value, ``…`` the rest."""
    text = re.search(r"`([^`]{20,})`", cell).group(1)
    return re.compile(re.sub(r"<\w+>", ".+?", re.escape(text)).replace("…", ".*"), re.S)


def test_every_case_has_its_row_in_docs_misuse_and_every_row_is_a_case(tmp_path, tok):
    rows = _rows()
    assert sorted(rows) == sorted(CASES), (f"rows without a case: {sorted(set(rows) - set(CASES))}; cases without a "
                                           f"row: {sorted(set(CASES) - set(rows))}")
    run_missing(tmp_path, tok)
    for case_id, case in CASES.items():
        cells = [c.strip() for c in rows[case_id].strip().strip("|").split(" | ")]
        assert len(cells) == 4 and cells[2].startswith(case.raised_by), (case_id, cells)
        assert quoted(cells[3]).fullmatch(MESSAGES[case_id]), (
            f"docs/misuse.md's row {case_id} does not quote the message: {MESSAGES[case_id]!r}")
    stated = re.search(r"(\d+) for preference tuning", (REPO / "README.md").read_text(encoding="utf-8"))
    assert stated and int(stated.group(1)) == len(CASES), "README.md's count of the preference-tuning cases"


@pytest.mark.parametrize("over", [{"loss_type": ["aot"]}, {"loss_type": ["aot_unpaired"]}, {"padding_free": True},
                                  {"precompute_ref_log_probs": True}, {"activation_offloading": True},
                                  {"router_aux_loss_coef": 0.01}])
def test_a_non_private_baseline_takes_the_flags_dp_refuses(tmp_path, over):
    config(tmp_path, disable_dp=True, optim="adamw_torch", epsilon=None, **over)


def test_the_configs_keep_dptrainingarguments_refusals(tmp_path):
    with pytest.raises(ValueError, match="gradient_checkpointing") as e:  # TRL turns it on; refused under DP
        config(tmp_path, gradient_checkpointing=True)
    assert "\n" not in str(e.value)
