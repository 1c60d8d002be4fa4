#!/usr/bin/env python
"""The one-run audit (``--audit_canaries``) of the README's main job, as is or with a deliberate break
(benchmarks/audit.md §5): the recipe ``recipes/qnli.py`` runs in this process with the given arguments; with
``--variant no_noise`` the privatizer adds N(0, (0·C)²) instead of N(0, (σC)²) (hf_dp.audit.trainer_path's ``no_noise``
break, installed on every DPTrainer the recipe makes), with ``noise_div10`` N(0, (σC/10)²)
(hf_dp.audit.one_run.divide_noise), while the ledger, privacy.json and the card keep claiming σ.

    python benchmarks/one_run_main_job.py --variant no_noise -- --optim dp_adamw --epsilon 3 \\
        --model_name_or_path minilm --data_dir ../shared/data/glue --output_dir runs/qnli-audit-no-noise \\
        --audit_canaries 1000

Prints the run's ``audit`` record (also in its privacy.json). A broken run is exposed only if ε̂ > ε: black-box
canaries scored on the final model may miss a break (a lower bound, never a proof)."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install_break(variant: str) -> None:
    """Every DPTrainer made from now on gets ``variant``'s break (``real``: none)."""
    if variant == "real":
        return
    from hf_dp import trainer as trainer_module

    if variant not in ("no_noise", "noise_div10"):
        raise ValueError(f"unknown variant {variant!r} (real, no_noise, noise_div10)")
    cls = trainer_module.DPTrainer
    create = cls.create_optimizer

    def create_without_noise(self, model=None):
        from hf_dp.audit.one_run import divide_noise
        from hf_dp.audit.trainer_path import zero_noise

        out = create(self, model)
        if variant == "no_noise":
            zero_noise(self.dp.optimizer)  # σ = 0 while the noise is drawn; the nominal σ stays everywhere else
        else:
            divide_noise(self.dp.optimizer, 10.0)  # σ/10 while the noise is drawn
        return out

    cls.create_optimizer = create_without_noise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="real", choices=("real", "no_noise", "noise_div10"))
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="-- then the arguments of recipes/qnli.py")
    a = p.parse_args(argv)
    rest = a.recipe_args[1:] if a.recipe_args[:1] == ["--"] else a.recipe_args
    if "--audit_canaries" not in rest:
        p.error("give --audit_canaries m among the recipe's arguments")
    install_break(a.variant)
    old = sys.argv
    sys.argv = [os.path.join(REPO, "recipes", "qnli.py"), *rest]
    try:
        runpy.run_path(os.path.join(REPO, "recipes", "qnli.py"), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    finally:
        sys.argv = old
    out = rest[rest.index("--output_dir") + 1] if "--output_dir" in rest else None
    if code == 0 and out and os.path.isfile(os.path.join(out, "release", "privacy.json")):  # the recipe's release
        with open(os.path.join(out, "release", "privacy.json"), encoding="utf-8") as f:
            privacy = json.load(f)
        print(json.dumps({"variant": a.variant, "epsilon": privacy["epsilon"], "dataset_size": privacy["dataset_size"],
                          "audit": privacy.get("audit")}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
