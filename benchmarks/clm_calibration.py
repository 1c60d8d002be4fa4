"""The causal-LM runs of ``clm_cpu_experiment.py`` beside the planner: the rows the causal-LM verdict
(``hf_dp.plan.lm_verdict``) and its expected share of the gain (``hf_dp.plan.lm_share``) are calibrated on, the constants
those modules cite, and the table this script prints (also ``clm_cpu_experiment.py --calibration``).
tests/test_plan_lm.py reads the raw file through these functions.

    python benchmarks/clm_calibration.py            # the committed raw file, benchmarks/results/clm_experiment.jsonl
    python benchmarks/clm_calibration.py --out r.jsonl"""

from __future__ import annotations

import argparse
import math
import os
import sys

from bench_io import REPO, load_jsonl

def _flag(command: str, name: str) -> str | None:
    parts = (command or "").split()
    return parts[parts.index(name) + 1] if name in parts and parts.index(name) + 1 < len(parts) else None


def _legacy_trainable(row: dict, config: str) -> int:
    """d of a row written before the rows recorded ``trainable_params``: counted as the planner counts it, with the
    row's --trainable (the recipe's default LoRA) on a GPT-2 built from the pretraining config (no weights read)."""
    sys.path.insert(0, str(REPO))
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dp.models import apply_trainable

    cfg = AutoConfig.for_model("gpt2")
    cfg.update_from_string(config)
    cfg.vocab_size = 30522  # the MiniLM WordPiece tokenizer's (LoRA's count does not depend on it)
    return int(apply_trainable(AutoModelForCausalLM.from_config(cfg), row.get("trainable") or "lora")[1].num_trainable)


#: flags that give LoRA other adapters than the recipes' (hf_dp.plan.lm_verdict.CALIBRATED_LORA on PEFT's default
#: modules): runs with them are left out of the calibration, and the planner gives no verdict for such adapters
LORA_FLAGS = ("--lora_r", "--lora_alpha", "--lora_target_modules", "--lora_freeze_a")
#: flags that change the update rule's response to noise (Adam's ε at the noise's scale, RESULTS §10e): the verdict's
#: noise walk is calibrated on the rules' defaults, so runs with them are left out too
RULE_FLAGS = ("--adam_epsilon",)


