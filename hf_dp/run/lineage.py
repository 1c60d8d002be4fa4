"""Whose ledger: the privacy ledger belongs to the model and to the lineage of its checkpoints, not to one trainer.

**The model carries its ledger.** Every :class:`~hf_dp.trainer.DPTrainer` that trains a model attaches to it (to the
plain ``PreTrainedModel``, the one the user passed):

* in memory, :data:`MODEL_ATTR`: the trainer's live ledger, its run id and a reference to its training data (the
  object, weakly, and its SHA-256 fingerprint once known — :func:`hf_dp.run.checkpointing.dataset_fingerprint`). The
  fingerprint is a function of the private data: it is **never written** into a release (a hash of the training set
  in a public file lets anyone confirm a guessed dataset);
* in ``model.config`` (so in every ``config.json`` that ``save_pretrained`` writes, and back with
  ``from_pretrained``), :data:`CONFIG_ATTR`: public numbers only — each run's (σ, q, steps) history, δ, the
  accountant, run ids and the parent checkpoint's run and step. ``privacy.json`` carries the same under ``"ledger"``.

**A new DPTrainer on such a model** (``--prior_privacy``, :func:`adopt_model_ledger` at construction):

* ``auto`` (default): every earlier DP run of the model is composed into this run's ledger — ε counts every step the
  model took, and ``--epsilon`` is the model's total (a target already spent is refused before any step). The
  fingerprint only tells *same* data (the same object, or the same rows, columns and order) from data it cannot
  match: a re-ordered or re-columned copy of the same rows has another fingerprint, so "other data" cannot be told
  from "the same data, copied" and is counted too (fail closed); one warning names the runs counted on other data or
  on data that cannot be compared (a model loaded from a release), with their ε and how not to count them;
* ``continue``: the same count, said explicitly (no warning);
* ``separate``: none is counted (the user says the data share no example with the earlier runs'); refused when the
  data are the same;
* a path to a release's ``privacy.json`` (or its folder): its runs start the ledger (e.g. a model whose config lost
  its record, or an earlier hf_dp's release), and the runs the model carries are counted as under ``auto``.

**A ``--disable_dp`` trainer on such a model** marks it (:func:`mark_non_private`, when its ``train()`` starts): the
mark stays with the model through every later DP run, whose release says that no DP guarantee covers that training.

Forks (a checkpoint resumed more than once) are counted in :func:`hf_dp.run.spent.reconcile_resumed_ledger`;
this module also keeps each run's record of steps taken (:func:`record_spent`) and refuses a fresh run into an
output_dir that holds another run's checkpoints (:func:`before_train`).
"""

from __future__ import annotations

import json
import logging
import os
import weakref

from hf_dp.run import checkpointing
from hf_dp.run import spent
from hf_dp.privacy.accounting import canonical_history, composed_epsilon, public_run as _public_run

logger = logging.getLogger(__name__)

#: in-memory attribute of the model: its ledger, run id and training-data reference (never saved)
MODEL_ATTR = "_hf_dp_ledger"
#: attribute of ``model.config`` (saved in config.json): the public record of the model's ledger
CONFIG_ATTR = "hf_dp_privacy"
PRIOR_CHOICES = ("auto", "continue", "separate")
RECORD_FORMAT = 1
#: the mark (ledger meta, public record, config.json) of a model trained without DP after a DP run (mark_non_private)
NON_PRIVATE = "trained_without_dp_after"


# ---------------------------------------------------------------------------------------------------
# the training data of a run, in memory only
# ---------------------------------------------------------------------------------------------------
class DataRef:
    """The training data of a run: its actual row count (``None`` if unsized), the dataset object (weakly where it
    can be) and its fingerprint once computed (lazily: only when a trainer on other data asks whether the data are the
    same). Never the planned N (``--public_dataset_size``, ``--audit_canaries``' m, units): two runs on the same data
    may plan different N. Deep copies share it; a pickle (``torch.save(model)`` is a file) keeps neither the object
    nor the fingerprint: the data of an unpickled model cannot be compared."""

    def __init__(self, dataset, fingerprint: str | None = None):
        self.rows = len(dataset) if hasattr(dataset, "__len__") else None
        self.fingerprint = fingerprint
        try:
            self._ref = weakref.ref(dataset)
        except TypeError:  # e.g. a list takes no weak reference: held (hashed only if another trainer asks)
            self._ref = lambda: dataset

    def dataset(self):
        return self._ref() if self._ref is not None else None

    def get_fingerprint(self) -> str | None:
        if self.fingerprint is None and self.dataset() is not None:
            self.fingerprint = checkpointing.dataset_fingerprint(self.dataset())
        return self.fingerprint

    def __deepcopy__(self, memo):
        return self

    def __getstate__(self):
        return {"rows": self.rows}

    def __setstate__(self, state):
        self.rows, self.fingerprint, self._ref = state.get("rows"), None, None


