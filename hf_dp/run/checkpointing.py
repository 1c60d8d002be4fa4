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

What each run has spent, the forks of a checkpoint (the runs resumed from it) and the ledger of a resumed run are
in :mod:`hf_dp.run.spent`; the checkpoint a ``DPTrainer`` writes around HF's own (:func:`save_around`, its marker's
facts: :func:`checkpoint_info`) is here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

MARKER_NAME = "hf_dp_checkpoint.json"
MARKER_FORMAT = 1
#: ``hf_dp_resumed_by-<run id>.json``: one file per run resumed from the checkpoint (written after the marker, not
#: listed in it); see :func:`hf_dp.run.spent.write_resume_record`
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
    write_json_atomic(folder, MARKER_NAME, marker, indent=2, fsync=True)
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
# the checkpoint a DPTrainer writes
# ---------------------------------------------------------------------------------------------------
def checkpoint_info(dp, args, global_step: int, data_info, epsilon, fsdp: bool = False) -> dict:
    """The public facts a ``DPTrainer`` checkpoint's marker records: hf_dp's version, the global step, and under DP the
    ledger's steps and ε (``epsilon()``, as ``DPTrainer.get_epsilon`` reports it), the privacy spec, the training
    data's size and fingerprint (``data_info()``: never pushed, a checkpoint is not a release) and the run id; under
    FSDP (``fsdp``: HF's ``is_fsdp_enabled``) the number of processes it resumes with."""
    from hf_dp import __version__

    info = {"hf_dp_version": __version__, "global_step": global_step, "differential_privacy": args.dp_enabled}
    if fsdp:  # sharded: resumed under FSDP with as many processes (hf_dp.clipping.sharding)
        info["fsdp"] = {"world_size": args.world_size}
    if args.dp_enabled:
        info.update(
            ledger_steps=dp.ledger.steps, epsilon=epsilon(), privacy_spec=dp.spec.as_dict(),
            train_data=data_info(), run_id=dp.run_id, lm_loss_weighting=getattr(args, "lm_loss_weighting", "sequence"),
        )
    return info