def lm_calibration_rows(rows: list[dict]) -> list[dict]:
    """The measured DP fine-tunings, each beside run ``none`` (no fine-tuning) of the same pretrained model
    (``pretrained``: the weights' fingerprint; rows written before it was recorded form one group) and the same
    evaluation split: the public quantities of the planner's causal-LM verdict (σ, B, d, the update rule, lr) and
    whether the run ended worse (higher perplexity) than no fine-tuning. A run ``eval`` of a DP run's release on another
    split (``--pretrained <its output_dir>/release``) is that DP run scored on that split's text, beside run ``none``
    of the DP run's pretrained model on that split. Smoke runs and failed runs are left out; so is a DP run whose
    pretrained model has no run ``none`` on the split, and a run with correlated noise (``--noise_mechanism
    banded_sqrt``, RESULTS §13): the verdict's noise walk is calibrated on independent noise; and a run with other LoRA
    adapters than the recipes' (:data:`LORA_FLAGS`, RESULTS §10e): the verdict says none for those (``--lora_freeze_a``: an experimental
    switch of RESULTS §10e that froze LoRA's A matrices, not kept in the code); one with another update-rule setting
    (:data:`RULE_FLAGS`); and an ablation at a fixed σ (``--noise_multiplier``, RESULTS §10e: no noise) instead of a target ε."""
    def group(r):
        split = r.get("split") or "dev"  # another corpus's splits are its own texts (not SST-2's little-gain ones)
        return r.get("pretrained") or "legacy", split if r.get("corpus", "sst2") == "sst2" else f"{r['corpus']}:{split}"

    ok = [r for r in rows if r.get("phase") == "finetune" and r.get("returncode") == 0 and not r.get("smoke")
          and r.get("perplexity") is not None]
    none = {group(r): float(r["perplexity"]) for r in ok if r.get("run") == "none"}  # the latest of a group counts
    config = next((r["config"] for r in rows if r.get("phase") == "pretrain" and not r.get("smoke")), None)
    if config is None:
        from clm_cpu_experiment import CONFIG as config

    def folder_of(r):  # a run is its folder (ft_<split>_<run>_<tag>_s<seed>) within its corpus: its latest row counts
        return r.get("corpus") or "sst2", os.path.basename(os.path.normpath(_flag(r["command"], "--output_dir") or ""))

    dp = {folder_of(r): r for r in ok
          if r.get("noise_multiplier") is not None
          and (_flag(r["command"], "--noise_mechanism") or "independent") == "independent"
          and _flag(r["command"], "--noise_multiplier") is None
          and not any(_flag(r["command"], f) is not None for f in LORA_FLAGS + RULE_FLAGS)}
    scored = [(r, group(r)) for r in dp.values()]
    # the non-private fine-tuning of a group (the latest; the gain a DP run's share is of): run "nonprivate", or its
    # release scored on another split's text
    nonprivate = {group(r): float(r["perplexity"]) for r in ok if r.get("run") == "nonprivate"}
    npruns = {folder_of(r): r for r in ok
              if r.get("run") == "nonprivate"}
    for e in ok:  # a DP (or the non-private) run's release scored on another split's text
        model = _flag(e["command"], "--model_name_or_path") or ""
        folder = ((e.get("corpus") or "sst2", os.path.basename(os.path.dirname(os.path.normpath(model))))
                  if e.get("run") == "eval" else None)
        source = dp.get(folder)
        if source is not None:
            scored.append(({**source, "perplexity": e["perplexity"], "tag": f"{source.get('tag') or ''} (eval)"},
                           (group(source)[0], group(e)[1])))
        elif folder in npruns:
            nonprivate[(group(npruns[folder])[0], group(e)[1])] = float(e["perplexity"])
    sys.path.insert(0, str(REPO))
    from hf_dp.plan.lm_verdict import LM_TIE

    latest = {}  # one scoring per (DP run, scored text): the latest
    for r, g in scored:
        latest[(g, folder_of(r))] = (r, g)
    out = []
    for r, g in latest.values():
        if r.get("expected_batch_size") is None or g not in none:
            continue
        d = r.get("trainable_params") or _legacy_trainable(r, config)
        optim = r.get("optimizer") or _flag(r["command"], "--optim") or "dp_adamw"  # recipes/clm.py's default
        lr = r.get("learning_rate") or _flag(r["command"], "--learning_rate")
        sigma, b = float(r["noise_multiplier"]), float(r["expected_batch_size"])
        out.append({
            "run": r["run"], "tag": r.get("tag") or "", "split": g[1], "pretrained": g[0],
            "corpus": r.get("corpus") or "sst2",
            # the release's own record, else the command's flag, else recipes/clm.py's row-level default (rows written
            # before the schedule was recorded either give the flag or ran the constant default; the four `unit_default*`
            # rows, which ran the unit column's linear default, had it copied from their releases' privacy.json)
            "schedule": r.get("lr_scheduler_type") or _flag(r["command"], "--lr_scheduler_type") or "constant",
            "id": (g[0], _flag(r["command"], "--output_dir")),  # the DP run (one per folder and pretrained model)
            "perplexity": float(r["perplexity"]), "none_perplexity": none[g],
            # the share of the non-private gain the run kept (None without a non-private run of the group, or when
            # non-private fine-tuning gained nothing there)
            "nonprivate_perplexity": nonprivate.get(g),
            "share": ((none[g] - float(r["perplexity"])) / (none[g] - nonprivate[g])
                      if g in nonprivate and none[g] - nonprivate[g] > 0 else None),
            # within LM_TIE of no fine-tuning's perplexity: a tie, neither better nor worse
            "worse": float(r["perplexity"]) > none[g] * (1 + LM_TIE),
            "better": float(r["perplexity"]) < none[g] * (1 - LM_TIE), "sigma": sigma, "batch": b, "params": int(d),
            "optimizer": optim, "learning_rate": float(lr) if lr is not None else None,
            "r_step": math.sqrt(d) * sigma / b, "steps": r.get("steps"), "n": r.get("dataset_size"),
            "walk": (float(lr) * math.sqrt(r["steps"]) * (math.sqrt(d) * sigma / b)
                     / math.sqrt(1 + (math.sqrt(d) * sigma / b) ** 2)) if lr is not None and r.get("steps") else None,
        })
    return out