def _same_data(ref: DataRef | None, dp) -> bool | None:
    """Is ``ref`` this run's training data (``dp.lineage.data``)? The data themselves are compared (the object, the
    actual row count, the fingerprint), never the planned N. ``None``: unknown (no reference, or the data are gone)."""
    if ref is None:
        return None
    own = dp.lineage.data
    if ref.dataset() is not None and ref.dataset() is own.dataset():
        return True
    if ref.rows is not None and own.rows is not None and ref.rows != own.rows:
        return False
    fingerprint = ref.get_fingerprint()
    if fingerprint is None:
        return None
    return fingerprint == own.get_fingerprint()


# ---------------------------------------------------------------------------------------------------
# what a model carries
# ---------------------------------------------------------------------------------------------------
class ModelLedger:
    """The in-memory record on a model (:data:`MODEL_ATTR`): the ledger of the last DPTrainer that trained it (live:
    it grows as that trainer trains), its training data, and the data of the earlier runs where known."""

    def __init__(self, ledger, data: DataRef, refs: dict[str, DataRef]):
        self.ledger, self.data, self.refs = ledger, data, refs

    @property
    def run_id(self) -> str | None:
        return self.ledger.meta.get("run_id")


def _plain_model(model):
    """The model the user passed (under a PEFT wrapper: its base model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def run_epsilon(runs: list[dict], delta: float | None = None, accountant: str | None = None) -> float:
    """ε of ``runs`` composed (at the first run's δ and accountant unless given)."""
    history = [h for run in runs for h in run.get("history") or []]
    if not history:
        return 0.0
    delta = delta if delta is not None else runs[0].get("delta")
    accountant = accountant or runs[0].get("accountant") or "prv"
    return composed_epsilon(canonical_history(history), float(delta), accountant)


# ---------------------------------------------------------------------------------------------------
# the earlier runs a model carries, and what this trainer does with them
# ---------------------------------------------------------------------------------------------------
def _carried(model) -> dict | None:
    """The earlier runs ``model`` carries: ``{"block": [runs counted together], "block_ref": DataRef | None,
    "separate": [(run, DataRef | None)], "origin": "memory" | "release"}``, or ``None``."""
    record = getattr(model, MODEL_ATTR, None)
    if isinstance(record, ModelLedger):
        block = [r for r in record.ledger.runs() if r["steps"] > 0]
        separate = [(dict(r), record.refs.get(r.get("run_id"))) for r in record.ledger.meta.get("separate") or []]
        if block or separate:
            return {"block": block, "block_ref": record.data, "separate": separate, "origin": "memory"}
        return None
    config = getattr(getattr(model, "config", None), CONFIG_ATTR, None)
    if isinstance(config, dict):
        block = [_public_run(r) for r in config.get("runs") or [] if isinstance(r, dict)]
        block = [r for r in block if r["steps"] > 0]
        separate = [(_public_run(r), None) for r in config.get("separate") or [] if isinstance(r, dict)]
        if block or separate:
            return {"block": block, "block_ref": None, "separate": separate, "origin": "release"}
    return None


def _runs_from_file(path: str) -> tuple[list[dict], list[dict]]:
    """(counted runs, separate runs) of a release's ``privacy.json`` (a file, or the folder holding it); a
    ``privacy.json`` of an earlier hf_dp (no ``"ledger"``) is one run of its σ, q and steps."""
    file = os.path.join(path, "privacy.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--prior_privacy {path}: cannot read a privacy.json there ({e}); give 'auto', 'continue', "
                         "'separate', or the path of a release's privacy.json") from None
    if not isinstance(report, dict) or report.get("differential_privacy") is False:
        raise ValueError(f"--prior_privacy {path}: {file} is not the privacy.json of a DP run")
    ledger = report.get("ledger")
    if isinstance(ledger, dict) and isinstance(ledger.get("runs"), list):
        runs = [_public_run(r) for r in ledger["runs"] if isinstance(r, dict)]
        separate = [_public_run(r) for r in ledger.get("separate") or [] if isinstance(r, dict)]
        return [r for r in runs if r["steps"] > 0], separate
    try:
        run = {"run_id": report.get("run_id") or f"privacy.json:{os.path.basename(os.path.dirname(os.path.abspath(file)))}",
               "history": [[float(report["noise_multiplier"]), float(report["sample_rate"]), int(report["steps"])]],
               "noise_multiplier": report["noise_multiplier"], "sample_rate": report["sample_rate"],
               "dataset_size": report.get("dataset_size"), "delta": report["delta"],
               "accountant": report.get("accountant", "prv")}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"--prior_privacy {path}: {file} records no noise_multiplier, sample_rate, steps and delta") from None
    return [_public_run(run)], []


