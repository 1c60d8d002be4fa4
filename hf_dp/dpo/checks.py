"""What the pair trainers check of the private pairs before any step, and what of them they keep out of the logs.

* :func:`quiet_preparation`: TRL's DPO preparation warns, once per distinct text, when a prompt's tokens are not a
  prefix of prompt + answer, and its message quotes the decoded end of that prompt — private text, one line per
  distinct fragment. Under DP its messages are withheld while a set of pairs is prepared (a filter on TRL's
  ``dpo_trainer`` logger; the preparation runs in this process: ``dataset_num_proc`` is not used then, so that no
  worker process logs outside the filter), and hf_dp logs one line that quotes nothing and counts nothing, the same
  whether TRL warned or not (whether it did is a fact about the pairs); transformers'
  warning that a tokenized text is longer than the tokenizer's ``model_max_length`` is dropped too, where each
  sequence is cut to ``max_length`` or refused over the run's token bound (:func:`hf_dp.flags.quiet_length_warning`).
* :func:`check_pair_lengths`: every pair's rows, as the pair collator will make them, within the run's public token
  bound (``dp.bounds.max_length``: ``--dp_max_length``, else ``max_length``), refused in one sentence at construction
  — not at the step that happens to draw a longer pair.
* :func:`check_reference_ledger`: a ``ref_model=`` that hf_dp trained with DP (or trained without DP after a DP run)
  on data that may be these pairs is refused unless this run's ledger already counts that training or
  ``--prior_privacy separate`` says the data share no example (docs/dpo.md).
"""

from __future__ import annotations

import contextlib
import logging

from hf_dp.flags import length_warning_handled, quiet_length_warning
from hf_dp.run.data import withheld_messages

logger = logging.getLogger(__name__)

#: what hf_dp.run.lineage names the model's ledger record: in memory (MODEL_ATTR), in model.config (CONFIG_ATTR), and
#: the mark of training without DP after a DP run (NON_PRIVATE); tests/test_dpo.py checks they are lineage's
MODEL_ATTR, CONFIG_ATTR, NON_PRIVATE = "_hf_dp_ledger", "hf_dp_privacy", "trained_without_dp_after"


@contextlib.contextmanager
def quiet_preparation(args, dataset_name: str):
    """Around TRL's ``_prepare_dataset`` of ``dataset_name`` (train, eval): under DP, TRL's DPO messages withheld, the
    preparation in this process, and at most one hf_dp line (no text of the data, no count)."""
    if not args.dp_enabled:
        yield
        return
    from trl.trainer import dpo_trainer

    with withheld_messages(dpo_trainer.logger, args), quiet_length_warning(length_warning_handled(args, dataset_name)):
        yield  # (the length warning: its sequences are cut or refused, hf_dp.flags)
    # one line whatever TRL said: whether it warned (a prompt whose tokens merge with its answer's) is a fact about
    # the pairs, and a line only when it did would tell it (review of issue 51)
    what = "training" if dataset_name == "train" else f"evaluation ({dataset_name})"
    logger.info("hf_dp: TRL's messages while preparing the %s pairs are withheld under DP (they may quote private "
                "text, and whether there were any is a fact about the pairs); where a prompt's last token merges with "
                "its answer's first (or the chat template renders the prompt alone differently) the answer starts "
                "where the two tokenizations diverge: end each prompt on a token boundary (e.g. answers that start "
                "with a space)", what)


def check_pair_lengths(dataset, bound: int, longest, fix: str) -> None:
    """Refuse, before any step, a pair whose longest row (``longest(prompt_ids, chosen_ids, rejected_ids)`` per pair,
    or of ``chosen_ids, rejected_ids`` for reward pairs: the rows as the pair collator makes them) exceeds ``bound``,
    the run's public token bound. ``fix``: what to do, for the message."""
    names = getattr(dataset, "column_names", None) or []
    cols = [c for c in ("prompt_ids", "chosen_ids", "rejected_ids") if c in names]
    if "chosen_ids" not in cols or "rejected_ids" not in cols:
        return  # not prepared by TRL (e.g. vision pairs, refused): checked per micro-batch
    data = [dataset[c] for c in cols]
    if any(longest(*row) > bound for row in zip(*data)):
        raise ValueError(f"a preference pair is longer than the run's public token bound of {bound} tokens "
                         "(--dp_max_length, else max_length, else the model's positions), and the step that drew it "
                         f"would stop the run there: {fix}")