def calibration_constants(rows: list[dict]) -> dict:
    """``hf_dp.plan.lm_verdict.LM_CALIBRATION`` as the rows of :func:`lm_calibration_rows` make it (what the messages
    cite; tests/test_plan_lm.py compares the two)."""
    sys.path.insert(0, str(REPO))
    from hf_dp.plan.lm_verdict import LITTLE_GAIN_SPLITS, family

    def sig3(x):
        return float(f"{x:.3g}")

    def extremes(subset):
        better = {}
        for r in subset:
            if r["better"]:
                f = family(r["optimizer"])
                better[f] = max(better.get(f, float("-inf")), r["walk"])
        worse = {}
        for r in subset:
            f = family(r["optimizer"])
            if r["worse"] and r["walk"] > better.get(f, float("-inf")):
                worse[f] = min(worse.get(f, float("inf")), r["walk"])
        return {f: sig3(v) for f, v in better.items()}, {f: sig3(v) for f, v in worse.items()}

    better, worse = extremes(rows)
    little = [r for r in rows if r["split"] in LITTLE_GAIN_SPLITS]
    return {
        "runs": len({r["id"] for r in rows}), "scorings": len(rows), "worse": sum(r["worse"] for r in rows),
        "better": sum(r["better"] for r in rows),
        "little_gain_runs": len(little),
        "largest_better_walk": better, "worse_from_walk": worse, "little_gain_largest_better_walk": extremes(little)[0],
        "little_gain_worse_from_walk": extremes(little)[1],
        "optimizers": tuple(sorted({r["optimizer"] for r in rows})),
        "learning_rates": tuple(sorted({r["learning_rate"] for r in rows})),
    }


def share_rows(rows: list[dict], corpus: str = "wiki", alignment: float | None = None) -> list[dict]:
    """The DP runs of :func:`lm_calibration_rows` on ``corpus`` under an Adam-type rule with a share of the non-private
    gain (a non-private run of the same model and text), each with its signal movement S (the schedule's mean learning
    rate; ``alignment``: a, default hf_dp.plan.lm_share.ALIGNMENT): on ``wiki`` (text with much to learn) the planner's
    expected share (hf_dp.plan.lm_share) is fitted."""
    sys.path.insert(0, str(REPO))
    from hf_dp.plan.lm_share import ADAM_RULES, ALIGNMENT, SCHEDULE_MEAN, signal_move

    out = []
    for r in rows:
        if r["corpus"] != corpus or r["optimizer"] not in ADAM_RULES or r.get("share") is None:
            continue
        lr = r["learning_rate"] * SCHEDULE_MEAN.get(r["schedule"], 1.0)
        out.append({**r, "move": signal_move(lr, r["sigma"], r["batch"], r["params"], r["steps"], alignment or ALIGNMENT)})
    return out


