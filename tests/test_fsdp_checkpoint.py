"""Sharded checkpoints under FSDP2 that resume with the privacy ledger (issue 30; hf_dp.clipping.sharding).

One 2-process gloo launch (``--fsdp full_shard``, tiny BERT, ``--dp_seed``, the noise on) trains, one after another:

* **U**, uninterrupted: 4 steps (2 per epoch), a checkpoint every 2 steps, HF's default ``state_dict_type``
  (FULL_STATE_DICT: the model gathered by rank 0 into the checkpoint; the DP optimizer's state sharded all the same);
* **A**, the same run with ``state_dict_type: SHARDED_STATE_DICT`` (as R1 and R2), stopped right after its checkpoint at
  step 2 (an interruption at the checkpoint);
* **R1**, a new trainer resuming A's output_dir (``resume_from_checkpoint=True``: checkpoint-2) to step 4, then
  releasing its model with ``save_model``;
* **R2**, after rank 0 truncated one of rank 1's shards in R1's checkpoint-4: a new trainer resuming the same
  output_dir again (``True``), which must skip the incomplete checkpoint-4 and resume checkpoint-2 a second time;
* **R3**, a new trainer resuming U's checkpoint-2 into another output_dir (U took 2 steps past it).

Asserted: the checkpoint holds the sharded model and the DP optimizer's shards of both ranks (no gathered model) and
its marker lists them all; R1 ends with U's model (the step-keyed FSDP noise and the epoch's draws continue where they
would have), U's ε and step count; R2 counts R1's steps from the same checkpoint too (6 noisy steps) and draws fresh
noise; R3 counts the 2 steps U took past its checkpoint (6) and draws fresh noise; R1's release loads as a plain
``PreTrainedModel``. Without FSDP (one process) the checkpoint is refused in one
sentence before any step (row ``fsdp-resume-elsewhere`` of docs/misuse.md).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch, rank_results  # noqa: E402

N, PER_DEVICE, GA, STEPS, SEED, SIGMA = 16, 2, 2, 4, 11, 1.0  # B = 2 × 2 × 2 = 8: 2 steps per epoch

WORKER = r"""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from hf_dp import DPTrainer
    from helpers import StopAt, dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n={n})

    def run(name, output_dir, resume=None, callbacks=(), sharded=True):
        config = {{"transformer_layer_cls_to_wrap": ["BertLayer"]}}
        if sharded:  # the model's shards too (HF's default, FULL_STATE_DICT, gathers it on rank 0 in checkpoints)
            config["state_dict_type"] = "SHARDED_STATE_DICT"
        args = dp_args(
            output_dir, optim="dp_adamw", learning_rate=1e-2, epsilon=None, noise_multiplier={sigma}, accountant="rdp",
            per_device_train_batch_size={per_device}, gradient_accumulation_steps={ga}, max_steps={steps}, logging_steps=1,
            ddp_backend="gloo", dp_seed={seed}, trainable="all", save_strategy="steps", save_steps=2,
            save_total_limit=None, fsdp="full_shard", fsdp_config=config,
        )
        trainer = DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=make_collator(tok),
                            processing_class=tok, callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=resume)
        params = {{k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for k, p in trainer.model.named_parameters()}}
        return trainer, dict(params=params, epsilon=trainer.get_epsilon(), ledger_steps=trainer.ledger.steps,
                             global_step=trainer.state.global_step, resumed_from=trainer.resumed_from,
                             history=list(trainer.ledger.accountant.history), wrapped=type(trainer.model).__name__)

    results = {{}}
    _, results["U"] = run("U", os.path.join(out, "u"), sharded=False)
    _, results["A"] = run("A", os.path.join(out, "a"), callbacks=[StopAt(2)])
    r1, results["R1"] = run("R1", os.path.join(out, "a"), resume=True)
    r1.save_model(os.path.join(out, "release"))
    if rank == 0:  # R1's checkpoint-4 loses the end of one of rank 1's optimizer shards: no longer complete
        shard = os.path.join(out, "a", "checkpoint-4", "hf_dp_optimizer_fsdp", "__1_0.distcp")
        size = os.path.getsize(shard)
        with open(shard, "r+b") as f:
            f.truncate(size - 1)
    dist.barrier()
    _, results["R2"] = run("R2", os.path.join(out, "a"), resume=True)
    # U's own checkpoint-2 (HF's default state_dict_type: the model gathered by rank 0), resumed into another output_dir
    _, results["R3"] = run("R3", os.path.join(out, "u3"), resume=os.path.join(out, "u", "checkpoint-2"), sharded=False)
    torch.save(results, os.path.join(out, f"rank{{rank}}.pt"))
    """

pytestmark = DISTRIBUTED


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp_ckpt")
    launch(base, WORKER.format(n=N, per_device=PER_DEVICE, ga=GA, steps=STEPS, seed=SEED, sigma=SIGMA), timeout=480)
    return (base, *rank_results(base))


def test_the_checkpoint_holds_every_ranks_shards_and_the_marker_lists_them(runs):
    base, r0, _ = runs
    assert r0["U"]["wrapped"].startswith("FSDP")
    ckpt = base / "a" / "checkpoint-2"
    marker = json.loads((ckpt / "hf_dp_checkpoint.json").read_text())
    assert marker["fsdp"] == {"world_size": 2} and marker["ledger_steps"] == 2 and marker["global_step"] == 2
    files = set(marker["files"])
    for rank in (0, 1):  # the DP optimizer's state (rule + ledger) and the model, sharded: each rank wrote its own file
        assert f"hf_dp_optimizer_fsdp/__{rank}_0.distcp" in files, sorted(files)
        assert f"pytorch_model_fsdp_0/__{rank}_0.distcp" in files, sorted(files)
        assert f"rng_state_{rank}.pth" in files
    assert {"hf_dp_optimizer_fsdp/.metadata", "pytorch_model_fsdp_0/.metadata", "scheduler.pt", "trainer_state.json",
            "config.json"} <= files
    assert not any(f.endswith(".safetensors") or f == "optimizer.pt" for f in files)  # nothing gathered on rank 0
    on_disk = {os.path.relpath(os.path.join(d, f), ckpt).replace(os.sep, "/") for d, _, fs in os.walk(ckpt) for f in fs}
    assert files == {f for f in on_disk if f != "hf_dp_checkpoint.json" and not f.startswith("hf_dp_resumed_by-")}
    # HF's default state_dict_type (U): the model gathered by rank 0, once; the DP optimizer's state sharded all the same
    full = set(json.loads((base / "u" / "checkpoint-2" / "hf_dp_checkpoint.json").read_text())["files"])
    assert "pytorch_model_fsdp.bin" in full and not any(f.startswith("pytorch_model_fsdp_0/") for f in full)
    assert {"hf_dp_optimizer_fsdp/__0_0.distcp", "hf_dp_optimizer_fsdp/__1_0.distcp"} <= full
    assert not any(f.endswith(".safetensors") or f == "optimizer.pt" for f in full)


def test_resumed_run_equals_the_uninterrupted_run(runs):
    _, r0, r1 = runs
    u, a, res = r0["U"], r0["A"], r0["R1"]
    assert a["global_step"] == a["ledger_steps"] == 2  # A stopped at its checkpoint
    assert res["resumed_from"].endswith("checkpoint-2")
    assert res["global_step"] == u["global_step"] == STEPS and res["ledger_steps"] == u["ledger_steps"] == STEPS
    assert res["epsilon"] == u["epsilon"] and res["history"] == u["history"] == [(SIGMA, PER_DEVICE * GA * 2 / N, STEPS)]
    from helpers import make_model

    init = dict(make_model().named_parameters())
    assert max((u["params"][k] - init[k]).abs().max().item() for k in init) > 1e-3  # it trained
    moved_after_resume = max((res["params"][k] - a["params"][k]).abs().max().item() for k in init)
    assert moved_after_resume > 1e-3  # R1 trained past the checkpoint (not a reload of A's end)
    for k in u["params"]:
        torch.testing.assert_close(res["params"][k], u["params"][k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
        assert torch.equal(r0["R1"]["params"][k], r1["R1"]["params"][k])  # both ranks gathered the same model
    assert r1["R1"]["ledger_steps"] == STEPS and r1["R1"]["epsilon"] == res["epsilon"]


def test_a_second_resume_from_the_same_checkpoint_counts_both_and_skips_the_incomplete_one(runs):
    _, r0, r1 = runs
    first, second = r0["R1"], r0["R2"]
    assert second["resumed_from"].endswith("checkpoint-2")  # checkpoint-4 (truncated shard) skipped
    # 2 steps in the checkpoint + R1's 2 from it + its own 2: nothing computed from checkpoint-2 goes uncounted
    assert second["global_step"] == STEPS and second["ledger_steps"] == r1["R2"]["ledger_steps"] == 6
    assert second["epsilon"] > first["epsilon"] and r1["R2"]["epsilon"] == second["epsilon"]
    from hf_dp.privacy.accounting import compute_epsilon

    q = PER_DEVICE * GA * 2 / N
    assert second["epsilon"] == pytest.approx(compute_epsilon(SIGMA, q, 6, 1e-5, "rdp"), rel=1e-9)
    # its steps are keyed past R1's (ledger steps 4, 5): fresh noise and batches, not a replay of R1's steps 3, 4
    assert max((second["params"][k] - first["params"][k]).abs().max().item() for k in first["params"]) > 1e-3


def test_steps_the_run_took_past_its_checkpoint_stay_counted(runs):
    """R3 resumes U's checkpoint-2 although U went on to step 4: U's steps 3 and 4 stay in R3's ledger, and R3's own
    steps are keyed past them (fresh noise and batches, not U's steps replayed)."""
    _, r0, r1 = runs
    u, r3 = r0["U"], r0["R3"]
    assert r3["resumed_from"].endswith(os.path.join("u", "checkpoint-2"))
    assert r3["global_step"] == STEPS and r3["ledger_steps"] == r1["R3"]["ledger_steps"] == 6
    from hf_dp.privacy.accounting import compute_epsilon

    assert r3["epsilon"] == pytest.approx(compute_epsilon(SIGMA, PER_DEVICE * GA * 2 / N, 6, 1e-5, "rdp"), rel=1e-9)
    assert max((r3["params"][k] - u["params"][k]).abs().max().item() for k in u["params"]) > 1e-3


def test_the_release_after_resume_is_a_plain_model(runs):
    base, r0, _ = runs
    from transformers import AutoModelForSequenceClassification

    release = base / "release"
    report = json.loads((release / "privacy.json").read_text())
    assert abs(float(report["epsilon"]) - r0["R1"]["epsilon"]) < 1e-9 * max(1.0, r0["R1"]["epsilon"])
    model = AutoModelForSequenceClassification.from_pretrained(release)
    assert type(model).__name__ == "BertForSequenceClassification"
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), r0["R1"]["params"][k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_fsdp_checkpoint_is_refused_without_fsdp(runs, tmp_path):
    """Row ``fsdp-resume-elsewhere`` of docs/misuse.md: one process without --fsdp, before any step."""
    base, _, _ = runs
    import transformers

    from hf_dp import DPTrainer
    from helpers import StepCounter, dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    transformers.logging.set_verbosity_error()
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=N)
    args = dp_args(tmp_path / "out", optim="dp_adamw", learning_rate=1e-2, epsilon=None, noise_multiplier=SIGMA,
                   accountant="rdp", per_device_train_batch_size=PER_DEVICE * 2, gradient_accumulation_steps=GA,
                   max_steps=STEPS, trainable="all", dp_seed=SEED)
    counter = StepCounter()
    model = make_model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=make_collator(tok), callbacks=[counter])
    with pytest.raises(ValueError) as info:
        trainer.train(resume_from_checkpoint=str(base / "a" / "checkpoint-2"))
    message = str(info.value)
    assert info.match(r"^refusing to resume from .*checkpoint-2: it was written under FSDP by 2 processes \(a sharded "
                      r"model and optimizer state\), not with 1 process without --fsdp; resume it with --fsdp and 2 "
                      r"processes$"), message
    assert "\n" not in message and counter.optimizer_steps == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_check_resume_refuses_other_world_sizes_and_unsharded_checkpoints(tmp_path):
    """hf_dp.clipping.sharding.check_resume on its own (no launch): another number of processes under FSDP, a checkpoint
    without the DP optimizer's shards, a checkpoint written without FSDP resumed under it; the accepted cases."""
    from hf_dp.clipping.sharding import OPTIMIZER_DIR, check_resume

    ckpt = tmp_path / "checkpoint-2"
    (ckpt / OPTIMIZER_DIR).mkdir(parents=True)
    sharded = {"fsdp": {"world_size": 2}}
    with pytest.raises(ValueError, match=r"^refusing to resume from .*: it was written under FSDP by 2 processes .*not "
                                         r"with 4 processes under --fsdp; resume it with --fsdp and 2 processes$"):
        check_resume(str(ckpt), sharded, True, 4)
    with pytest.raises(ValueError, match=r"it holds no sharded DP optimizer state \(hf_dp_optimizer_fsdp\), so no privacy "
                                         r"ledger"):
        check_resume(str(ckpt), sharded, True, 2)
    _dcp_save({"optimizer": {"state": {"0": {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
               "hf_dp": b"ledger"}, ckpt / OPTIMIZER_DIR)  # a real DCP folder, as save_checkpoint_state writes
    check_resume(str(ckpt), sharded, True, 2)  # accepted
    with pytest.raises(ValueError, match=r"^refusing to resume from .* under --fsdp: it was written without FSDP"):
        check_resume(str(ckpt), {"ledger_steps": 2}, True, 2)
    check_resume(str(ckpt), {"ledger_steps": 2}, False, 2)  # DDP/one process: not this function's business


def _dcp_save(state, folder) -> None:
    """``torch.distributed.checkpoint.save`` in this one process (no process group: DCP's single-process mode)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))


class _RunsCode:
    """A pickle that runs code when loaded: creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("where", ["metadata", "optimizer_leaf", "model_metadata"])
def test_a_crafted_checkpoint_runs_no_code_at_resume(tmp_path, where):
    """torch.distributed.checkpoint reads ``.metadata`` with plain ``pickle.load`` and its non-tensor entries with
    ``torch.load(weights_only=False)``: a checkpoint from elsewhere must not run code when it is resumed (the
    non-FSDP path reads ``optimizer.pt`` with weights_only=True). Refused in one sentence, nothing run."""
    import pickle
    import types

    from hf_dp.clipping.sharding import OPTIMIZER_DIR, check_resume, load_checkpoint_state

    ckpt, ran = tmp_path / "checkpoint-2", tmp_path / "ran"
    optimizer = {"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, "hf_dp": b"ledger"}
    if where == "optimizer_leaf":
        optimizer["hf_dp"] = _RunsCode(ran)  # DCP pickles it with torch.save
    _dcp_save(optimizer, ckpt / OPTIMIZER_DIR)
    if where == "metadata":
        (ckpt / OPTIMIZER_DIR / ".metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
    if where == "model_metadata":  # HF's sharded model load would unpickle this entry with weights_only=False
        _dcp_save({"model": {"weight": torch.zeros(2), "extra": _RunsCode(ran)}}, ckpt / "pytorch_model_fsdp_0")
    private = types.SimpleNamespace(rule=types.SimpleNamespace(param_groups=[]))  # a privatizer with no parameters
    with pytest.raises(ValueError, match=r"^refusing to resume from "):
        check_resume(str(ckpt), {"fsdp": {"world_size": 2}}, True, 2)
        load_checkpoint_state(private, None, str(ckpt))
    assert not ran.exists()


@pytest.mark.parametrize("where", ["rank_local_metadata", "metadata_dir", "symlinked_model_dir"])
def test_a_crafted_model_folder_runs_no_code_at_resume(tmp_path, where):
    """Accelerate's sharded model load (``load_fsdp_model``: ``dcp.load`` of ``pytorch_model_fsdp_0``) unpickles more
    than the ``.metadata`` files a walk of the checkpoint finds: when ``.metadata`` is missing or unreadable (absent, or
    a folder of that name) DCP falls back to the rank-local ``__<rank>.metadata`` (plain ``pickle.load``), and a model
    folder that is a symlink is not descended by ``os.walk``. Each is refused before any load, nothing run."""
    import contextlib
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from hf_dp.clipping.sharding import OPTIMIZER_DIR, check_resume

    ckpt, ran = tmp_path / "checkpoint-2", tmp_path / "ran"
    _dcp_save({"optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}, "hf_dp": b"ledger"},
              ckpt / OPTIMIZER_DIR)  # a legitimate optimizer folder
    model = ckpt / "pytorch_model_fsdp_0"
    if where == "symlinked_model_dir":
        elsewhere = tmp_path / "elsewhere"
        _dcp_save({"model": {"weight": torch.zeros(2)}}, elsewhere)
        (elsewhere / ".metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
        model.symlink_to(elsewhere, target_is_directory=True)
    else:
        _dcp_save({"model": {"weight": torch.zeros(2)}}, model)
        (model / ".metadata").unlink()
        if where == "metadata_dir":
            (model / ".metadata").mkdir()
        (model / "__0.metadata").write_bytes(pickle.dumps(_RunsCode(ran)))
    # what Accelerate's load_fsdp_model does with it (dcp.load, DefaultLoadPlanner): the crafted pickle runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(BaseException):
            dcp.load({"model": {"weight": torch.zeros(2)}}, storage_reader=dcp.FileSystemReader(str(model)))
    assert ran.exists()
    ran.unlink()
    with pytest.raises(ValueError, match=r"^refusing to resume from "):
        check_resume(str(ckpt), {"fsdp": {"world_size": 2}}, True, 2)
    assert not ran.exists()
