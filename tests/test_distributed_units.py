"""Two CPU processes (gloo) train a causal LM with a privacy unit column (issue 29): ranks share out each step's drawn
units (never rows of one unit), each unit's rows stay on one rank and in one micro-batch, both ranks end with the same model, ghost
clipping trains the model the Opacus hooks train (same --dp_seed), and ε is that of one process with the same global
batch over N = the number of units."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch, rank_results  # noqa: E402

N_ROWS, USERS, STEPS = 60, 15, 3

WORKER = r"""
    from hf_dp import DPTrainer
    from helpers import dp_args, make_tokenizer
    from test_causal_lm import collator, gpt2, lm_data
    from two_process import record_draws

    drawn = record_draws()

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    data = lm_data(tok, n={n}, users=lambda i: f"user{{i % {users}}}")
    results = {{}}
    for engine in ("ghost", "hooks"):
        drawn.clear()
        args = dp_args(os.path.join(out, engine), optim="dp_sgd", learning_rate=0.5, noise_multiplier=1.0, epsilon=None,
                       accountant="rdp", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       max_steps={steps}, trainable="all", clipping=engine, ddp_backend="gloo", dp_seed=7,
                       privacy_unit_column="user_id", dp_max_length=32)  # rows of at most 32 tokens
        tr = DPTrainer(model=gpt2(tok), args=args, train_dataset=data, data_collator=collator(tok))
        assert args.world_size == 2
        tr.train()
        results[engine] = dict(
            params={{n: p.detach().clone() for n, p in tr.model.named_parameters()}},
            spec=tr.privacy_spec.as_dict(), epsilon=tr.get_epsilon(), clipping=tr.clipping,
            drawn=[list(b) for b in drawn], steps=tr.state.global_step,
        )
    torch.save(dict(results=results, users=list(data["user_id"])), os.path.join(out, f"rank{{rank}}.pt"))
    """


pytestmark = DISTRIBUTED


def test_two_processes_train_one_model_over_units(tmp_path):
    launch(tmp_path, WORKER.format(n=N_ROWS, users=USERS, steps=STEPS), timeout=400)
    r0, r1 = rank_results(tmp_path)
    users = r0["users"]
    for engine in ("ghost", "hooks"):
        a, b = r0["results"][engine], r1["results"][engine]
        assert a["clipping"] == engine and a["steps"] == b["steps"] == STEPS
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), f"{engine}: {n} differs across ranks"
        # in every step the ranks' units are disjoint, each unit whole (all its rows) in one micro-batch of one rank
        assert min(len(a["drawn"]), len(b["drawn"])) >= 2 * STEPS  # 2 micro-batches a step (the loader may fetch ahead)
        for t in range(STEPS):
            own0 = {users[i] for mb in a["drawn"][2 * t : 2 * t + 2] for i in mb}
            own1 = {users[i] for mb in b["drawn"][2 * t : 2 * t + 2] for i in mb}
            assert not (own0 & own1)
        assert any(a["drawn"]) and any(b["drawn"])
        for mb in a["drawn"] + b["drawn"]:
            for u in {users[i] for i in mb}:
                assert sorted(i for i in mb if users[i] == u) == [i for i in range(N_ROWS) if users[i] == u]
        assert a["spec"]["dataset_size"] == USERS and a["spec"] == b["spec"] and a["epsilon"] == b["epsilon"]
    # same draws and noise (dp_seed): ghost clipping trains the model the hooks train, up to their rounding allowances:
    # each clipped unit gives up γ·S_u of its norm under ghost clipping (S_u: the sum over its rows' tokens of
    # ‖a_t‖‖g_t‖) and γ·‖G_u‖ under the hooks, γ ≈ 2e-4 here (hf_dp.clipping.common.TokenBounds)
    for n, p in r0["results"]["ghost"]["params"].items():
        torch.testing.assert_close(p, r0["results"]["hooks"]["params"][n], rtol=1e-3, atol=3e-4)
    # ε of one process with the same global batch (B = 2 × 2 × 2 = 8 units of 15)
    from hf_dp.privacy.accounting import compute_epsilon

    spec = r0["results"]["ghost"]["spec"]
    assert spec["sample_rate"] == pytest.approx(8 / USERS)
    assert r0["results"]["ghost"]["epsilon"] == pytest.approx(
        compute_epsilon(spec["noise_multiplier"], spec["sample_rate"], STEPS, spec["delta"], "rdp"), rel=1e-12)