def share_constants(rows: list[dict]) -> dict:
    """``hf_dp.plan.lm_share``'s constants as :func:`share_rows` of ``rows`` make them: share ≈ max·(1 − exp(−S/scale))
    with the (a, max, scale) of a grid (a in 0.25, 0.5, 0.75, 1, 1.5, 2; max 0.01 … 1 by 0.01; scale 0.00025 … 0.05 by
    0.00025) that minimises the largest error over the runs on text with much to learn (ties: the earlier in that
    order); the S at which it expects half of the gain; and, on SST-2's whole sentences, the largest S of a run that kept
    a positive share."""
    sys.path.insert(0, str(REPO))
    from hf_dp.plan.lm_share import predicted_share
    from hf_dp.plan.lm_verdict import LITTLE_GAIN_SPLITS

    best = None
    for a in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0):
        fit = share_rows(rows, corpus="wiki", alignment=a)
        if not fit:
            return {}
        for i in range(1, 101):
            for j in range(1, 201):
                mx, sc = i / 100, j * 0.00025
                err = max(abs(predicted_share(r["move"], mx, sc) - r["share"]) for r in fit)
                if best is None or err < best[0] - 1e-12:
                    best = (err, a, mx, sc, fit)
    err, a, mx, sc, fit = best
    half = -sc * math.log(1 - 0.5 / mx) if mx > 0.5 else None
    little = [r for r in share_rows(rows, corpus="sst2", alignment=a) if r["split"] in LITTLE_GAIN_SPLITS]
    kept = [r["move"] for r in little if r["share"] > 0]
    return {"ALIGNMENT": a, "SHARE_MAX": mx, "SHARE_SCALE": round(sc, 5),
            "SHARE_LARGEST_S": float(f"{max(r['move'] for r in fit):.2g}"),
            "HALF_GAIN_S": float(f"{half:.2g}") if half is not None else None,
            "LITTLE_GAIN_LAST_GOOD": float(f"{max(kept):.2g}") if kept else None,
            "LM_SHARE": {"runs": len(fit), "largest_error": round(err, 3)}}


def calibration_report(path) -> None:
    """The measured DP runs beside the planner's causal-LM verdict (``--calibration``)."""
    sys.path.insert(0, str(REPO))
    from hf_dp.plan.lm_verdict import LM_WORSE_WALK, LM_WORSE_WALK_LITTLE_GAIN, expected_worse

    rows = lm_calibration_rows(load_jsonl(path))
    print("| run | tag | split | optimizer | lr | N | B | T | σ | d | R_step | W | perplexity | none | measured | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: (r["split"], r["walk"])):
        v = expected_worse(r["sigma"], r["batch"], r["params"], r["steps"], r["learning_rate"], r["optimizer"])
        print(f"| {r['run']} | {r['tag']} | {r['split']} | {r['optimizer']} | {r['learning_rate']:g} | {r['n']} | "
              f"{r['batch']:g} | {r['steps']} | {r['sigma']:.4g} | {r['params']:,} | {r['r_step']:.3g} | "
              f"{r['walk']:.3g} | {r['perplexity']:.1f} | {r['none_perplexity']:.1f} | "
              f"{'worse' if r['worse'] else 'better' if r['better'] else 'tie'} | {v or '—'} |")
    print(f"thresholds: W ≥ {LM_WORSE_WALK} worse on any text, ≥ {LM_WORSE_WALK_LITTLE_GAIN} on SST-2 dev")
    print(f"LM_CALIBRATION from these rows (hf_dp/plan/lm_verdict.py; 'model' aside): {calibration_constants(rows)}")
    from hf_dp.plan.lm_share import predicted_share

    print("\n| split | run | tag | lr | schedule | B | T | R_step | S | share | expected |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(share_rows(rows), key=lambda r: r["move"]):
        print(f"| {r['split']} | {r['run']} | {r['tag']} | {r['learning_rate']:g} | {r['schedule']} | {r['batch']:g} | "
              f"{r['steps']} | {r['r_step']:.3g} | {r['move']:.4f} | {r['share']:.0%} | {predicted_share(r['move']):.0%} |")
    print(f"hf_dp/plan/lm_share.py from these rows: {share_constants(rows)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "clm_experiment.jsonl"),
                    help="the raw results file of clm_cpu_experiment.py")
    calibration_report(ap.parse_args(argv).out)


if __name__ == "__main__":
    main()