def _describe(runs: list[dict]) -> str:
    parts = [f"run {r.get('run_id')}: {r['steps']} noisy steps" for r in runs]
    return "; ".join(parts)


def _merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """``existing`` runs updated with ``new`` ones (a run already there keeps its larger step count)."""
    out = {r.get("run_id"): dict(r) for r in existing}
    for r in new:
        key = r.get("run_id")
        if key not in out or r["steps"] > out[key]["steps"]:
            out[key] = dict(r)
    return list(out.values())


def _take(dp, carried: dict | None, from_file: tuple[list[dict], list[dict]] | None, choice: str, quiet=False) -> None:
    """Compose into the run's ledger (``dp.ledger``) the earlier runs ``carried`` by its model (and read from a file) as
    ``choice`` says: every one unless ``separate`` (fail closed); warn once about those counted without knowing that
    the data are the same (``quiet``: the caller says what was taken in)."""
    ledger, refs = dp.ledger, dp.lineage.refs
    own = ledger.meta.get("run_id")
    known = {r.get("run_id"): r["steps"] for r in ledger.prior}
    known.update({r.get("run_id"): r["steps"] for r in ledger.meta.get("separate") or []})

    def new(run):  # not this run, and not already known with at least as many steps
        return run.get("run_id") != own and (run.get("run_id") not in known or run["steps"] > known[run.get("run_id")])

    counted: list[tuple[dict, bool | None]] = []  # (run, on the same data?) — None: from a file, or not comparable
    separate: list[tuple[dict, bool | None]] = []
    if from_file is not None:
        counted += [(r, None) for r in from_file[0] if new(r)]
        counted += [(r, None) for r in from_file[1] if new(r)]  # declared separate from *that* release's data only
        file_ids = {r.get("run_id") for r in from_file[0] + from_file[1]}
    else:
        file_ids = set()
    if carried is not None:
        block = [r for r in carried["block"] if new(r) and r.get("run_id") not in file_ids]
        verdict = _same_data(carried["block_ref"], dp)
        groups = [(block, verdict, carried["block_ref"])] if block else []
        groups += [([r], _same_data(ref, dp), ref) for r, ref in carried["separate"] if new(r) and r.get("run_id") not in file_ids]
        for runs, same, ref in groups:
            if choice == "separate" and same:
                raise ValueError(
                    f"--prior_privacy separate, but this model was already trained with DP on the same training data "
                    f"({_describe(runs)}; epsilon {run_epsilon(runs):.4g}): privacy composes over the examples both runs "
                    "use, so this run's ledger must count them; drop --prior_privacy (or give 'continue')"
                )
            if choice != "separate":  # fail closed: a copy of the data re-ordered or re-columned is not "other data"
                counted += [(r, same) for r in runs]
            else:
                separate += [(r, same) for r in runs]
            for r in runs:
                if ref is not None and r.get("run_id") is not None:
                    refs.setdefault(r["run_id"], ref)
    if not counted and not separate:
        return
    # counted by default without knowing that the data are the same (a re-ordered or re-columned copy, other data, a
    # release's runs): --prior_privacy auto fails closed, the user says separate
    unasked = [(r, same) for r, same in counted if same is not True and r.get("run_id") not in file_ids]
    same_data = any(same is True for _, same in counted)
    counted = [r for r, _ in counted]
    unit = ledger.meta.get("privacy_unit")
    other_unit = [r for r in counted if r.get("privacy_unit") != unit]
    if other_unit:
        name = lambda u: f"unit = '{u}'" if u else "one row"  # noqa: E731
        raise ValueError(
            f"this model's earlier DP training ({_describe(other_unit)}) protected {name(other_unit[0].get('privacy_unit'))}, "
            f"this run protects {name(unit)}: their epsilons do not compose into one guarantee for either unit (a "
            "row-level run protects a user of k rows only as a group of k); train with the same --privacy_unit_column, "
            "or start from a model without that history (or pass --prior_privacy separate if this run's training data "
            "share no example with theirs)"
        )
    if counted:
        ledger.set_prior(_merge(ledger.prior, counted))
        opt = dp.optimizer
        if opt is not None:
            opt.budget_steps = None  # the steps known to fit were for the ledger without these runs
        total = "; --epsilon is the model's total" if dp.spec.target_epsilon is not None else ""
        if not quiet and choice != "continue" and unasked:
            unknown = [r for r, same in unasked if same is None]
            other = [r for r, same in unasked if same is False]
            where = " and ".join(
                ([f"on other training data ({_describe(other)})"] if other else [])
                + ([f"on training data that cannot be compared ({_describe(unknown)}; "
                    + ("it came with the model from a release" if carried and carried["origin"] == "release"
                       else "the data are no longer in memory") + ")"] if unknown else [])
            )
            runs = [r for r, _ in unasked]
            logger.warning(
                "hf_dp: this model was already trained with DP %s, epsilon %.4g at delta %g: privacy composes over the "
                "examples these sets share (a re-ordered or re-columned copy shares them all), so this run's ledger "
                "counts those steps (--prior_privacy %s; epsilon now %.4g before this run's steps%s). If this run's "
                "training data share no example with theirs, pass --prior_privacy separate",
                where, run_epsilon(runs), float(runs[0].get("delta") or dp.spec.delta),
                choice, ledger.get_epsilon(), total,
            )
        elif not quiet:
            implicit = choice == "auto" or (choice != "continue" and same_data)
            why = ("counting the earlier DP runs of this model (--prior_privacy continue)" if choice == "continue" else
                   "this model was already trained with DP on this training data" if implicit else
                   f"counting the runs recorded in {choice} (--prior_privacy)")
            (logger.warning if implicit else logger.info)(
                "hf_dp: %s (%s): this run continues that ledger, and epsilon counts every step (now %.4g before this "
                "run's steps%s)", why, _describe(counted), ledger.get_epsilon(), total,
            )
    if separate:  # --prior_privacy separate: the user says the data share no example with these runs'
        ledger.meta["separate"] = _merge(ledger.meta.get("separate") or [], [r for r, _ in separate])


