"""What every recipe run does around its task: the privacy checks before any expensive work, the planner's batch,
``--resume_from_checkpoint``, the Hub push of the saved folder, the predictions file, and the
entry point that turns user errors (and hf_dp's own checks) into one ``error:`` line and exit code 2."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from .args import RecipeError, optim_name
from .summary import summary_block

# ----------------------------------------------------------------------------------------------- before the model


def resume_argument(training_args, sources: Iterable[tuple[str, Optional[str]]] = ()):
    """``--resume_from_checkpoint``: ``True``/``true`` = the newest complete checkpoint in output_dir (as HF), a path,
    or None. Refuses to start a fresh run over an output_dir whose checkpoints record privacy already spent.
    ``sources``: ``(flag, value)`` of what the run loads (``--model_name_or_path``, ``--config_name``,
    ``--tokenizer_name``); ``--overwrite_output_dir`` refuses, before deleting anything, when one lies inside
    output_dir (:func:`refuse_clearing_sources`)."""
    from hf_dp.run import checkpointing

    value = training_args.resume_from_checkpoint
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"):
        value = True
    elif isinstance(value, str) and value.strip().lower() in ("false", "0", "no", ""):
        value = None
    if getattr(training_args, "_hf_dp_overwrite_output_dir", False) and training_args.do_train:
        if value is not None:
            raise RecipeError("--overwrite_output_dir starts a new run (the earlier run's files in --output_dir are "
                              "deleted) and --resume_from_checkpoint continues one: pass one of the two")
        refuse_clearing_sources(training_args.output_dir, sources)
        with training_args.main_process_first(desc="clearing --output_dir"):
            if training_args.process_index == 0:
                clear_earlier_run(training_args.output_dir)
    if value is None and training_args.do_train and checkpointing.list_checkpoints(training_args.output_dir):
        raise RecipeError(
            f"--output_dir {training_args.output_dir} holds checkpoints of an earlier run (the privacy it spent is "
            "recorded there); pass --resume_from_checkpoint True to continue it, or choose another --output_dir"
        )
    if value is None and training_args.do_train and earlier_run_files(training_args.output_dir):
        raise RecipeError(
            f"--output_dir {training_args.output_dir} holds an earlier run ({', '.join(earlier_run_files(training_args.output_dir))}): "
            "a new run would replace its release; pass --overwrite_output_dir to delete it first, or choose another --output_dir"
        )
    return value


def earlier_run_files(output_dir: str) -> list[str]:
    """What an earlier run left in ``output_dir`` besides checkpoints: its release (``release/`` with a privacy.json)
    and hf_dp's records (``hf_dp_*``)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir) if n.startswith("hf_dp_")
                  or (n == RELEASE_SUBDIR and os.path.isfile(os.path.join(output_dir, n, "privacy.json"))))


def model_sources(model_args) -> list[tuple[str, Optional[str]]]:
    """The folders a recipe loads from (``--model_name_or_path``, ``--config_name``, ``--tokenizer_name``), for
    :func:`resume_argument`."""
    return [(f"--{name}", getattr(model_args, name, None)) for name in ("model_name_or_path", "config_name", "tokenizer_name")]


def refuse_clearing_sources(output_dir: str, sources: Iterable[tuple[str, Optional[str]]]) -> None:
    """``--overwrite_output_dir`` clears ``output_dir`` (:func:`clear_earlier_run`) before the model is loaded: a model,
    config or tokenizer folder inside it (e.g. the release of an earlier run, ``output_dir/release``) would be deleted
    before it is read, or the new run written into it. Refused in one sentence; a Hub id or a preset name (no such
    local path) is not a folder and passes."""
    out = os.path.realpath(output_dir)
    for flag, value in sources:
        if not value or not os.path.exists(value):
            continue
        path = os.path.realpath(value)
        if path == out or path.startswith(out.rstrip(os.sep) + os.sep):
            raise RecipeError(
                f"{flag} {value} lies inside --output_dir {output_dir}, which --overwrite_output_dir clears (the earlier "
                "run's checkpoints, records and release) before the model is loaded: copy the model out of that folder "
                "first, or choose another --output_dir")


