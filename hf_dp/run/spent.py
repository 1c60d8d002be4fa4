"""Steps spent: every run's record of the noisy steps it took, the forks of a checkpoint, and a resumed run's ledger.

``hf_dp_epsilon_spent.json`` keeps every run's record of steps taken, keyed by run id (:func:`write_spent`), written
after every step and before anything that step produced is logged or saved. A resume is a new run whose parent is the
checkpoint's run and step; it records itself in the checkpoint folder and in the checkpoints that one descends from
(``hf_dp_resumed_by-<run id>.json``, written after the marker and not listed in it, the folder's mtime kept for HF's
rotation), and :func:`reconcile_resumed_ledger` counts, conservatively, every noisy step computed from the checkpoint:
its own, its run's past it, and each earlier resume's. The checkpoint itself (marker, completeness, which one to
resume from) is :mod:`hf_dp.run.checkpointing`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets

from transformers import TrainerCallback

from hf_dp.run.checkpointing import (
    RESUME_PREFIX,
    list_checkpoints,
    matches_training_data,
    read_marker,
    same_mechanism,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

SPENT_NAME = "hf_dp_epsilon_spent.json"


@contextlib.contextmanager
def _folder_lock(folder: str):
    """An exclusive lock on ``folder`` (``flock`` of the directory itself: no lock file left behind) around a
    read-modify-write of a record several runs may update at once; a no-op where ``flock`` is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # pragma: no cover - e.g. a file system without flock
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def write_spent(output_dir: str, steps: int, epsilon: float | None, spec: dict, run_id: str | None = None,
                extra: dict | None = None) -> None:
    """Record (atomically) that run ``run_id`` in ``output_dir`` has taken ``steps`` noisy steps (ε spent).

    Written after every step, before any ε is logged, before a checkpoint or a model is saved, so that a run
    resumed from an older checkpoint counts the steps the interrupted run took past it (they were computed with
    randomness that is gone; the resumed steps are new releases). The record of the same run never goes down.
    ``epsilon`` may be None (not computed yet at that step: the per-step record makes no accountant call); the step
    count is what resumes use.

    The file keeps **every run's record**, keyed by run id (``"runs"``; another run's record is never replaced);
    its top-level ``steps`` / ``epsilon`` / ``privacy_spec`` / ``run_id`` repeat the record written last (the
    single-record format of earlier versions, which :func:`read_spent_runs` still reads). ``extra``: public facts
    stored with the record (e.g. the parent checkpoint of a resumed run).
    """
    os.makedirs(output_dir, exist_ok=True)
    with _folder_lock(output_dir):
        runs = read_spent_runs(output_dir)
        key = run_id if run_id is not None else "unknown"
        old = runs.get(key)
        if old and run_id is not None and int(old.get("steps") or 0) > steps:
            return
        if epsilon is None and old and int(old.get("steps") or 0) == steps:
            epsilon = old.get("epsilon")  # the same step count: keep an ε already computed
        record = {"steps": int(steps), "epsilon": None if epsilon is None else float(epsilon), "privacy_spec": spec,
                  "run_id": run_id, **(extra or {})}
        runs[key] = record
        write_json_atomic(output_dir, SPENT_NAME, {"format": 2, "runs": runs, **record})


def read_spent_runs(output_dir: str) -> dict[str, dict]:
    """Every run's record of steps taken in ``output_dir`` (``{run id: record}``), either format."""
    try:
        with open(os.path.join(output_dir, SPENT_NAME)) as f:
            spent = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(spent, dict):
        return {}
    if isinstance(spent.get("runs"), dict):
        return {k: v for k, v in spent["runs"].items() if isinstance(v, dict) and "steps" in v}
    if "steps" in spent and "epsilon" in spent:  # the single-record format (hf_dp <= 0.x): one run
        return {spent.get("run_id") or "unknown": {k: v for k, v in spent.items() if k != "format"}}
    return {}