def adopt_model_ledger(dp, args, model, dataset, fingerprint: str | None = None) -> None:
    """At construction (``DPTrainer._setup_privacy``, right after the ledger ``dp.ledger`` is made): record the run's
    training data ``dataset`` (before any caching; its ``fingerprint`` if already computed) in ``dp.lineage.data``, and
    start the ledger from the earlier runs ``model`` carries, as ``--prior_privacy`` says."""
    choice = str(getattr(args, "prior_privacy", None) or "auto")
    dp.lineage.refs = {}
    dp.lineage.data = DataRef(dataset, fingerprint)
    from_file = _runs_from_file(choice) if choice not in PRIOR_CHOICES else None
    carried = _carried(_plain_model(model))
    _refuse_selected(_plain_model(model), from_file_path=choice if from_file is not None else None, choice=choice)
    if carried is None and from_file is None and choice == "continue":
        logger.info("hf_dp: --prior_privacy continue: the model carries no hf_dp ledger; the ledger starts at 0")
    _take(dp, carried, from_file, choice)
    _take_mark(dp, model)  # trained without DP after an earlier DP run: so is this run's model


def _selection_of(model) -> dict | None:
    """The ``hyperparameter_selection`` summary a model released by private selection carries (in memory or in its
    config), else ``None``."""
    record = getattr(model, MODEL_ATTR, None)
    if isinstance(record, ModelLedger) and record.ledger.meta.get("hyperparameter_selection"):
        return record.ledger.meta["hyperparameter_selection"]
    config = getattr(getattr(model, "config", None), CONFIG_ATTR, None)
    if isinstance(config, dict) and isinstance(config.get("hyperparameter_selection"), dict):
        return config["hyperparameter_selection"]
    return None