def clear_earlier_run(output_dir: str) -> list[str]:
    """``--overwrite_output_dir`` (run_clm's flag, HF's meaning: overwrite the folder's content instead of resuming):
    delete what an earlier run left in ``output_dir`` — its ``checkpoint-*`` folders, hf_dp's records (``hf_dp_*``),
    ``training_args.bin`` and its release — and say so, with the ε those checkpoints recorded (a copy of that run's
    model made elsewhere still carries it). Files of other origin stay. Returns the names deleted."""
    import json
    import shutil

    from hf_dp.run import checkpointing

    if not os.path.isdir(output_dir):
        return []
    names = sorted(n for n in os.listdir(output_dir)
                   if re.fullmatch(r"checkpoint-\d+", n) or n.startswith("hf_dp_") or n == "training_args.bin"
                   or (n == RELEASE_SUBDIR and os.path.isfile(os.path.join(output_dir, n, "privacy.json"))))
    if not names:
        return []
    spent = None
    for path in checkpointing.list_checkpoints(output_dir):
        try:
            with open(os.path.join(path, "privacy.json")) as f:
                spent = json.load(f).get("epsilon")
            break
        except (OSError, ValueError):
            continue
    for name in names:
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    logging.getLogger("hf_dp.recipes").warning(
        "--overwrite_output_dir: deleted the earlier run's %s from %s%s; a new run starts", ", ".join(names), output_dir,
        f" (its last checkpoint had spent ε = {spent:.3g}: a copy of that model made elsewhere still counts it)"
        if isinstance(spent, (int, float)) else "")
    return names


def public_size(training_args, n: int) -> int:
    """The N a recipe plans and checks with: ``--public_dataset_size`` when declared (the actual count ``n`` is then
    private: no plan line, check or card names it), else ``n``, treated as public."""
    declared = getattr(training_args, "public_dataset_size", None)
    return int(declared) if declared is not None else int(n)


def check_privacy_settings(training_args, n_train: int) -> None:
    """The checks that need only N and the flags (δ < 1/N, B ≤ N, σ calibratable), before any expensive work; N is
    :func:`public_size` (``--public_dataset_size`` when declared)."""
    import math

    from hf_dp.privacy.accounting import calibrate_noise_multiplier, check_delta
    from hf_dp.privacy.banded import cyclic_rate
    from hf_dp.privacy.sampler import PoissonBatchSampler

    if not training_args.dp_enabled or not training_args.do_train:
        return
    if n_train <= 0:
        raise RecipeError("the training set is empty")
    n_train = public_size(training_args, n_train)
    # --audit_canaries m: DPTrainer samples N + m units (the canaries are units whether included or not)
    n_units = n_train + int(getattr(training_args, "audit_canaries", None) or 0)
    b = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * max(1, training_args.world_size)
    if b > n_units:
        raise RecipeError(
            f"the expected logical batch B = per_device_train_batch_size × gradient_accumulation_steps × world_size "
            f"= {b} is larger than the training set (N = {n_units}); Poisson sampling needs q = B/N ≤ 1"
        )
    check_delta(training_args.delta, n_train)
    q, bands = b / n_units, _bands(training_args)
    try:
        cyclic_rate(q, bands)  # --noise_bands b: cyclic Poisson sampling needs b·q ≤ 1
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    if training_args.epsilon is not None:
        steps = training_args.max_steps if training_args.max_steps > 0 else math.ceil(
            training_args.num_train_epochs * PoissonBatchSampler.steps_for_epoch(q))
        calibrate_noise_multiplier(training_args.epsilon, training_args.delta, q, steps, training_args.accountant,
                                   bands=bands)


def _bands(training_args) -> int:
    """The b of ``--noise_mechanism banded_sqrt --noise_bands b`` (1 for independent noise)."""
    if getattr(training_args, "noise_mechanism", "independent") == "independent":
        return 1
    return int(getattr(training_args, "noise_bands", 1) or 1)