@contextlib.contextmanager
def save_around(output_dir: str, dp, args, state, accelerator, record_spent, data_info, epsilon, fsdp: bool = False):
    """Around ``Trainer._save_checkpoint`` (``DPTrainer._save_checkpoint`` runs HF's inside, writing into ``output_dir``:
    HF's ``_get_output_dir(trial)``): the steps taken are on record first (``record_spent()``, the trainer's), a stale
    marker of the folder is removed, and HF's rotation of old checkpoints is deferred until the completion marker
    (:func:`checkpoint_info` of ``dp``, ``args``, HF's ``state``, ``data_info``, ``epsilon``, ``fsdp``) is on disk (HF
    writes ``checkpoint-N`` in place, then rotates), so a complete checkpoint exists at every instant; with several
    processes every rank's files are written first (``accelerator.wait_for_everyone``). While HF saves,
    ``dp.saving_checkpoint`` tells ``save_model`` it writes a checkpoint, not a release (whatever the folder's name).
    Yields the checkpoint folder."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    record_spent()
    if args.should_save and os.path.isdir(folder):
        remove_marker(folder)
    limit = args.save_total_limit
    args.save_total_limit = None
    dp.saving_checkpoint = True
    try:
        yield folder
    finally:
        args.save_total_limit = limit
        dp.saving_checkpoint = False
    if args.world_size > 1:
        accelerator.wait_for_everyone()  # every rank's files (rng_state_i.pth; FSDP: its shards) are written
    if args.should_save:
        write_marker(folder, checkpoint_info(dp, args, state.global_step, data_info, epsilon, fsdp))
        rotate_checkpoints(output_dir=output_dir, save_total_limit=limit,
                           best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)

# ---------------------------------------------------------------------------------------------------
# the training data a checkpoint was trained on
# ---------------------------------------------------------------------------------------------------
def dataset_fingerprint(dataset, legacy: bool = False) -> str:
    """SHA-256 of a training set's content, to refuse resuming on other data of the same size.

    A ``datasets.Dataset`` is hashed as its features (types and label names) and the Arrow IPC stream of its rows
    (indices applied) without the schema's metadata: 🤗 Datasets writes its own ``fingerprint`` there, which is random
    for a transform it cannot hash (TRL's DPO preparation gets a new one in every process), so the same rows must not
    hash apart. ``legacy``: the hash of checkpoint markers written before, the stream with that metadata (kept only to
    resume them: :func:`matches_training_data`). Under a transform or a column selection (``with_transform``,
    ``set_format(columns=...)``) the rows are hashed as the trainer reads them, with the format; any other sized
    dataset is hashed row by row too (tensors and arrays by dtype, shape and bytes). The hash is a function of the
    private data: it is written only into checkpoint markers, which are not a release (never pushed).
    """
    h = hashlib.sha256()
    try:
        import datasets
        import pyarrow as pa
    except ImportError:  # pragma: no cover - both are dependencies
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset) and not legacy and _reads_other_rows(dataset):
        h.update(b"format:")  # a transform or a column selection: what the trainer reads is the formatted rows
        h.update(json.dumps([dataset.format.get(k) for k in ("type", "columns", "output_all_columns")],
                            default=str).encode())
    elif datasets is not None and isinstance(dataset, datasets.Dataset):
        table = dataset.with_format("arrow")[0 : len(dataset)] if len(dataset) else dataset.data.table.slice(0, 0)
        table = table.combine_chunks()
        if not legacy:
            h.update(b"features:")
            h.update(json.dumps(dataset.features.to_dict(), sort_keys=True, default=str).encode())
            schema = pa.schema([field.remove_metadata() for field in table.schema])
            table = pa.Table.from_arrays(table.columns, schema=schema)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        h.update(b"arrow:")
        h.update(sink.getvalue())
        return h.hexdigest()
    h.update(b"rows:")
    for i in range(len(dataset)):
        _update_hash(h, dataset[i])
    return h.hexdigest()


def _reads_other_rows(dataset) -> bool:
    """Whether a 🤗 Datasets dataset's format gives its reader other rows than its Arrow table holds: a transform
    (``with_transform`` / ``set_transform``) or a selection of columns. Its fingerprint is then of the rows as read."""
    fmt = dataset.format
    columns = fmt.get("columns")
    narrowed = columns is not None and not fmt.get("output_all_columns") and set(columns) != set(dataset.column_names)
    return fmt.get("type") == "custom" or narrowed


def matches_training_data(saved: dict, now: dict, dataset) -> bool:
    """Whether a checkpoint marker's ``train_data`` (``saved``: N and the fingerprint) describes the training data
    ``now`` (the same, of ``dataset``): the fingerprint of :func:`dataset_fingerprint`, or for a marker written before
    it left 🤗 Datasets' metadata out, the earlier hash (``legacy``) of the same ``dataset``."""
    if saved == now:
        return True
    if dataset is None or saved.get("num_samples") != now.get("num_samples"):
        return False
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        return False
    if not isinstance(dataset, datasets.Dataset) or _reads_other_rows(dataset):
        return False  # hashed row by row: the earlier hash of the raw table does not describe what is read
    return saved.get("sha256") == dataset_fingerprint(dataset, legacy=True)


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
# the mechanism a checkpoint ran, and how its files are written
# ---------------------------------------------------------------------------------------------------
MECHANISM_FIELDS = ("noise_multiplier", "max_grad_norm", "sample_rate", "expected_batch_size", "dataset_size", "delta",
                    "accountant", "noise_mechanism", "noise_bands")
#: a spec written before hf_dp had correlated noise ran independent noise
SPEC_DEFAULTS = {"noise_mechanism": "independent", "noise_bands": 1}


def same_mechanism(a: dict | None, b: dict | None) -> bool:
    """The two privacy specs describe the same mechanism (σ, C, q, B, N, δ, accountant, the noise mechanism and its
    bands; not the planned steps or target)."""
    from hf_dp.privacy.accounting import _same

    get = lambda spec, k: spec.get(k, SPEC_DEFAULTS.get(k))  # noqa: E731
    return bool(a) and bool(b) and all(_same(get(a, k), get(b, k)) for k in MECHANISM_FIELDS)


def write_json_atomic(folder: str, name: str, payload: dict, indent: int | None = None, fsync: bool = False) -> None:
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
