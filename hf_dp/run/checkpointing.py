"""Crash-safe checkpoints: a completion marker, and resuming only from complete checkpoints.

``transformers.Trainer._save_checkpoint`` (5.x) writes straight into ``checkpoint-N/`` — model,
``optimizer.pt`` (which carries our privacy ledger), scheduler, RNG state, ``trainer_state.json``
last — with no atomic rename, and ``get_last_checkpoint`` returns the highest-numbered folder even
if the process was killed half-way through writing it. Resuming from such a folder could load a
new model with an old (or missing) ledger, i.e. under-report ε, or crash.

hf_dp therefore writes a **completion marker** ``hf_dp_checkpoint.json`` into the folder after HF
has written everything and *before* older checkpoints are rotated away (so at every instant at
least one complete checkpoint exists). The marker is written atomically (temp file, fsync,
``os.replace``, fsync of the folder) and records the global step, the ledger's step count and ε,
the :class:`~hf_dp.privacy.accounting.PrivacySpec`, and the size and SHA-256 of every file of the
checkpoint. A checkpoint is *complete* iff its marker exists, parses, and every listed file is
present with that size (and hash, when verified deeply).

``DPTrainer.train(resume_from_checkpoint=True)`` resumes from the newest complete checkpoint
(:func:`find_last_complete_checkpoint`; incomplete ones are skipped with a warning);
``resume_from_checkpoint="path"`` refuses a folder without a valid marker
(:func:`verify_marker` raises :class:`IncompleteCheckpointError`).

**Runs and forks.** ``hf_dp_epsilon_spent.json`` keeps every run's record of steps taken, keyed by run id
(:func:`write_spent`). A resume is a new run whose parent is the checkpoint's run and step; it records itself in the
checkpoint folder and in the checkpoints that one descends from (``hf_dp_resumed_by-<run id>.json``, written after the
marker and not listed in it, the folder's mtime kept for HF's rotation), and :func:`reconcile_resumed_ledger` counts,
conservatively, every noisy step computed from the checkpoint: its own, its run's past it, and each earlier resume's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

MARKER_NAME = "hf_dp_checkpoint.json"
MARKER_FORMAT = 1
#: ``hf_dp_resumed_by-<run id>.json``: one file per run resumed from the checkpoint (written after the marker, not
#: listed in it); see :func:`write_resume_record`
RESUME_PREFIX = "hf_dp_resumed_by-"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_HASH_CHUNK = 1 << 20


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder without a valid completion marker (e.g. the process died while writing it)."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _list_files(folder: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel == MARKER_NAME or name.startswith(".hf_dp_tmp") or name.startswith(RESUME_PREFIX):
                continue
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _umask_mode() -> int:
    """0666 minus the process umask: the mode an ordinary ``open(..., "w")`` gives (``mkstemp`` gives 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def apply_umask(folder: str, patterns) -> None:
    """Give the files of ``folder`` matching ``patterns`` that are readable by their owner only (0600, as some
    writers create them) the mode the user's umask gives an ordinary file."""
    import fnmatch

    mode = _umask_mode()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and any(fnmatch.fnmatch(name, p) for p in patterns) and os.stat(path).st_mode & 0o077 == 0:
            os.chmod(path, mode)


def remove_marker(folder: str) -> None:
    """Delete a stale marker before a checkpoint folder is (re)written."""
    path = os.path.join(folder, MARKER_NAME)
    if os.path.exists(path):
        os.remove(path)
        _fsync_dir(folder)


def write_marker(folder: str, info: dict[str, Any] | None = None, hash_files: bool = True) -> dict:
    """Atomically write the completion marker of ``folder`` (call it after every file is written).

    ``info`` (global step, ε, ledger steps, privacy spec, …) is stored as is. Every other file in
    the folder is listed with its size and (``hash_files``) SHA-256; each is fsync'ed first so the
    marker never describes data that is not on disk.
    """
    files = {}
    for rel in _list_files(folder):
        path = os.path.join(folder, rel)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        entry: dict[str, Any] = {"size": os.path.getsize(path)}
        if hash_files:
            entry["sha256"] = _sha256(path)
        files[rel] = entry
    for root, _dirs, _files in os.walk(folder):
        _fsync_dir(root)
    marker = {"format": MARKER_FORMAT, "complete": True, **(info or {}), "files": files}
    _write_json_atomic(folder, MARKER_NAME, marker, indent=2, fsync=True)
    _fsync_dir(folder)
    return marker


def read_marker(folder: str) -> dict | None:
    """The parsed marker of ``folder``, or ``None`` if it is missing or unreadable."""
    try:
        with open(os.path.join(folder, MARKER_NAME)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def checkpoint_problem(folder: str, deep: bool = True) -> str | None:
    """Why ``folder`` is not a complete hf_dp checkpoint (``None`` if it is)."""
    if not os.path.isdir(folder):
        return "it is not a directory"
    marker = read_marker(folder)
    if marker is None:
        if os.path.exists(os.path.join(folder, MARKER_NAME)):
            return f"its {MARKER_NAME} is unreadable"
        return f"it has no {MARKER_NAME} completion marker (the run was interrupted while writing it, or it was not written by hf_dp)"
    if marker.get("format") != MARKER_FORMAT or not marker.get("complete") or not isinstance(marker.get("files"), dict):
        return f"its {MARKER_NAME} is not a valid marker (format {marker.get('format')!r})"
    for rel, entry in marker["files"].items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} listed in the marker is missing"
        if os.path.getsize(path) != entry.get("size"):
            return f"{rel} has {os.path.getsize(path)} bytes, the marker recorded {entry.get('size')}"
        if deep and "sha256" in entry and _sha256(path) != entry["sha256"]:
            return f"{rel} does not match the SHA-256 recorded in the marker"
    return None


def verify_marker(folder: str, deep: bool = True) -> dict:
    """The marker of a complete checkpoint; raises :class:`IncompleteCheckpointError` otherwise."""
    problem = checkpoint_problem(folder, deep=deep)
    if problem is not None:
        raise IncompleteCheckpointError(
            f"refusing to resume from {folder}: it is not a complete hf_dp checkpoint ({problem}); "
            "resume from an earlier checkpoint, or pass resume_from_checkpoint=True to pick the newest complete one"
        )
    return read_marker(folder)


def list_checkpoints(output_dir: str) -> list[str]:
    """``checkpoint-N`` folders of ``output_dir``, newest (highest N) first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _CHECKPOINT_RE.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found, reverse=True)]


def find_last_complete_checkpoint(output_dir: str, deep: bool = True) -> str | None:
    """The newest ``checkpoint-N`` with a valid marker; incomplete newer ones are skipped with a warning."""
    for path in list_checkpoints(output_dir):
        problem = checkpoint_problem(path, deep=deep)
        if problem is None:
            return path
        logger.warning("hf_dp: ignoring incomplete checkpoint %s: %s", path, problem)
    return None


def resolve_resume_checkpoint(resume_from_checkpoint, output_dir: str):
    """Map ``Trainer.train``'s ``resume_from_checkpoint`` to a complete checkpoint folder (or ``None``).

    ``True``: the newest complete checkpoint in ``output_dir`` (error if there is none);
    a path: verified, :class:`IncompleteCheckpointError` if it has no valid marker.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        path = find_last_complete_checkpoint(output_dir)
        if path is None:
            existing = list_checkpoints(output_dir)
            detail = f" ({len(existing)} incomplete checkpoint folder(s) ignored)" if existing else ""
            raise ValueError(f"No complete hf_dp checkpoint found in output directory ({output_dir}){detail}")
        return path
    path = os.fspath(resume_from_checkpoint)
    verify_marker(path)
    return path


# ---------------------------------------------------------------------------------------------------
# the training data a checkpoint was trained on
# ---------------------------------------------------------------------------------------------------
def dataset_fingerprint(dataset) -> str:
    """SHA-256 of a training set's content, to refuse resuming on other data of the same size.

    A ``datasets.Dataset`` is hashed as the Arrow IPC stream of its rows (indices applied), any other
    sized dataset row by row (tensors and arrays by dtype, shape and bytes). The hash is a function of
    the private data: it is written only into checkpoint markers, which are not a release (never pushed).
    """
    h = hashlib.sha256()
    try:
        import datasets
        import pyarrow as pa
    except ImportError:  # pragma: no cover - both are dependencies
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        table = dataset.with_format("arrow")[0 : len(dataset)] if len(dataset) else dataset.data.table.slice(0, 0)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        h.update(b"arrow:")
        h.update(sink.getvalue())
        return h.hexdigest()
    h.update(b"rows:")
    for i in range(len(dataset)):
        _update_hash(h, dataset[i])
    return h.hexdigest()


def _update_hash(h, obj) -> None:
    import numpy as np
    import torch

    if isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(repr(k).encode())
            _update_hash(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _update_hash(h, v)
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"A{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


# ---------------------------------------------------------------------------------------------------
# ε already spent by an interrupted run
# ---------------------------------------------------------------------------------------------------
SPENT_NAME = "hf_dp_epsilon_spent.json"


MECHANISM_FIELDS = ("noise_multiplier", "max_grad_norm", "sample_rate", "expected_batch_size", "dataset_size", "delta", "accountant")


def same_mechanism(a: dict | None, b: dict | None) -> bool:
    """The two privacy specs describe the same mechanism (σ, C, q, B, N, δ, accountant; not the planned steps or target)."""
    from hf_dp.privacy.accounting import _same

    return bool(a) and bool(b) and all(_same(a.get(k), b.get(k)) for k in MECHANISM_FIELDS)


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


def _write_json_atomic(folder: str, name: str, payload: dict, indent: int | None = None, fsync: bool = False) -> None:
    """``folder/name`` replaced atomically (temp file, ``os.replace``) by ``payload`` as JSON, with the umask's mode;
    ``fsync``: the data is on disk before the rename."""
    fd, tmp = tempfile.mkstemp(prefix=".hf_dp_tmp", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=indent, sort_keys=True, default=str)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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
        _write_json_atomic(output_dir, SPENT_NAME, {"format": 2, "runs": runs, **record})


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
        _write_json_atomic(checkpoint, _resume_record_name(record["run_id"]), record)
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


def _choose_stream_tag(trainer, checkpoint: str, own_id: str | None, clean: bool, recorded: bool = True) -> None:
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
    ledger = trainer.ledger
    if clean:
        clean = recorded and not [r for r in read_resume_records(checkpoint) if r["run_id"] != own_id]
    import torch.distributed as dist

    if trainer.args.world_size > 1 and dist.is_available() and dist.is_initialized():
        import torch  # every rank keys its streams alike (only rank 0 may see the records)

        t = torch.tensor([1 if clean else 0], dtype=torch.long, device=trainer.args.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        clean = bool(t.item())
    if not clean:
        ledger.meta["stream_tag"] = f"{own_id if own_id is not None else secrets.token_hex(8)}@{ledger.steps}"


def reconcile_resumed_ledger(trainer, checkpoint: str, taken_here: int) -> None:
    """After ``DPTrainer`` loaded ``checkpoint``'s optimizer state (and with it the ledger): refuse a
    checkpoint whose ledger does not match its marker or whose training data differ, put back into the
    ledger the steps taken past the checkpoint (by this trainer: ``taken_here``, or by an interrupted
    run, as recorded by :func:`write_spent`), and refuse to resume when one more step would exceed the
    target ε. ``trainer`` is the ``DPTrainer`` (duck-typed)."""
    marker = read_marker(checkpoint) or {}
    steps, recorded = trainer.ledger.steps, marker.get("ledger_steps", trainer.state.global_step)
    if steps != recorded or steps < trainer.state.global_step:
        raise ValueError(
            f"refusing to resume from {checkpoint}: its privacy ledger records {steps} noisy steps but the "
            f"checkpoint is at global step {trainer.state.global_step} (marker: {recorded} ledger steps); was "
            "optimizer.pt saved (save_only_model must be False)?"
        )
    saved_data = marker.get("train_data")
    if saved_data is not None and saved_data != trainer._train_data_info():
        raise ValueError(
            f"refusing to resume from {checkpoint}: the training data differ from the data it was trained on "
            f"(checkpoint: {saved_data.get('num_samples')} examples, fingerprint {str(saved_data.get('sha256'))[:12]}…; "
            f"now: {trainer._train_data_info()['num_samples']} examples, fingerprint "
            f"{trainer._train_data_info()['sha256'][:12]}…). Resume with the same training set or start a new run."
        )
    trainer.resumed_ledger_steps = steps
    # Steps taken past this checkpoint (by an interrupted run, as recorded in output_dir, or by this
    # trainer) were computed with randomness that is gone; the steps resumed now draw fresh batches
    # and noise, so those steps are a release of their own: they stay in the ledger.
    # A resume is a new run whose parent is the checkpoint's run at its step: the lineage's ledger counts,
    # conservatively, every noisy step computed from this checkpoint — its own, those its run took past it, and
    # those of every other run resumed from it (or from a checkpoint descended from it) past their own resumes.
    own_id = getattr(trainer, "run_id", None)
    parent_run = marker.get("run_id")
    past = max(steps, taken_here, steps_already_taken(checkpoint, trainer.args.output_dir, marker)) - steps
    forks = other_resumes(checkpoint, exclude={own_id, parent_run} - {None})
    taken = steps + past + sum(f["steps"] for f in forks)
    import torch.distributed as dist

    if trainer.args.world_size > 1 and dist.is_available() and dist.is_initialized():
        # every rank's ledger must agree, also where only rank 0's output_dir holds the record
        import torch

        t = torch.tensor([taken], dtype=torch.long, device=trainer.args.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        taken = int(t.item())
    if taken > steps:
        trainer.ledger.add_steps(taken - steps)
    if past > 0:
        logger.warning(
            "hf_dp: resuming from %s (%d noisy steps), but %d steps were already taken past it; they count "
            "toward epsilon (now %.4g), and the resumed steps draw fresh batches and noise",
            checkpoint, steps, past, trainer.get_epsilon(),
        )
    if forks:
        logger.warning(
            "hf_dp: %s was already resumed by %d other run(s) (%s); the steps they took from it count in this run's "
            "ledger (epsilon now %.4g before this run's own steps): this run's epsilon is that of releasing every model "
            "trained from this checkpoint, this one included",
            checkpoint, len(forks), ", ".join(f"run {f['run_id']}: {f['steps']} steps" for f in forks), trainer.get_epsilon(),
        )
    meta = trainer.ledger.meta
    ancestry = [dict(a) for a in meta.get("ancestry") or []]
    ancestry.append({"run_id": parent_run, "global_step": int(marker.get("global_step", trainer.state.global_step)),
                     "checkpoint": os.path.abspath(checkpoint)})
    meta.update(
        run_id=own_id, parent={"run_id": parent_run, "global_step": ancestry[-1]["global_step"]}, ancestry=ancestry,
        counted_past_parent={"parent_run_steps": past, "other_resumes": forks},
    )
    trainer._hf_dp_resume_start = taken  # this run's steps past its resume: its ledger minus this (lineage.record_spent)
    own_record_written = not trainer.args.should_save  # the saving process writes the records (the others: its view counts)
    if trainer.args.should_save and own_id is not None:
        record = {"run_id": own_id, "output_dir": os.path.abspath(trainer.args.output_dir), "start_steps": taken,
                  "steps": taken, "parent": meta["parent"]}
        unwritable = [a["checkpoint"] for a in ancestry if os.path.isdir(a["checkpoint"]) and not write_resume_record(a["checkpoint"], record)]
        own_record_written = os.path.abspath(checkpoint) not in unwritable
        if unwritable:
            logger.warning(
                "hf_dp: could not record this resume in %s (not writable): a later resume from it will not count the "
                "steps of this run", ", ".join(unwritable),
            )
    _choose_stream_tag(trainer, checkpoint, own_id, clean=past == 0 and taken == steps, recorded=own_record_written)
    opt = trainer._dp_optimizer
    if opt is not None and opt.max_epsilon is not None and opt._would_exceed_budget():
        raise ValueError(
            f"refusing to resume from {checkpoint}: {trainer.ledger.steps} noisy steps were already taken "
            f"(epsilon {trainer.get_epsilon():.4g}); one more would exceed the target epsilon={opt.max_epsilon}"
        )