def compute_budget(training_args, n_train: int) -> tuple[float, str]:
    """The run's compute budget in epochs for the planner, and how to name it: the epochs (``--num_train_epochs`` or
    the recipe's), or with ``--max_steps T`` the per-example gradients of T steps at the recipe's logical batch B₀
    (T·B₀ ≈ E·N: E = T / round(N/B₀), so that the plan at B₀ is exactly T steps)."""
    import math

    from hf_dp.plan import planned_steps
    from hf_dp.privacy.sampler import PoissonBatchSampler

    explicit = getattr(training_args, "_hf_dp_explicit", frozenset())
    n_train = public_size(training_args, n_train)
    steps = training_args.max_steps
    if steps is None or steps <= 0:
        epochs = float(training_args.num_train_epochs)
        given = "num_train_epochs" in explicit
        return epochs, f"--num_train_epochs {epochs:g}" if given else f"the recipe's {epochs:g} epoch(s)"
    b0 = min(n_train, training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
             * max(1, training_args.world_size))  # (B₀ > N is refused before: check_privacy_settings)
    epochs = steps / PoissonBatchSampler.steps_for_epoch(b0 / n_train)
    while planned_steps(n_train, b0, epochs) > steps:  # a float rounding up past T
        epochs = math.nextafter(epochs, 0.0)
    return epochs, f"--max_steps {steps} at the recipe's B = {b0}, i.e. {epochs:.4g} epoch(s)"


def apply_plan(training_args, model, n_train: int, planned_lr: dict[str, float]) -> Optional[str]:
    """When the user set neither the batch size nor the accumulation (:data:`~recipes.common.args.PLANNER_KEYS`): the
    planner's logical batch (hf_dp.plan.recommend) for the run's compute budget (:func:`compute_budget`: the epochs,
    given or the recipe's, or ``--max_steps``, which then becomes the plan's steps at the plan's batch), and
    ``planned_lr[optimizer]`` unless --learning_rate was given. Returns the lines to print; the first names the budget."""
    from .args import PLANNER_KEYS

    explicit = getattr(training_args, "_hf_dp_explicit", frozenset())
    if (not training_args.dp_enabled or training_args.epsilon is None or PLANNER_KEYS & explicit
            or not training_args.do_train):
        return None
    import copy

    from hf_dp.models import apply_trainable
    from hf_dp.plan import calibrated_for, recommend, split_batch

    probe = copy.deepcopy(model) if training_args.trainable == "lora" else model
    d = apply_trainable(probe, training_args.trainable)[1].num_trainable
    n_train = public_size(training_args, n_train)
    epochs, budget = compute_budget(training_args, n_train)
    # calibrating σ for every candidate can take ~20 s on a cold cache: say what is happening
    print(f"planner: calibrating σ for each candidate logical batch at {epochs:.4g} epoch(s), "
          f"N = {n_train:,}, d = {d:,} (public quantities only) ...", flush=True)
    try:
        plan = recommend(n_train, training_args.epsilon, training_args.delta, d, epochs=epochs,
                         accountant=training_args.accountant, bands=_bands(training_args))
    except ValueError as exc:  # e.g. N smaller than every candidate batch: keep the protocol's batch
        return f"planner: no recommendation ({exc}); keeping B = {training_args.per_device_train_batch_size}"
    world = max(1, training_args.world_size)
    per_device, accum = split_batch(plan.batch_size, world_size=world)
    training_args.per_device_train_batch_size = per_device
    training_args.gradient_accumulation_steps = accum
    if training_args.max_steps is not None and training_args.max_steps > 0:  # the same budget at the plan's batch
        training_args.max_steps = plan.choice.steps
        budget += f"; --max_steps {plan.choice.steps} at B = {plan.batch_size}"
    lines = [f"planner (no batch size given; compute budget {budget}): {plan.summary()}"]
    m = int(getattr(training_args, "audit_canaries", None) or 0)
    if m > 0:  # the canaries ride on top of the plan: q and the steps as planned, N = real units + m
        lines.append(canaries_on_top(training_args, n_train, m, plan.batch_size, plan.choice.steps, per_device, world))
    optim = optim_name(training_args.optim)
    if "learning_rate" not in explicit and optim in planned_lr:
        training_args.learning_rate = planned_lr[optim]
        lines.append(f"planner: learning rate {planned_lr[optim]:g} for {optim} at the planner's batch "
                     "(chosen on tune splits of training data, recipes/README.md; --learning_rate overrides)")
    lines += list(plan.warnings(calibrated=calibrated_for(model)))  # the expectation only where it was measured
    return "\n".join(lines)