def steps_already_taken(checkpoint: str, output_dir: str, marker: dict) -> int:
    """The most noisy steps the run of ``checkpoint`` is known to have taken: its records of steps taken (in
    ``output_dir`` and in the checkpoint's own parent folder) and the markers of its sibling checkpoints, counted
    when they belong to the same run (``run_id``; without one, the same mechanism)."""
    run_id, spec, data = marker.get("run_id"), marker.get("privacy_spec"), marker.get("train_data")

    def same_run(info: dict | None) -> bool:
        if not info:
            return False
        if run_id is not None and info.get("run_id") is not None:
            return info.get("run_id") == run_id
        return same_mechanism(info.get("privacy_spec"), spec)

    taken = int(marker.get("ledger_steps") or 0)
    parent = os.path.dirname(os.path.abspath(checkpoint))
    for folder in {os.path.abspath(output_dir), parent}:
        for rec in read_spent_runs(folder).values():
            if same_run(rec):
                taken = max(taken, int(rec["steps"]))
    for sibling in list_checkpoints(parent):
        m = read_marker(sibling)
        if m and same_run(m) and (data is None or m.get("train_data") in (None, data)):
            taken = max(taken, int(m.get("ledger_steps") or 0))
    return taken


def read_spent(output_dir: str, run_id: str | None = None) -> dict | None:
    """The record of run ``run_id`` in ``output_dir`` (default: the record written last), or ``None``."""
    if run_id is not None:
        return read_spent_runs(output_dir).get(run_id)
    try:
        with open(os.path.join(output_dir, SPENT_NAME)) as f:
            spent = json.load(f)
    except (OSError, ValueError):
        return None
    return spent if isinstance(spent, dict) and "steps" in spent and "epsilon" in spent else None


# ---------------------------------------------------------------------------------------------------
# forks: the runs resumed from a checkpoint
# ---------------------------------------------------------------------------------------------------
def _resume_record_name(run_id: str) -> str:
    return f"{RESUME_PREFIX}{run_id}.json"