def _refuse_selected(model, from_file_path: str | None, choice: str) -> None:
    """A model released by private hyper-parameter selection (:mod:`hf_dp.tuning.search`) cannot continue its ledger: its ε
    is the selection's total, which no (σ, q, steps) history expresses — its ledger holds one trial's steps only.
    Training it on other data (``--prior_privacy separate``) stays possible."""
    selection = _selection_of(model)
    if selection is None and from_file_path is not None:
        file = os.path.join(from_file_path, "privacy.json") if os.path.isdir(from_file_path) else from_file_path
        with open(file, encoding="utf-8") as f:
            selection = json.load(f).get("hyperparameter_selection")
    if selection is None or choice == "separate":
        return
    raise ValueError(
        f"this model was released by a private hyper-parameter selection (total epsilon "
        f"{float(selection.get('total_epsilon', float('nan'))):.4g} at delta {selection.get('delta')}), whose cost its "
        "ledger of one trial's steps does not hold, so further DP training could not report a true total; train a "
        "fresh copy of the base model (or pass --prior_privacy separate if the new training data share no example "
        "with the selection's)"
    )


def take_later_runs(dp, args, model):
    """The run's ledger (``dp.ledger``), first brought up to ``model``'s: before a ledger is written or reported (:func:`record_spent`
    at every log, checkpoint, ``save_model`` and ``push_to_hub``; ``DPTrainer.privacy_report``, which the recipes'
    release writers read; ``DPTrainer.get_epsilon``), the runs of DPTrainers that trained the same model object since
    this one took in its record (the model carries the last one's ledger, :data:`MODEL_ATTR`) are taken in as
    :func:`before_train` takes them. So a stale trainer (T1, T2, T1 again train the model; T2 saves) never writes fewer
    steps than the weights took; runs declared separate (``--prior_privacy separate``, other data) stay separate."""
    model = _plain_model(model)
    record = getattr(model, MODEL_ATTR, None)
    if dp.enabled:
        _take_mark(dp, model)
    if dp.enabled and isinstance(record, ModelLedger) and record.ledger is not dp.ledger:
        ledger, choice = dp.ledger, str(getattr(args, "prior_privacy", None) or "auto")
        _refuse_selected(model, None, choice)
        before = ledger.steps
        _take(dp, _carried(model), None, choice, quiet=True)
        if ledger.steps > before:
            logger.warning("hf_dp: another DPTrainer (run %s) trained this model since this trainer last trained it (or was "
                           "made): this trainer's ledger now counts those steps too (%d noisy steps, epsilon %.4g): what it "
                           "reports and saves is the model's", record.run_id, ledger.steps, ledger.get_epsilon())
    return dp.ledger