def canaries_on_top(training_args, n_train: int, m: int, batch: int, steps: int, per_device: int, world: int) -> str:
    """``--audit_canaries m`` under the planner: the audit's m canary units join the N real ones (DPTrainer counts them:
    N + m units whatever the draw), so at the plan's batch B the real rows would get a smaller q = B/(N + m). Instead
    the logical batch grows to B' = ⌈q·(N + m)⌉ (rounded up to whole micro-batches) and the run takes the plan's steps:
    each real unit is drawn at about the planned rate q for the planned number of steps, as in the run without
    canaries, and the canaries add their expected share q·(#included) rows per step on top (their rows carry a zero
    model loss under --audit_kind gradient). σ is calibrated for ε at q' = B'/(N + m) ≥ q by DPTrainer, as for any
    run. Returns the line to print."""
    import math

    step = per_device * world
    grown = step * math.ceil(batch * (n_train + m) / n_train / step)
    training_args.gradient_accumulation_steps = grown // step
    training_args.max_steps = steps
    training_args._hf_dp_canaries_on_top = True  # the card's audit line says so (hf_dp.audit.canaries.after_train)
    return (f"planner: --audit_canaries {m:,}: logical batch B = {grown:,} (the plan's {batch:,} at q = {batch:,}/{n_train:,} "
            f"over N = {n_train:,} + {m:,} canary units, q = {grown / (n_train + m):.4g}) for the plan's {steps:,} steps, "
            "so the real rows per step stay as planned and the canaries ride on top")


# ----------------------------------------------------------------------------------------------- after training


def write_predictions(trainer, dataset, output_dir: str, name: str, decode: Callable[[Any], Iterable[str]]) -> None:
    """``trainer.predict`` on ``dataset`` (its labels dropped), written by the main process to
    ``output_dir/predict_results_<name>.txt`` as ``index<TAB>prediction`` lines; ``decode`` turns the raw
    predictions into one string per row."""
    if "labels" in dataset.column_names:
        dataset = dataset.remove_columns("labels")
    preds = trainer.predict(dataset, metric_key_prefix="predict").predictions
    path = os.path.join(output_dir, f"predict_results_{name}.txt")
    if trainer.is_world_process_zero():
        os.makedirs(output_dir, exist_ok=True)
        with open(path, "w") as writer:
            writer.write("index\tprediction\n")
            for i, p in enumerate(decode(preds)):
                writer.write(f"{i}\t{p}\n")


def data_description(columns: Iterable[str], what: str, *, train_file: Optional[str] = None,
                     dataset_name: Optional[str] = None, dataset_config: Optional[str] = None,
                     split: Optional[str] = None) -> str:
    """The card's "Fine-tuning data" line: where the training data came from (the file's name — never its folder —,
    or the Hub dataset, its config and split), what its rows are (``what``) and the columns the user's data had (public
    structure; not the tokenized columns a trainer adds). No count of rows: the card gives N on its own line."""
    cols = ", ".join(f"`{c}`" for c in columns)
    if train_file:
        source = f"local file {os.path.basename(train_file)}"
    elif dataset_name:
        source = f"`{dataset_name}`" + (f" (config `{dataset_config}`)" if dataset_config else "") + (
            f", split `{split}`" if split else "")
    else:
        source = "training data"
    return f"{source}: {what}" + (f" (columns {cols})" if cols else "")


def comparable(value):
    """A row's text as the overlap check compares it: Unicode NFKC, case-folded, runs of whitespace as one space (in
    strings nested in lists and dicts too: conversational messages), so that a copy that differs only in case, spacing
    or line endings is still found."""
    import unicodedata

    if isinstance(value, str):
        return " ".join(unicodedata.normalize("NFKC", value).casefold().split())
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    return value


def fingerprint(value, digest=None) -> bytes:
    """A 32-byte digest of ``value``'s :func:`comparable` form (JSON, keys sorted): what the overlap checks keep of each
    row, whatever its length. ``digest``: a running ``hashlib.sha256`` to feed (and return a copy's digest of)."""
    import hashlib
    import json

    h = digest if digest is not None else hashlib.sha256()
    h.update(json.dumps(comparable(value), sort_keys=True, default=str).encode())
    return h.copy().digest()


