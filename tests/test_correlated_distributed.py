"""Two CPU processes (gloo, DDP) with ``--noise_mechanism banded_sqrt --noise_bands 2``: the correlated noise is added
once per step, on rank 0, which alone holds the noise buffer; both ranks keep the segment's position (the update
rules' noise figure) and end with the same parameters and the same ε (⌈T/b⌉ rounds at b·q); every rank's share of each
draw is from the step's partition."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch, rank_results  # noqa: E402

pytestmark = DISTRIBUTED

N, PER_DEVICE, STEPS = 64, 4, 4

WORKER = r"""
    from hf_dp.privacy.privatizer import PrivateOptimizer
    from hf_dp import DPTrainer
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer
    from two_process import record_draws

    noise_calls = []
    orig_add_noise = PrivateOptimizer.add_noise
    def counting_add_noise(self):
        noise_calls.append(1)
        return orig_add_noise(self)
    PrivateOptimizer.add_noise = counting_add_noise
    drawn = record_draws()

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n={n})
    args = dp_args(os.path.join(out, "run"), optim="dp_adambc", learning_rate=1e-2, epsilon=None, noise_multiplier=1.0,
                   per_device_train_batch_size={per_device}, max_steps={steps}, ddp_backend="gloo", dp_seed=3,
                   noise_mechanism="banded_sqrt", noise_bands=2)
    model = make_model()
    trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=make_collator(tok))
    trainer.train()
    opt = trainer.dp.optimizer
    torch.save(dict(
        params={{n: p.detach().clone() for n, p in model.named_parameters()}},
        noise_calls=len(noise_calls), buffered=len(opt.correlation.buffered()), n_params=len(opt.params),
        position=opt.correlation.position, std=opt.noise_std_of_mean, phi=opt.rule.noise_std_of_mean() ** 2,
        epsilon=trainer.get_epsilon(), steps=trainer.ledger.steps, history=list(trainer.ledger.accountant.history),
        partitions=trainer.dp.sampler.partitions.tolist(), draws=[list(b) for b in drawn],
    ), os.path.join(out, f"rank{{rank}}.pt"))
    """


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp_banded")
    launch(base, WORKER.format(n=N, per_device=PER_DEVICE, steps=STEPS), timeout=300)
    return rank_results(base)


def test_banded_noise_once_on_rank_0_and_the_same_model_on_both_ranks(ranks):
    import torch

    from hf_dp.privacy import banded
    from hf_dp.privacy.accounting import compute_epsilon

    r0, r1 = ranks
    assert r0["noise_calls"] == STEPS and r1["noise_calls"] == 0  # the noise enters once, on rank 0
    assert r0["buffered"] == r0["n_params"] and r1["buffered"] == 0  # only rank 0 holds the last b − 1 noises
    assert r0["position"] == r1["position"] == STEPS and r0["std"] == r1["std"] and r0["phi"] == r1["phi"]
    assert r0["std"] == 1.0 * 1.0 * banded.marginal_std_factor(2, STEPS - 1) / (2 * PER_DEVICE)
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    q = 2 * PER_DEVICE / N
    assert r0["steps"] == r1["steps"] == STEPS and r0["history"] == r1["history"] == [(1.0, 2 * q, 2)]
    assert r0["epsilon"] == r1["epsilon"] == compute_epsilon(1.0, q, STEPS, 1e-5, "prv", 2)
    assert r0["partitions"] == r1["partitions"]
    for r in (r0, r1):  # each rank's share of step t's draw is from partition t mod 2 (one micro-batch per step)
        for t, batch in enumerate(r["draws"][:STEPS]):
            assert all(r["partitions"][i] == t % 2 for i in batch), (t, batch)
