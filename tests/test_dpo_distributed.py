"""Two CPU processes (gloo) train one DP DPO model (issue 51 item 6): identical weights, the same ε as one process.

One ``torchrun --nproc_per_node 2`` launch (tests/two_process.py) of ``DPDPOTrainer`` on a tiny random Llama (from a
config) and 32 synthetic preference pairs of 8 users, user-level DP (one unit = every pair of one user), LoRA (the
reference: the policy with its adapter disabled), OS-entropy randomness (rank 0's key, shared). Each rank writes its
parameters, its ledger's ε and history and its planned mechanism; the test checks that both ranks end with the same
parameters, that the ledger's ε is the same on both and equals the accountant's ε for the same σ, q = B/N and steps,
with B = per-device batch × 2 processes (the mechanism a one-process run with that batch plans), and that the launch
finishes in well under a minute.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

pytest.importorskip("trl")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch, rank_results  # noqa: E402

pytestmark = DISTRIBUTED

PAIRS, USERS, PER_DEVICE, STEPS = 32, 8, 2, 3
CONFIG = dict(epsilon=3.0, per_device_train_batch_size=PER_DEVICE, max_steps=STEPS, use_cpu=True, report_to="none",
              learning_rate=1e-2, save_strategy="no", max_length=64, disable_tqdm=True, dataloader_num_workers=0,
              trainable="lora", lora_r=2, privacy_unit_column="user_id", logging_steps=1)

WORKER = r"""
    from datasets import Dataset
    from helpers import make_tokenizer, preference_pairs, tiny_llama
    from hf_dp.dpo import DPDPOConfig, DPDPOTrainer

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    tok.eos_token = "[SEP]"
    args = DPDPOConfig(output_dir=os.path.join(out, "run"), ddp_backend="gloo", dp_seed=None, **{config!r})
    model = tiny_llama(tok)
    trainer = DPDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(preference_pairs({pairs}, {users})),
                           processing_class=tok)
    assert args.world_size == 2, args.world_size
    trainer.train()
    torch.save(dict(
        world_size=args.world_size, wrapped=type(trainer.model_wrapped).__name__,
        params={{n: p.detach().clone() for n, p in model.named_parameters()}},
        trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad),
        epsilon=trainer.get_epsilon(), history=list(trainer.ledger.accountant.history),
        spec=trainer.privacy_spec.as_dict(), steps=trainer.state.global_step, units=trainer.num_units,
    ), os.path.join(out, f"rank{{rank}}.pt"))
    """


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    base = tmp_path_factory.mktemp("dpo_ddp")
    start = time.monotonic()
    launch(base, WORKER.format(config=CONFIG, pairs=PAIRS, users=USERS), timeout=240)
    return rank_results(base), time.monotonic() - start


def test_two_processes_train_one_dp_dpo_model_with_the_single_process_epsilon(ranks, tmp_path):
    (r0, r1), seconds = ranks
    assert seconds < 60, f"the two-process DPO run took {seconds:.0f} s"
    assert r0["world_size"] == r1["world_size"] == 2 and r0["wrapped"] == "DistributedDataParallel"
    assert r0["steps"] == r1["steps"] == STEPS and r0["units"] == r1["units"] == USERS
    # the same model on both ranks, and the adapter trained (LoRA's B starts at 0)
    assert r0["params"].keys() == r1["params"].keys() and r0["trainable"] == r1["trainable"]
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), f"{name} differs across ranks"
    lora_b = [n for n in r0["trainable"] if "lora_B" in n]
    assert lora_b and all(r0["params"][n].abs().sum() > 0 for n in lora_b)
    # one ledger: the same ε on both ranks, the accountant's ε of STEPS steps at σ and q = B/N, B = 2 per device × 2
    b = PER_DEVICE * 2
    for r in (r0, r1):
        assert r["spec"] == r0["spec"] and r["spec"]["expected_batch_size"] == b
        assert r["spec"]["sample_rate"] == b / USERS and r["spec"]["dataset_size"] == USERS
        assert r["history"] == [(r["spec"]["noise_multiplier"], b / USERS, STEPS)]
    assert r0["epsilon"] == r1["epsilon"] <= CONFIG["epsilon"] + 1e-9
    from hf_dp.privacy.accounting import compute_epsilon

    spec = r0["spec"]
    eps = compute_epsilon(spec["noise_multiplier"], spec["sample_rate"], STEPS, spec["delta"], spec["accountant"])
    assert r0["epsilon"] == pytest.approx(eps, rel=1e-12)
    # the mechanism a one-process run with the same logical batch plans (σ calibrated for the same q and steps)
    from datasets import Dataset
    from helpers import make_tokenizer, preference_pairs, tiny_llama

    from hf_dp.dpo import DPDPOConfig, DPDPOTrainer

    tok = make_tokenizer(tmp_path / "tok")
    tok.eos_token = "[SEP]"
    one = DPDPOTrainer(model=tiny_llama(tok), args=DPDPOConfig(output_dir=str(tmp_path / "one"),
                                                                **{**CONFIG, "per_device_train_batch_size": b}),
                       train_dataset=Dataset.from_list(preference_pairs(PAIRS, USERS)), processing_class=tok)
    assert one.privacy_spec.as_dict() == spec