def eval_rows_in_training(train, validation, columns: Iterable[str]) -> bool:
    """Whether any validation row's ``columns`` (the text the model reads: sentences, messages, prompt/completion) equal
    a training row's, up to case, spacing and Unicode form (:func:`comparable`): then the evaluation is not held out
    and the card says so (``eval_overlap``). Only whether — how many is a count of private training rows."""
    cols = [c for c in columns if c in getattr(train, "column_names", ()) and c in getattr(validation, "column_names", ())]
    if not cols or validation is None:
        return False
    seen = {fingerprint(row) for row in train.select_columns(cols)}
    return any(fingerprint(row) in seen for row in validation.select_columns(cols))


def refuse_eval_overlap(training_args, overlap: bool, what: str = "rows") -> bool:
    """Under DP, validation ``what`` that also occur in the training data are refused before training: the release
    would carry a metric of private training rows, and a card that said so would tell whether one given row was trained
    on (one bit per row, outside the guarantee). Without DP the run goes on and the card says it is not held out.
    Returns ``overlap``."""
    if overlap and training_args.dp_enabled:
        raise RecipeError(f"some validation {what} also occur in the training data: a DP release must not carry a "
                          f"metric of the private training set, nor say whether given {what} were trained on; evaluate "
                          f"on {what} disjoint from the training data (or train without --do_eval)")
    return overlap


#: the release's own folder inside --output_dir: the model, its tokenizer, the card (README.md) and privacy.json only —
#: checkpoints, hf_dp's run records (hf_dp_*) and training_args.bin stay beside it, so that copying or pushing the
#: release folder ships nothing else
RELEASE_SUBDIR = "release"


def release_dir(training_args) -> str:
    """Where a recipe saves the release: ``<output_dir>/release``."""
    return os.path.join(training_args.output_dir, RELEASE_SUBDIR)


def release_is_the_product(trainer) -> None:
    """The release folder (:func:`release_dir`) is what a recipe run makes; its card and privacy.json are written there
    (and each checkpoint keeps its own). TRL's ``SFTTrainer`` also writes a model card into ``--output_dir`` itself at
    every checkpoint (its ``_save_checkpoint`` calls ``create_model_card``, which DPTrainer turns into hf_dp's card and
    privacy.json for ``output_dir``, written before any evaluation: "eval {}"), a second card beside ``release/`` that
    says less than the release's. A recipe's trainer writes no card at the top of ``--output_dir``: this turns its
    ``create_model_card`` (HF's push of ``output_dir`` is its only other caller, and the recipes push the release folder
    instead) into a no-op on this instance."""
    trainer.create_model_card = lambda *args, **kwargs: None


def save_release(trainer, training_args) -> str:
    """``trainer.save_model`` into :func:`release_dir` (the model, LoRA merged; tokenizer; card; privacy.json), without
    the pickled ``training_args.bin`` HF's save adds (the run's flags are not part of a release; checkpoints keep it).
    Returns the folder."""
    out = release_dir(training_args)
    trainer.save_model(out)
    if trainer.is_world_process_zero():
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, "training_args.bin"))
    return out


#: what a push leaves out of the saved folder: checkpoints, the run's records (not part of the release: README.md)
RELEASE_IGNORE = ("checkpoint-*", "_*", "runs/*", "training_args.bin", "hf_dp_*", "*_results.json", "trainer_state.json",
                  "predict_results_*")


def push_folder(folder: str, training_args) -> dict:
    """Upload the saved release folder (model, tokenizer, card, privacy.json; never checkpoint-* or _* files) to the
    Hub. Returns ``{"ok": True, "repo": …}`` or ``{"ok": False, "repo": …, "error": …, "command": …}`` (no network,
    offline mode, no token…): the folder stays on disk and the command pushes it later."""
    import shlex

    # default: the run's name (the --output_dir folder's), not "release"
    repo = training_args.hub_model_id or os.path.basename(os.path.normpath(getattr(training_args, "output_dir", None)
                                                                              or folder))
    ignore = list(RELEASE_IGNORE)
    command = (f"python -c \"from huggingface_hub import HfApi; api = HfApi(); api.create_repo({repo!r}, exist_ok=True, "
               f"private={bool(training_args.hub_private_repo)}); api.upload_folder(repo_id={repo!r}, folder_path="
               f"{os.path.abspath(folder)!r}, ignore_patterns={ignore!r})\"")
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=training_args.hub_token)
        api.create_repo(repo, exist_ok=True, private=bool(training_args.hub_private_repo))
        api.upload_folder(repo_id=repo, folder_path=folder, ignore_patterns=ignore, revision=training_args.hub_revision)
        return {"ok": True, "repo": repo}
    except Exception as exc:  # any failure of the push: the trained model is saved; say how to push it later
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"ok": False, "repo": repo, "error": f"{type(exc).__name__}: {first}", "command": command,
                "folder": shlex.quote(os.path.abspath(folder))}