# ---------------------------------------------------------------------------------------------------
# at train()
# ---------------------------------------------------------------------------------------------------
def before_train(dp, args, model, resume_from_checkpoint, fingerprint: str | None = None) -> None:
    """At the start of ``train()`` (after its own checks): name the run in its ledger, refuse a fresh run into an
    output_dir holding another run's checkpoints, take in runs that trained the model since this trainer was made,
    refuse a target ε the earlier runs already spent, and attach the ledger to the model (``fingerprint``:
    :func:`refresh_config`)."""
    if not args.dp_enabled:
        mark_non_private(model)  # a model that carries a ledger: marked before any non-private step
        return
    ledger = dp.ledger
    _sync_run_id(dp, args)
    ledger.meta["run_id"] = dp.run_id
    if resume_from_checkpoint is None:
        own = {dp.run_id} | {a.get("run_id") for a in ledger.meta.get("ancestry") or []}
        spent.refuse_other_runs_checkpoints(args, own)  # a fresh run never overwrites another run's checkpoints
        plain = _plain_model(model)
        record = getattr(plain, MODEL_ATTR, None)
        if isinstance(record, ModelLedger) and record.ledger is not ledger:  # another trainer trained it since
            _refuse_selected(plain, None, str(getattr(args, "prior_privacy", None) or "auto"))
            _take(dp, _carried(plain), None, str(getattr(args, "prior_privacy", None) or "auto"))
        _check_prior_budget(dp)
        if ledger.steps > 0:
            # a continuation that is not a resume (a second train(), or a new trainer on a model that carries this
            # ledger) starts at a ledger step that a clean resume of one of the run's checkpoints may also start at:
            # under --dp_seed its streams get a tag of their own, so the two never draw the same batches or noise
            ledger.meta["stream_tag"] = f"{dp.run_id}@{ledger.steps}"
    attach(dp, model, fingerprint)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _sync_run_id(dp, args) -> None:
    """Every rank names the run (``dp.run_id``) as rank 0 does (each drew its own id at construction)."""
    if args.world_size > 1 and _distributed():
        import torch.distributed as dist

        box = [dp.run_id]
        dist.broadcast_object_list(box, src=0)
        dp.run_id = box[0]


def _check_prior_budget(dp) -> None:
    """With earlier runs in the ledger and a target ε (the model's total): refuse when not one more step fits, and
    say when the planned steps do not all fit (the run then stops at the target, as a resumed run does)."""
    ledger, spec = dp.ledger, dp.spec
    target = spec.target_epsilon
    dp.lineage.budget_steps = None
    if target is None or ledger.prior_steps == 0:
        return
    within = lambda n: ledger.epsilon_after(n) <= target * (1 + 1e-9)  # noqa: E731
    if not within(ledger.steps + 1):
        runs = [r for r in ledger.prior if r["steps"] > 0]
        raise ValueError(
            f"refusing to train: this model already spent epsilon={ledger.get_epsilon():.4g} (delta={spec.delta:g}) in "
            f"{len(runs)} earlier run(s) ({_describe(runs)}), which this ledger counts; one more step would exceed the "
            f"target epsilon={target}, the model's total: raise --epsilon to the total you accept for this model, or "
            "train a fresh copy of the base model"
        )
    if dp.optimizer is not None:
        return  # a later train() of this trainer: the budget guard stops it at the target
    planned = int(spec.planned_steps or 0)
    lo, hi = ledger.steps + 1, ledger.steps + planned
    if within(hi):
        dp.lineage.budget_steps = hi
        return
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    dp.lineage.budget_steps = lo
    logger.warning(
        "hf_dp: with the %d steps of earlier runs in the ledger (epsilon %.4g), the target epsilon=%s (the model's total) "
        "leaves room for %d of this run's %d planned steps at sigma=%.4g; the run stops there. To spread the remaining "
        "budget over all planned steps, raise the noise (--noise_multiplier) or lower --max_steps / --num_train_epochs",
        ledger.prior_steps, ledger.get_epsilon(), target, lo - ledger.steps, planned, spec.noise_multiplier,
    )


def after_optimizer_load(dp, checkpoint) -> None:
    """After HF built the optimizer (``dp.optimizer``; and loaded a checkpoint's state into it): the steps the trainer
    pre-set as fitting the budget were computed for this run alone; with earlier runs in the ledger they are this
    module's (or, after a resume, unknown: the privatizer finds them)."""
    opt = dp.optimizer
    if opt is None or opt.max_epsilon is None or dp.ledger.prior_steps == 0:
        return
    opt.budget_steps = None if checkpoint is not None else dp.lineage.budget_steps


def attach(dp, model, fingerprint: str | None = None) -> None:
    """``model`` carries the run's ledger: in memory (with its training data) and in ``model.config`` (:func:`refresh_config`)."""
    model = _plain_model(model)
    _take_mark(dp, model)  # before the record it replaces is gone
    record = ModelLedger(dp.ledger, dp.lineage.data, dict(dp.lineage.refs))
    try:
        setattr(model, MODEL_ATTR, record)
    except (AttributeError, TypeError):  # pragma: no cover - a model object that takes no attribute
        pass
    refresh_config(dp, model, fingerprint)


