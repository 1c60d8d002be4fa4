"""Fault injection: SIGKILL the training process mid-step, mid-evaluation and mid-checkpoint-write,
then resume with ``resume_from_checkpoint=True`` in a new process.

Asserted for every fault:

* the resumed run loads the newest COMPLETE checkpoint (never the half-written one, although HF's
  own ``get_last_checkpoint`` would pick it), and its ledger holds exactly that checkpoint's
  ``global_step`` noisy steps (ε continues, never reset);
* every ε logged by the crashed run equals the uninterrupted run's ε at that step; the steps it took
  past the checkpoint stay in the ledger (the resumed run draws fresh batches and noise, so its steps
  are new releases), and ε never decreases across the crash;
* the resumed run ends at the planned global step with every noisy step counted, and — fresh
  randomness, nothing replayed — not with the uninterrupted run's parameters.

Plus: an explicit path to a half-written checkpoint is refused, and resuming with changed privacy
settings (σ, C, batch size → q and B, δ, N, accountant) is refused before any step.

The training script runs in a subprocess (real SIGKILL); a fault is armed by the environment variable
``HF_DP_FAULT=<where>:<global_step>``; at that point the script prints ``FAULT-READY`` and sleeps,
and the test kills it. Timing is therefore deterministic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore")

MAX_STEPS = 8
TIMEOUT = 240  # seconds per subprocess (2 shared, noisy cores)

SCRIPT = textwrap.dedent(
    r'''
    import json, os, sys, time
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback
    from hf_dp import DPTrainer, DPTrainingArguments

    out = sys.argv[1]
    resume = sys.argv[2] == "resume"
    fault = os.environ.get("HF_DP_FAULT")
    where, at = (fault.split(":")[0], int(fault.split(":")[1])) if fault else (None, None)

    def hang(what):
        print(f"FAULT-READY {what}", flush=True)
        time.sleep(3600)

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (80, 8), generator=g)
    labels = (ids[:, 0] > 27).long()
    full = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * 80, "labels": labels.tolist()})
    train, evals = full.select(range(64)), full.select(range(64, 80))

    class Probe(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "epsilon" in logs and "loss" in logs:
                print("LOG " + json.dumps({"step": state.global_step, "epsilon": logs["epsilon"]}), flush=True)
        def on_pre_optimizer_step(self, args, state, control, **kw):  # gradients accumulated, step not taken
            if where == "step" and state.global_step == at:
                hang("mid-step")
        def on_prediction_step(self, args, state, control, **kw):
            if where == "eval" and state.global_step == at:
                hang("mid-eval")

    if where == "save":
        orig = DPTrainer._save_rng_state
        def slow_rng_state(self, output_dir):  # model + optimizer.pt + scheduler written; rng, trainer_state not
            if self.state.global_step == at:
                hang("mid-checkpoint-write")
            return orig(self, output_dir)
        DPTrainer._save_rng_state = slow_rng_state

    args = DPTrainingArguments(
        output_dir=out, optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, delta=1e-3,
        learning_rate=5e-3, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=%(max_steps)d,
        logging_steps=1, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
        save_strategy="steps", save_steps=2, save_total_limit=2, report_to=[], dp_seed=1, seed=0,
        dataloader_num_workers=0, use_cpu=True, disable_tqdm=True, trainable="all",
    )
    t = DPTrainer(model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=[Probe()])
    t.train(resume_from_checkpoint=True if resume else None)
    torch.save({k: v.detach().clone() for k, v in t.model.state_dict().items()}, os.path.join(out, "final_params.pt"))
    print("RESULT " + json.dumps({
        "resumed_from": t.resumed_from, "resumed_ledger_steps": t.dp.lineage.resumed_ledger_steps,
        "epsilon": t.get_epsilon(), "ledger_steps": t.ledger.steps, "global_step": t.state.global_step,
    }), flush=True)
    '''
) % {"max_steps": MAX_STEPS}


def _env(fault: str | None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("HF_DP_FAULT", None)
    if fault:
        env["HF_DP_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    return env


def _parse(stdout: str) -> tuple[list[dict], dict | None]:
    logs, result = [], None
    for line in stdout.splitlines():
        if line.startswith("LOG "):
            logs.append(json.loads(line[4:]))
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
    return logs, result


class _Run:
    """One subprocess running the script; with ``fault``, SIGKILLed as soon as it reports the fault point."""

    def __init__(self, script: str, out: str, resume: bool = False, fault: str | None = None):
        self.fault = fault
        self.proc = subprocess.Popen(
            [sys.executable, script, out, "resume" if resume else "fresh"], env=_env(fault),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
        )
        self.lines: list[str] = []
        self.stderr = ""
        self.killed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._err.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.fault and line.startswith("FAULT-READY"):
                os.kill(self.proc.pid, signal.SIGKILL)  # a real SIGKILL at a known point
                self.killed = True
                break

    def _read_err(self):
        self.stderr = self.proc.stderr.read()

    def finish(self) -> tuple[list[dict], dict | None]:
        try:
            self.proc.wait(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=30)
        self._err.join(timeout=30)
        stdout = "".join(self.lines)
        if self.fault:
            assert self.killed and self.proc.returncode == -signal.SIGKILL, (
                f"the script did not reach the fault {self.fault}: {stdout[-1500:]} {self.stderr[-3000:]}"
            )
        else:
            assert self.proc.returncode == 0, self.stderr[-4000:]
        logs, result = _parse(stdout)
        assert self.fault or result is not None, stdout[-2000:]
        return logs, result


# (fault, the checkpoint that must be resumed from, what must be on disk after the kill)
FAULTS = {
    # killed during step 6 (gradients accumulated, optimizer step not taken): checkpoints 2 and 4 complete
    "mid-step": ("step:5", 4, {2: True, 4: True}),
    # killed during the evaluation at step 4, which precedes checkpoint-4's save
    "mid-eval": ("eval:4", 2, {2: True}),
    # killed after model + optimizer.pt (with the newer ledger) of checkpoint-6 were written, before
    # rng_state / trainer_state.json / the marker: checkpoint-6 is half-written and must be skipped
    "mid-checkpoint-write": ("save:6", 4, {2: True, 4: True, 6: False}),
}


def _checkpoints(out: str) -> dict[int, bool]:
    from hf_dp.run.checkpointing import checkpoint_problem, list_checkpoints

    return {int(p.rsplit("-", 1)[1]): checkpoint_problem(p) is None for p in list_checkpoints(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All subprocesses, in two concurrent waves: the uninterrupted run + the three killed runs, then
    the three resumed runs. Returns the reference and, per fault, what was on disk after the kill
    and the logs/results of both halves."""
    from transformers.trainer_utils import get_last_checkpoint

    base = tmp_path_factory.mktemp("faults")
    script = str(base / "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    ref_out = str(base / "uninterrupted")
    ref_run = _Run(script, ref_out)
    killed = {name: _Run(script, str(base / name), fault=fault) for name, (fault, _, _) in FAULTS.items()}
    after_kill = {}
    for name, run in killed.items():
        logs, _ = run.finish()
        out = str(base / name)
        after_kill[name] = {"logs": logs, "checkpoints": _checkpoints(out), "hf_last": get_last_checkpoint(out),
                            "files": {os.path.basename(p): sorted(os.listdir(p)) for p in map(str, (base / name).glob("checkpoint-*"))}}
    resumed = {name: _Run(script, str(base / name), resume=True) for name in FAULTS}
    ref_logs, ref_result = ref_run.finish()
    eps_by_step = {e["step"]: e["epsilon"] for e in ref_logs}
    reference = {"out": ref_out, "eps": eps_by_step, "result": ref_result,
                 "params": torch.load(os.path.join(ref_out, "final_params.pt"))}
    results = {}
    for name, run in resumed.items():
        logs, result = run.finish()
        results[name] = {**after_kill[name], "resumed_logs": logs, "result": result, "out": str(base / name)}
    return reference, results


def test_uninterrupted_reference(runs):
    reference, _ = runs
    result = reference["result"]
    assert result["global_step"] == result["ledger_steps"] == MAX_STEPS and result["resumed_from"] is None
    assert sorted(reference["eps"]) == list(range(1, MAX_STEPS + 1))
    assert all(_checkpoints(reference["out"]).values())


@pytest.mark.parametrize("name", list(FAULTS))
def test_kill_and_resume(name, runs):
    reference, results = runs
    r = results[name]
    _, resume_step, on_disk = FAULTS[name]
    out = r["out"]
    assert r["checkpoints"] == on_disk
    if name == "mid-checkpoint-write":
        half = r["files"]["checkpoint-6"]
        assert "optimizer.pt" in half and "trainer_state.json" not in half and "hf_dp_checkpoint.json" not in half
        assert r["hf_last"] == os.path.join(out, "checkpoint-6")  # what plain HF would (wrongly) resume from

    # resumed from the last complete checkpoint, its ledger holding exactly its global_step steps
    result = r["result"]
    assert os.path.basename(result["resumed_from"]) == f"checkpoint-{resume_step}"
    assert result["resumed_ledger_steps"] == resume_step
    assert r["resumed_logs"][0]["step"] == resume_step + 1

    # ε: the killed run logged the reference values. The steps it took past the checkpoint (recorded in
    # output_dir before any of their output was written) stay in the ledger: the resumed steps draw fresh
    # batches and noise, so they are new releases, and ε at global step s counts spent + (s - resume_step)
    from hf_dp.privacy.accounting import compute_epsilon

    crashed, resumed = r["logs"], r["resumed_logs"]
    assert crashed and resumed
    for entry in crashed:
        assert entry["epsilon"] == reference["eps"][entry["step"]], entry
    spent = max(e["step"] for e in crashed)
    orphans = spent - resume_step
    assert orphans >= 1
    sigma, q, delta = 1.0, 16 / 64, 1e-3
    for entry in resumed:
        assert entry["epsilon"] == pytest.approx(compute_epsilon(sigma, q, entry["step"] + orphans, delta, "prv"), rel=1e-12), entry
    eps_seq = [e["epsilon"] for e in crashed + resumed]
    assert all(b >= a for a, b in zip(eps_seq, eps_seq[1:])), eps_seq

    # the planned number of steps, every noisy step counted; fresh randomness: not the uninterrupted run's model
    ref = reference["result"]
    assert result["global_step"] == MAX_STEPS and result["ledger_steps"] == MAX_STEPS + orphans
    assert result["epsilon"] == pytest.approx(compute_epsilon(sigma, q, MAX_STEPS + orphans, delta, "prv"), rel=1e-12)
    assert result["epsilon"] > ref["epsilon"]
    params = torch.load(os.path.join(out, "final_params.pt"))
    assert params.keys() == reference["params"].keys()
    assert any(not torch.equal(params[k], v) for k, v in reference["params"].items())
    # every checkpoint left behind by the resumed run is complete, with the ledger's ε
    left = _checkpoints(out)
    assert left and all(left.values())
    for step in left:
        marker = json.load(open(os.path.join(out, f"checkpoint-{step}", "hf_dp_checkpoint.json")))
        assert marker["global_step"] == step and marker["ledger_steps"] == step + orphans
        assert marker["epsilon"] == pytest.approx(compute_epsilon(sigma, q, step + orphans, delta, "prv"), rel=1e-12)


# ---------------------------------------------------------------------------------------------------
# in-process checks on the checkpoints (no subprocess needed)
# ---------------------------------------------------------------------------------------------------
def _tiny_trainer(out, n=64, **overrides):
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification

    from hf_dp import DPTrainer, DPTrainingArguments

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, num_labels=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (n, 8), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 8] * n, "labels": (ids[:, 0] > 27).long().tolist()})
    kw = dict(
        output_dir=out, optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, delta=1e-3,
        learning_rate=5e-3, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=MAX_STEPS,
        save_strategy="steps", save_steps=2, save_total_limit=2, report_to=[], dp_seed=1, seed=0,
        dataloader_num_workers=0, use_cpu=True, disable_tqdm=True, trainable="all",
    )
    kw.update(overrides)
    return DPTrainer(model=BertForSequenceClassification(cfg), args=DPTrainingArguments(**kw), train_dataset=ds)