def raised_by_hf_dp(exc: BaseException) -> bool:
    """True for a ValueError raised by hf_dp itself (its checks) or hf_dp's PrivacyBudgetExceeded."""
    import traceback

    from hf_dp.privacy.privatizer import PrivacyBudgetExceeded

    if isinstance(exc, PrivacyBudgetExceeded):
        return True
    if not isinstance(exc, ValueError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    package = str(Path(__file__).resolve().parents[2] / "hf_dp")
    import hf_dp

    roots = {package, str(Path(hf_dp.__file__).resolve().parent)}
    return bool(frames) and any(str(Path(frames[-1].filename).resolve()).startswith(r) for r in roots)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class StripAnsi(logging.Filter):
    """Drops terminal escape codes from records going to a handler whose stream is not a terminal (a log file, a pipe):
    transformers' model-load report puts its bold title in raw escape codes whatever the stream."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        stream = getattr(self.handler, "stream", None)
        if stream is not None and not (hasattr(stream, "isatty") and stream.isatty()):
            text = record.getMessage()
            if "\x1b[" in text:
                record.msg, record.args = _ANSI.sub("", text), None
        return True


def plain_text_logs() -> None:
    from .logs import quiet_load_reports

    quiet_load_reports()  # the new head's MISSING weights: one plain line, not a table
    for name in ("", "transformers"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, StripAnsi) for f in handler.filters):
                handler.addFilter(StripAnsi(handler))


def process_rank() -> int:
    """This process's global rank under torchrun / ``accelerate launch`` (their ``RANK``), 0 for a single process."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


@contextlib.contextmanager
def one_rank_logs():
    """Under several processes only rank 0 speaks: every other rank prints no plan, summary, warning, INFO line or
    progress bar (they would repeat rank 0's), only errors. A single process is unchanged."""
    if process_rank() == 0:
        yield
        return
    import warnings

    logging.disable(logging.WARNING)  # every logger (hf_dp, transformers, datasets, …): ERROR and above only
    try:
        import datasets
        import transformers

        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - both are dependencies
        pass
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def main(parse: Callable, run: Callable, argv: Optional[list[str]] = None,
         defaults: Optional[dict[str, Any]] = None, user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Parse (``parse(argv, defaults)``), run (``run(*parsed)`` → the summary dict), print the summary; returns the
    process exit code: 0 ok, 2 for a :class:`RecipeError`, one of ``user_errors`` or one of hf_dp's own checks (shown
    as one ``error:`` line, no traceback), 3 when the model was saved but the Hub push failed."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    with one_rank_logs():  # torchrun / accelerate: rank 0 prints the plan, warnings, bars and summary
        code = _main(parse, run, argv, defaults, user_errors)
    if code in (0, 3):
        _leave_process_group()
    return code


def _leave_process_group() -> None:
    """torchrun / accelerate, after a finished run: every rank leaves the process group together. A rank that exits
    while another is still saving could abort at interpreter exit ("terminate called without an active exception",
    gloo), which failed a two-process test once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _main(parse: Callable, run: Callable, argv, defaults, user_errors) -> int:
    try:
        import transformers

        transformers.utils.logging.set_verbosity_warning()
        plain_text_logs()
        summary = run(*parse(argv, defaults))
    except (RecipeError, *user_errors) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:
        if not raised_by_hf_dp(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)  # hf_dp's own checks (docs/misuse.md): one line, no traceback
        return 2
    print(summary_block(summary), flush=True)
    push = summary.get("push")
    if push and not push["ok"]:
        print(f"error: the model was trained and saved to {summary['output_dir']}, but pushing it to the Hub repo "
              f"{push['repo']} failed ({push['error']}); push the saved folder later with: {push['command']}",
              file=sys.stderr)
        return 3
    if push:
        print(f"pushed {summary['output_dir']} to the Hub repo {push['repo']}", flush=True)
    return 0