def write_resume_record(checkpoint: str, record: dict) -> bool:
    """Record (atomically, one file per run: concurrent forks never race) that run ``record["run_id"]`` resumed from
    ``checkpoint`` (or from a checkpoint descended from it): its ``output_dir``, ``start_steps`` (its ledger right
    after the resume) and ``steps`` (its ledger now). Never creates the folder (a rotated-away checkpoint stays
    gone); ``False`` if it could not be written."""
    if not os.path.isdir(checkpoint):
        return False
    try:
        before = os.stat(checkpoint)
        write_json_atomic(checkpoint, _resume_record_name(record["run_id"]), record)
        # the folder keeps its times: HF rotates checkpoints by mtime, and this record is not a newer checkpoint
        os.utime(checkpoint, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError:
        return False
    return True


def read_resume_records(checkpoint: str) -> list[dict]:
    """The runs recorded as resumed from ``checkpoint`` (:func:`write_resume_record`)."""
    out = []
    try:
        names = sorted(os.listdir(checkpoint))
    except OSError:
        return out
    for name in names:
        if not (name.startswith(RESUME_PREFIX) and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(checkpoint, name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("run_id") and "start_steps" in rec:
            out.append(rec)
    return out


def other_resumes(checkpoint: str, exclude: set[str]) -> list[dict]:
    """Runs (not in ``exclude``) that resumed from ``checkpoint`` or from a checkpoint descended from it, each with
    the noisy steps it took after its own resume: ``{"run_id", "steps"}``, its step count the largest of its record
    in the checkpoint and its record of steps taken in its ``output_dir``."""
    out = []
    for rec in read_resume_records(checkpoint):
        if rec["run_id"] in exclude:
            continue
        steps = int(rec.get("steps") or 0)
        if rec.get("output_dir"):
            spent = read_spent(rec["output_dir"], rec["run_id"])
            if spent:
                steps = max(steps, int(spent.get("steps") or 0))
        own = max(0, steps - int(rec.get("start_steps") or 0))
        if own:
            out.append({"run_id": rec["run_id"], "steps": own})
    return out


def other_runs_checkpoints(output_dir: str, own_runs: set[str]) -> list[tuple[str, dict]]:
    """Checkpoints of DP runs not in ``own_runs`` in ``output_dir`` (newest first): ``[(path, marker)]``."""
    found = []
    for path in list_checkpoints(output_dir):
        marker = read_marker(path)
        if not marker or marker.get("differential_privacy") is False:
            continue
        if marker.get("run_id") is None or marker.get("run_id") not in own_runs:
            found.append((path, marker))
    return found


def refuse_other_runs_checkpoints(args, own_runs: set) -> None:
    """A fresh run (not a resume) refuses to train into an ``output_dir`` holding checkpoints of DP runs not in
    ``own_runs`` (this run and its ancestry), which it would overwrite (:func:`hf_dp.run.lineage.before_train`)."""
    found = other_runs_checkpoints(args.output_dir, own_runs)
    import torch.distributed as dist

    if args.world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch  # every rank refuses, or none (a folder only rank 0 sees)

        flag = torch.tensor([1 if found else 0], dtype=torch.long, device=args.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not found:
            raise ValueError(f"refusing to train: {args.output_dir} holds another run's checkpoints (seen by rank "
                             "0); train into another output_dir, resume that run, or move its checkpoints away")
    if not found:
        return
    path, marker = found[0]
    run = marker.get("run_id")
    rec = read_spent(args.output_dir, run) if run else None
    steps = max(int(marker.get("ledger_steps") or 0), int((rec or {}).get("steps") or 0))
    eps = (rec or {}).get("epsilon") if rec and int(rec.get("steps") or 0) == steps else marker.get("epsilon")
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise ValueError(
        f"refusing to train: {args.output_dir} holds {os.path.basename(path)}{more} of another run "
        f"(run {run or 'of an earlier hf_dp'}, {steps} noisy steps" + (f", epsilon {float(eps):.4g}" if eps is not None else "")
        + "), whose checkpoints a new run would overwrite; train into another output_dir, resume that run "
        "(train(resume_from_checkpoint=True)), or move its checkpoints away"
    )


def _choose_stream_tag(ledger, args, checkpoint: str, own_id: str | None, clean: bool, recorded: bool = True) -> None:
    """The seeded streams' tag of a resumed run (``ledger.meta["stream_tag"]``; :mod:`hf_dp.privacy.randomness`).

    Under ``--dp_seed`` the noise and the Poisson draws are keyed by the ledger step. A **clean continuation** —
    nothing computed past ``checkpoint`` by any run (``clean``: no step counted past it) and no other resume of it
    recorded — keeps the checkpoint's tag, so it draws what its run would have drawn. Any other resume starts a branch
    of its own: tagged with its run id and start step, never another run's, so two resumes from checkpoints of one run
    (e.g. checkpoint-2 after its run took 2 more steps, and checkpoint-4) never draw the same noise or batches at the
    same ledger step (identical noise in two released models would cancel in their difference). This run's own resume
    record is written before the check, so of two concurrent resumes at least the later one sees the other; a resume
    whose record could not be written into ``checkpoint`` (``recorded`` False: a read-only folder) is invisible to the
    next one, so it is never a clean continuation either."""
    if clean:
        clean = recorded and not [r for r in read_resume_records(checkpoint) if r["run_id"] != own_id]
    import torch.distributed as dist

    if args.world_size > 1 and dist.is_available() and dist.is_initialized():
        import torch  # every rank keys its streams alike (only rank 0 may see the records)

        t = torch.tensor([1 if clean else 0], dtype=torch.long, device=args.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        clean = bool(t.item())
    if not clean:
        ledger.meta["stream_tag"] = f"{own_id if own_id is not None else secrets.token_hex(8)}@{ledger.steps}"


def _training_data(dp):
    """The training set as given to the trainer (before any caching), if it is still in memory."""
    data = getattr(dp.lineage, "data", None)
    return data.dataset() if data is not None else None


def reconcile_resumed_ledger(dp, args, checkpoint: str, taken_here: int, global_step: int, data_info, epsilon) -> None:
    """After ``DPTrainer`` loaded ``checkpoint``'s optimizer state (and with it the ledger ``dp.ledger``) at HF's
    ``global_step``: refuse a checkpoint whose ledger does not match its marker or whose training data differ
    (``data_info()``: N and the fingerprint of the data now, ``DPTrainer._train_data_info``), put back into the
    ledger the steps taken past the checkpoint (by this trainer: ``taken_here``, or by an interrupted
    run, as recorded by :func:`write_spent`), and refuse to resume when one more step would exceed the
    target ε (``epsilon()``: ε as ``DPTrainer.get_epsilon`` reports it, for the messages)."""
    marker = read_marker(checkpoint) or {}
    steps, recorded = dp.ledger.steps, marker.get("ledger_steps", global_step)
    if steps != recorded or steps < global_step:
        raise ValueError(
            f"refusing to resume from {checkpoint}: its privacy ledger records {steps} noisy steps but the "
            f"checkpoint is at global step {global_step} (marker: {recorded} ledger steps); was "
            "optimizer.pt saved (save_only_model must be False)?"
        )
    saved_data = marker.get("train_data")
    if saved_data is not None and not matches_training_data(saved_data, data_info(), _training_data(dp)):
        raise ValueError(
            f"refusing to resume from {checkpoint}: the training data differ from the data it was trained on "
            f"(checkpoint: {saved_data.get('num_samples')} examples, fingerprint {str(saved_data.get('sha256'))[:12]}…; "
            f"now: {data_info()['num_samples']} examples, fingerprint "
            f"{data_info()['sha256'][:12]}…). Resume with the same training set or start a new run."
        )
    trained, asked = marker.get("lm_loss_weighting", "sequence"), getattr(args, "lm_loss_weighting", "sequence")
    if trained != asked:  # markers written before the flag: every run was sequence-weighted
        raise ValueError(
            f"refusing to resume from {checkpoint}: it was trained with --lm_loss_weighting {trained} and this run asks "
            f"for {asked} (recipes/clm.py's default became token); resume with --lm_loss_weighting {trained} or start "
            "a new run")
    dp.lineage.resumed_ledger_steps = steps
    # Steps taken past this checkpoint (by an interrupted run, as recorded in output_dir, or by this
    # trainer) were computed with randomness that is gone; the steps resumed now draw fresh batches
    # and noise, so those steps are a release of their own: they stay in the ledger.
    # A resume is a new run whose parent is the checkpoint's run at its step: the lineage's ledger counts,
    # conservatively, every noisy step computed from this checkpoint — its own, those its run took past it, and
    # those of every other run resumed from it (or from a checkpoint descended from it) past their own resumes.
    own_id = dp.run_id
    parent_run = marker.get("run_id")
    past = max(steps, taken_here, steps_already_taken(checkpoint, args.output_dir, marker)) - steps
    forks = other_resumes(checkpoint, exclude={own_id, parent_run} - {None})
    taken = steps + past + sum(f["steps"] for f in forks)
    import torch.distributed as dist

    if args.world_size > 1 and dist.is_available() and dist.is_initialized():
        # every rank's ledger must agree, also where only rank 0's output_dir holds the record
        import torch

        t = torch.tensor([taken], dtype=torch.long, device=args.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        taken = int(t.item())
    if taken > steps:
        dp.ledger.add_steps(taken - steps)
    if past > 0:
        logger.warning(
            "hf_dp: resuming from %s (%d noisy steps), but %d steps were already taken past it; they count "
            "toward epsilon (now %.4g), and the resumed steps draw fresh batches and noise",
            checkpoint, steps, past, epsilon(),
        )
    if forks:
        logger.warning(
            "hf_dp: %s was already resumed by %d other run(s) (%s); the steps they took from it count in this run's "
            "ledger (epsilon now %.4g before this run's own steps): this run's epsilon is that of releasing every model "
            "trained from this checkpoint, this one included",
            checkpoint, len(forks), ", ".join(f"run {f['run_id']}: {f['steps']} steps" for f in forks), epsilon(),
        )
    meta = dp.ledger.meta
    ancestry = [dict(a) for a in meta.get("ancestry") or []]
    ancestry.append({"run_id": parent_run, "global_step": int(marker.get("global_step", global_step)),
                     "checkpoint": os.path.abspath(checkpoint)})
    meta.update(
        run_id=own_id, parent={"run_id": parent_run, "global_step": ancestry[-1]["global_step"]}, ancestry=ancestry,
        counted_past_parent={"parent_run_steps": past, "other_resumes": forks},
    )
    dp.lineage.resume_start = taken  # this run's steps past its resume: its ledger minus this (lineage.record_spent)
    own_record_written = not args.should_save  # the saving process writes the records (the others: its view counts)
    if args.should_save and own_id is not None:
        record = {"run_id": own_id, "output_dir": os.path.abspath(args.output_dir), "start_steps": taken,
                  "steps": taken, "parent": meta["parent"]}
        unwritable = [a["checkpoint"] for a in ancestry if os.path.isdir(a["checkpoint"]) and not write_resume_record(a["checkpoint"], record)]
        own_record_written = os.path.abspath(checkpoint) not in unwritable
        if unwritable:
            logger.warning(
                "hf_dp: could not record this resume in %s (not writable): a later resume from it will not count the "
                "steps of this run", ", ".join(unwritable),
            )
    _choose_stream_tag(dp.ledger, args, checkpoint, own_id, clean=past == 0 and taken == steps, recorded=own_record_written)
    opt = dp.optimizer
    if opt is not None and opt.max_epsilon is not None and opt._would_exceed_budget():
        raise ValueError(
            f"refusing to resume from {checkpoint}: {dp.ledger.steps} noisy steps were already taken "
            f"(epsilon {epsilon():.4g}); one more would exceed the target epsilon={opt.max_epsilon}"
        )


def check_step_complete(dp) -> None:
    """Before HF's optimizer step (``BudgetGuard.on_pre_optimizer_step``): the step took all ``m`` micro-batches of
    its logical draw (:func:`hf_dp.run.step.check_drawn_by` saw them in order). A loader wrapper that leaves out a draw's last
    micro-batches (e.g. at an epoch's end) would otherwise step on a part of the draw: refused in one sentence."""
    acc, m = dp.contract.accumulating, int(getattr(dp.sampler, "micro_batches", 1) or 1)
    if acc is not None and acc[1] != m:
        raise RuntimeError(
            f"an optimizer step would be taken after {acc[1]} of the {m} micro-batches of logical draw {acc[0]} (a "
            "loader wrapper left out micro-batches, or its length differs from the Poisson loader's): each optimizer "
            "step must take every micro-batch of one Poisson draw; pass DPTrainer's loader's batches on unchanged, each once")


class BudgetGuard(TrainerCallback):
    """Stops training (as HF's own stop) once the next step would exceed the target ε — e.g. after a
    resume that counted steps an interrupted run took past its checkpoint. Every step taken is on record
    (:func:`write_spent`, through ``DPTrainer._record_spent``) at its end, before anything it produced is written.
    At every epoch's start it drops a logical batch that an epoch stop cut between its micro-batches (a callback's
    ``should_epoch_stop``: HF leaves the epoch before the optimizer step): the next epoch draws anew at the same ledger
    step — with a seed or the ranks' shared key of the ``train()``, the same draw — so the cut micro-batches' clipped
    sums would put their examples into one noisy step twice (and the loader contract's step in progress is forgotten:
    :func:`hf_dp.run.step.check_drawn_by`). ``dp``: the run's privacy state; ``record_spent``: the
    trainer's ``DPTrainer._record_spent``."""

    def __init__(self, dp, record_spent):
        self.dp, self.record_spent = dp, record_spent

    def on_epoch_begin(self, args, state, control, **kwargs):
        opt = self.dp.optimizer
        if opt is not None:
            opt.discard_pending()
        self.dp.engine.clear()
        self.dp.contract.accumulating = None  # the cut draw is gone: the epoch's first step starts a new one
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if args.dp_enabled:  # every micro-batch of the step's Poisson draw was trained on (hf_dp.run.step)
            check_step_complete(self.dp)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        # every step taken is on record before any output of it is written; ε only if already known (an accountant
        # call per step costs 0.1-0.5 s with PRV; saves and logs compute it)
        self.record_spent(compute_epsilon=False)
        opt = self.dp.optimizer
        if opt is not None and opt.max_epsilon is not None and state.global_step < state.max_steps and opt._would_exceed_budget():
            logger.warning(
                "hf_dp: stopping at step %d: one more step would spend more than the target epsilon=%s",
                state.global_step, opt.max_epsilon,
            )
            control.should_training_stop = True
        return control