def refresh_config(dp, model, fingerprint: str | None = None) -> None:
    """Write the public record of the ledger into ``model.config`` (saved with the model); the run's data reference
    (``dp.lineage.data``) keeps the training data's ``fingerprint`` once the trainer has computed it (in memory only:
    ``DPTrainer._train_data_info``)."""
    config = getattr(_plain_model(model), "config", None)
    if config is None:
        return
    if dp.lineage.data.fingerprint is None and fingerprint is not None:
        dp.lineage.data.fingerprint = fingerprint
    _take_mark(dp, model)  # the record it overwrites may say that the model was trained without DP
    record = dp.ledger.public_record()
    record.pop("counted_past_parent", None)
    setattr(config, CONFIG_ATTR, record)


def record_spent(dp, args, model, fingerprint: str | None = None, compute_epsilon: bool = True) -> None:
    """The record of steps taken (``hf_dp_epsilon_spent.json``, keyed by run id), the runs' records in the checkpoints
    this run descends from, and the model's public record. The count is what resumes rely on; ε is informative (as
    ``DPTrainer.get_epsilon`` gives it), and with ``compute_epsilon=False`` written only when the ledger already has it;
    the model's steps (:func:`take_later_runs`; ``fingerprint``: :func:`refresh_config`)."""
    ledger = take_later_runs(dp, args, model)
    if ledger.steps == 0:
        return
    if compute_epsilon:  # as DPTrainer.get_epsilon: a private selection's model reports the selection's total
        selection = dp.selection.record
        eps = float(selection["total_epsilon"]) if selection is not None else ledger.get_epsilon()
    else:
        eps = ledger.cached_epsilon()
    meta = ledger.meta
    if args.should_save:
        extra = {"parent": meta["parent"]} if meta.get("parent") else None
        spent.write_spent(args.output_dir, ledger.steps, eps, dp.spec.as_dict(), run_id=dp.run_id, extra=extra)
        ancestry = meta.get("ancestry") or []
        written, start = dp.lineage.resume_steps, dp.lineage.resume_start
        if ancestry and start is not None and written != ledger.steps and meta.get("run_id") == dp.run_id:
            record = {"run_id": dp.run_id, "output_dir": os.path.abspath(args.output_dir),
                      "start_steps": start, "steps": ledger.steps, "parent": meta.get("parent")}
            for a in ancestry:
                spent.write_resume_record(a["checkpoint"], record)
            dp.lineage.resume_steps = ledger.steps
    refresh_config(dp, model, fingerprint)


def mark_non_private(model, global_step: int = 1) -> None:
    """A ``--disable_dp`` run trains a model that carries a ledger (marked when its ``train()`` starts,
    :func:`before_train`, and again when it saves; none if ``global_step`` is 0): the ledger on the model (in memory,
    the last DPTrainer's) and its ``config.json`` record say :data:`NON_PRIVATE` — a later DP run of the model keeps
    the mark (:func:`_take_mark`), and its release says that no DP guarantee covers that training's data."""
    model = _plain_model(model)
    record, config = getattr(model, MODEL_ATTR, None), getattr(model, "config", None)
    if not global_step:
        return  # not trained by this trainer
    if isinstance(record, ModelLedger):
        record.ledger.meta[NON_PRIVATE] = True
    public = getattr(config, CONFIG_ATTR, None)
    if isinstance(public, dict) and not public.get(NON_PRIVATE):
        setattr(config, CONFIG_ATTR, dict(public, **{NON_PRIVATE: True}))


def _take_mark(dp, model) -> None:
    """The run's ledger takes the mark of non-private training that ``model`` carries (in memory or in its config)."""
    model = _plain_model(model)
    record, public = getattr(model, MODEL_ATTR, None), getattr(getattr(model, "config", None), CONFIG_ATTR, None)
    if ((isinstance(record, ModelLedger) and record.ledger.meta.get(NON_PRIVATE))
            or (isinstance(public, dict) and public.get(NON_PRIVATE))):
        dp.ledger.meta[NON_PRIVATE] = True