def _step_counter(trainer):
    from transformers import TrainerCallback

    class StepCounter(TrainerCallback):
        n = 0

        def on_optimizer_step(self, args, state, control, **kw):
            StepCounter.n += 1

    cb = StepCounter()
    trainer.add_callback(cb)
    return cb


@pytest.fixture(scope="module")
def finished_run(runs, tmp_path_factory):
    """A copy of the uninterrupted run's output dir (complete checkpoints 6 and 8)."""
    import shutil

    reference, _ = runs
    out = str(tmp_path_factory.mktemp("copy") / "run")
    shutil.copytree(reference["out"], out)
    assert _checkpoints(out) == {8: True, 6: True}
    return out


def test_explicit_half_written_checkpoint_is_refused(finished_run, tmp_path):
    from hf_dp.run.checkpointing import IncompleteCheckpointError

    import shutil

    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    half = os.path.join(out, "checkpoint-8")
    os.remove(os.path.join(half, "trainer_state.json"))  # as if killed before HF wrote it
    os.remove(os.path.join(half, "hf_dp_checkpoint.json"))
    t = _tiny_trainer(out)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(IncompleteCheckpointError, match=r"refusing to resume from .*checkpoint-8: it is not a complete hf_dp checkpoint"):
        t.train(resume_from_checkpoint=half)
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())
    # a truncated file is caught too (size recorded in the marker)
    ck6 = os.path.join(out, "checkpoint-6")
    with open(os.path.join(ck6, "optimizer.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(IncompleteCheckpointError, match="optimizer.pt has 100 bytes"):
        _tiny_trainer(out).train(resume_from_checkpoint=ck6)
    # and with True there is nothing complete left to resume from
    with pytest.raises(ValueError, match="No complete hf_dp checkpoint found"):
        _tiny_trainer(out).train(resume_from_checkpoint=True)


CHANGED = {
    "sigma": ({"noise_multiplier": 1.1}, {}, "noise_multiplier"),
    "C": ({"per_sample_max_grad_norm": 0.5}, {}, "max_grad_norm"),
    "batch size (q, B)": ({"per_device_train_batch_size": 4}, {}, "sample_rate"),
    "delta": ({"delta": 1e-4}, {}, "delta"),
    "dataset size": ({}, {"n": 72}, "dataset_size"),
    "accountant": ({"accountant": "rdp"}, {}, "accountant"),
}


@pytest.mark.parametrize("name", list(CHANGED))
def test_resume_with_changed_privacy_settings_is_refused(name, finished_run, tmp_path):
    import shutil

    overrides, trainer_kw, field = CHANGED[name]
    out = str(tmp_path / "run")
    shutil.copytree(finished_run, out)
    t = _tiny_trainer(out, max_steps=MAX_STEPS + 2, **trainer_kw, **overrides)
    counter = _step_counter(t)
    with pytest.raises(ValueError, match=rf"refusing to resume: the privacy settings differ from the checkpoint's \(.*{field}: checkpoint"):
        t.train(resume_from_checkpoint=True)
    assert counter.n == 0
    assert t.ledger.steps == 0  # the refused history was not adopted