def dpo_row_length(max_length):
    """A DPO pair's longest row: prompt + its longer answer, cut to TRL's ``max_length`` (the pair collator's cut)."""
    cap = max_length if isinstance(max_length, int) and max_length > 0 else float("inf")
    return lambda prompt, chosen, rejected: min(len(prompt) + max(len(chosen), len(rejected)), cap)


def reward_row_length(chosen, rejected) -> int:
    """A reward pair's longest row (the prompt is inside each answer; the reward pair collator does not cut)."""
    return max(len(chosen), len(rejected))


# ------------------------------------------------------------------------------------------ a given reference model
def _records(model) -> list[dict]:
    """The public ledger records ``model`` carries (its config's, and the in-memory ledger's, which may be newer)."""
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    out = []
    config = getattr(getattr(model, "config", None), CONFIG_ATTR, None)
    if isinstance(config, dict):
        out.append(config)
    ledger = getattr(getattr(model, MODEL_ATTR, None), "ledger", None)
    if ledger is not None and callable(getattr(ledger, "runs", None)):
        meta = getattr(ledger, "meta", None) or {}
        out.append({"runs": ledger.runs(), "separate": meta.get("separate"), NON_PRIVATE: meta.get(NON_PRIVATE)})
    return out


def reference_history(model) -> tuple[dict[str, int], bool]:
    """``({run id: noisy steps}, trained without DP after a DP run?)`` of the training ``model`` carries a record of."""
    runs: dict[str, int] = {}
    marked = False
    for record in _records(model):
        marked = marked or bool(record.get(NON_PRIVATE))
        for run in list(record.get("runs") or []) + list(record.get("separate") or []):
            steps = int((run or {}).get("steps") or 0) if isinstance(run, dict) else 0
            if steps > 0:
                key = str(run.get("run_id"))
                runs[key] = max(steps, runs.get(key, 0))
    return runs, marked


def check_reference_ledger(ledger, args, ref_model) -> str | None:
    """Refuse a ``ref_model`` whose DP training (or training without DP after a DP run) this run's ``ledger`` does not
    count, unless ``--prior_privacy separate``: its log-probabilities enter every pair's loss, so if it was trained on
    these pairs the reported ε would leave that training out. Returns a note for the release when separate is what
    let it through, else None."""
    if ref_model is None:
        return None
    runs, marked = reference_history(ref_model)
    counted = {str(r.get("run_id")): int(r.get("steps") or 0)
               for r in list(ledger.prior) + list(ledger.meta.get("separate") or [])}
    missing = {k: n for k, n in runs.items() if counted.get(k, -1) < n}
    unmarked = marked and not ledger.meta.get(NON_PRIVATE)
    if not missing and not unmarked:
        return None
    history = "; ".join(f"run {k}: {n} noisy step{'s' if n != 1 else ''}" for k, n in missing.items())
    history = " and ".join(x for x in ((f"trained with DP ({history})" if missing else ""),
                                    ("trained without DP after a DP run" if unmarked else "")) if x)
    if str(getattr(args, "prior_privacy", None) or "auto") == "separate":
        return f"its earlier training ({history}) declared separate from these pairs (--prior_privacy separate)"
    raise ValueError(f"ref_model= was {history}, which this run's ledger does not count, and its log-probabilities "
                     "enter every pair's loss, so if that training saw these pairs the reported epsilon would leave it "
                     "out: pass a reference without that history (or none: the starting model is the reference), "
                     "start the policy from that model (its ledger is then counted), or pass --prior_privacy separate "
                     "if the reference's training data share no example with these pairs")
