"""``DPTrainer``: private fine-tuning through ``transformers.Trainer``.

What it changes, and nothing else (each override calls ``super()``):

* ``__init__``: freezes by ``--trainable`` (before any wrapping), optionally caches the frozen prefix
  (``--cache_frozen_features``, :mod:`hf_dp.models.prefix_cache`), validates the privacy settings
  against the dataset (δ < 1/N, B ≤ N, the budget reachable), calibrates σ for the planned steps,
  builds the Poisson sampler and the ε ledger, and attaches the per-example clipping engine to the
  plain model — one-backward ghost clipping (:mod:`hf_dp.clipping`) where it applies,
  else Opacus' per-sample-gradient hooks (``--clipping``; ``ghost_two_pass``: ghost clipping in two
  backward passes, the first inside ``compute_loss``). The model itself is never wrapped, so
  saving and evaluation are HF's own.
* ``get_train_dataloader``: the same dataset and collator HF builds, drawn by
  :class:`~hf_dp.privacy.PoissonBatchSampler` (rate q, the accountant's q), one logical batch split
  into ``gradient_accumulation_steps`` micro-batches per rank.
* ``create_optimizer``: HF's param groups (decay / no-decay) go to :func:`hf_dp.optim.make_optimizer`,
  the registered update rule wrapped in :class:`~hf_dp.privacy.PrivateOptimizer` (clip, noise once, ÷B, ledger).
* ``compute_loss`` / ``training_step``: **the loss-scaling contract** — ``compute_loss`` returns
  Σ_i ℓ_i / (B / world_size), and a hook on Σ_i ℓ_i measures the factor that every later scaling
  (the Trainer's gradient-accumulation division, Accelerate, mixed precision) applied before the
  backward pass; per-sample gradients are divided by exactly that factor before clipping, so each
  example's clipped vector is clip_C(∇ℓ_i) whatever the Trainer does to the loss. ``num_items_in_batch``
  is ignored. The returned loss is per rank, a mean over the expected logical batch. Under DDP the forward
  runs in ``no_sync`` for every micro-batch (DDP all-reduces no raw gradient); each rank clips its own
  examples and the privatizer all-reduces the noisy clipped sum once per logical batch. Under FSDP2
  (``--fsdp full_shard``) two-pass ghost clipping runs on the shards and each rank adds the noise to its own shard
  (:mod:`hf_dp.clipping.sharding`); DeepSpeed is refused under DP (docs/fsdp.md).
* ``log``: adds ``epsilon`` (spent so far) and drops HF's ``grad_norm`` (the norm of the
  *non-private* gradient). The logged training loss is **not** private (it is computed from the
  private batch); eval metrics are computed on the eval set.
* ``hyperparameter_search``: under DP, private selection (:mod:`hf_dp.tuning.search`): the best of a random number of
  fresh DP runs, ε the selection's total (``backend="dp_random_stopping"``; without DP, HF's own search).
* ``save_model`` / ``create_model_card``: a plain ``PreTrainedModel`` (LoRA merged), the tokenizer,
  ``privacy.json`` and a model card stating the guarantee.

Checkpoints: the optimizer state saved by HF carries the update rule state and the ledger (ε history)
— no seed and no generator state: batches and noise are fresh after a resume (see
:mod:`hf_dp.privacy.randomness`). Resuming continues ε, refuses changed privacy settings or different
training data (the completion marker records a fingerprint of it), and counts the steps an
interrupted run took past the checkpoint it resumes from.
``_save_checkpoint`` writes the completion marker ``hf_dp_checkpoint.json`` after HF's files and
before old checkpoints are rotated; ``train(resume_from_checkpoint=True|path)`` only resumes from a
complete checkpoint, and ε counts every noisy step ever taken (see :mod:`hf_dp.run.checkpointing`).
Under FSDP2 a checkpoint is sharded (the model's shards as HF writes them, the privatizer's state with the ledger by
``torch.distributed.checkpoint``; :mod:`hf_dp.clipping.sharding`) and resumes under FSDP with as many processes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets

import torch
import transformers
from packaging import version
from torch.utils.data import DataLoader, SequentialSampler
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hf_dp import __version__
from hf_dp.arguments import DPTrainingArguments, check_no_full_eval_cast
from hf_dp.clipping import sharding
from hf_dp.run import checkpointing
from hf_dp.run import contract
from hf_dp.run import lineage
from hf_dp.audit import canaries
from hf_dp.hub import report, write_privacy_artifacts
from hf_dp.hub.describe import card_fields
from hf_dp.clipping import ClippingEngine, choose_engine, make_engine, unwrap_for_save
from hf_dp.models import apply_trainable
from hf_dp.models.cache_manager import PrefixCacheManager, forward_context
from hf_dp.models.prefix_cache import CACHED_HIDDEN_KEY, PREFIX_SIGNATURE_KEY, CachedFeatures, CachedFeaturesCollator
from hf_dp.optim import get_entry, make_optimizer, rule_hyperparameters
from hf_dp.privacy.accounting import PrivacyLedger, PrivacySpec
from hf_dp.privacy.planning import plan_mechanism
from hf_dp.privacy.privatizer import PrivateOptimizer
from hf_dp.privacy.randomness import SEEDED, source_name
from hf_dp.privacy.sampler import PoissonBatchSampler
from hf_dp.models.loss import OBJECTIVES, objective_for, per_example_loss, positions_from_mask
from hf_dp.run.data import EMPTY_KEY as _EMPTY_KEY
from hf_dp.run.data import example_lengths
from hf_dp.run.data import UNITS_KEY as _UNITS_KEY
from hf_dp.run.data import EmptySafeCollator as _EmptySafeCollator
from hf_dp.run.data import UnitTagged as _UnitTagged
from hf_dp.run.data import unit_rows as _unit_rows
from hf_dp.run.data import PoissonDataLoader as _PoissonDataLoader
from hf_dp.run.data import check_eval_is_not_train as _check_eval_is_not_train
from hf_dp.run.data import refuse_sharding as _refuse_sharding

logger = logging.getLogger(__name__)

_MIN_TRANSFORMERS = "5.0.0"

# Private transformers API DPTrainer depends on: the one list to re-check on a transformers upgrade.
# Checked against transformers 5.23.0 and 5.24.0 (5.24 changed neither method; _check_transformers_version admits
# >=5.0,<6). Everything else DPTrainer overrides is public — __init__, get_train_dataloader,
# create_optimizer, compute_loss, training_step, log, train, evaluate, predict, save_model,
# create_model_card, create_accelerator_and_postprocess (--fsdp on CPU: hf_dp.clipping.sharding), num_examples,
# hyperparameter_search (under DP: hf_dp.tuning.search) — and the budget stop is a TrainerCallback (_BudgetGuard).
HF_PRIVATE_API_CHECKED_WITH = ("5.23.0", "5.24.0")
HF_PRIVATE_OVERRIDES = {
    # method: why no public hook serves
    "_save_checkpoint": "the completion marker must be written after HF's files and before old checkpoints are "
    "rotated; HF rotates inside _save_checkpoint, and on_save (the first public hook) runs after the rotation",
    "_save_optimizer_and_scheduler": "under DP with FSDP the privatizer's state (the sharded rule state and the ledger) "
    "is written with torch.distributed.checkpoint (hf_dp.clipping.sharding.save_checkpoint_state): Accelerate's "
    "save_fsdp_optimizer, which HF calls there, reads torch's optimizer state format only; elsewhere HF's own",
    "_load_optimizer_and_scheduler": "the ledger that optimizer.pt just restored must be checked (marker, data "
    "fingerprint, budget) and topped up with steps taken past the checkpoint before training resumes, and the "
    "frozen-prefix caches checked against the weights HF has just loaded; "
    "on_train_begin runs later and gets neither the checkpoint nor the ledger as it was before the load; under DP "
    "with FSDP the privatizer's sharded state is loaded there (hf_dp.clipping.sharding.load_checkpoint_state: Accelerate's "
    "load_fsdp_optimizer would step the empty optimizer on zero gradients first)",
    "_get_train_sampler": "under DP the Poisson sampler replaces HF's, so HF's is not built (its group_by_length "
    "sampler would read every row's input_ids, which a prefix cache does not have); without DP a prefix cache's own "
    "lengths go to HF's LengthGroupedSampler",
    "_get_eval_sampler": "under DP, group_by_length orders the training draws only: evaluation and predict() keep "
    "the dataset's order (HF's grouped eval sampler would permute predict()'s rows); without DP a prefix cache, which "
    "has no input_ids, gets HF's LengthGroupedSampler with the cache's own lengths",
}
HF_PRIVATE_CALLS = (
    "_set_signature_columns_if_needed / _signature_columns: keep the cached-states column through HF's column removal",
    "_get_output_dir(trial): the checkpoint folder _save_checkpoint writes",
)


def _group_by_length(args) -> bool:
    return str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy)) == "group_by_length"


def _check_transformers_version() -> None:
    v = version.parse(transformers.__version__)
    if v < version.parse(_MIN_TRANSFORMERS) or v.major >= 6:
        raise RuntimeError(
            f"hf_dp {__version__} supports transformers >=5.0,<6; found {transformers.__version__}. "
            "Install a supported version: pip install 'transformers>=5,<6'"
        )


@contextlib.contextmanager
def _library_bars_off():
    """transformers' own progress bars ("Writing model shards" at every checkpoint save, "Loading weights" when a
    checkpoint is loaded) are off while the training bar is on screen, so they do not interleave with it; the
    previous setting is restored afterwards (``transformers.utils.logging.enable/disable_progress_bar``)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class _BudgetGuard(TrainerCallback):
    """Stops training (as HF's own stop) once the next step would exceed the target ε — e.g. after a
    resume that counted steps an interrupted run took past its checkpoint."""

    def __init__(self, trainer: "DPTrainer"):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        # every step taken is on record before any output of it is written; ε only if already known (an accountant
        # call per step costs 0.1-0.5 s with PRV; saves and logs compute it)
        self.trainer._record_spent(compute_epsilon=False)
        opt = self.trainer._dp_optimizer
        if opt is not None and opt.max_epsilon is not None and state.global_step < state.max_steps and opt._would_exceed_budget():
            logger.warning(
                "hf_dp: stopping at step %d: one more step would spend more than the target epsilon=%s",
                state.global_step, opt.max_epsilon,
            )
            control.should_training_stop = True
        return control


class DPTrainer(Trainer):
    """``transformers.Trainer`` with differential privacy (see the module docstring).

    Use exactly like ``Trainer`` with :class:`~hf_dp.arguments.DPTrainingArguments`. After training:
    ``get_epsilon()`` (ε spent), ``privacy_report()`` (all numbers of the guarantee).
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, **kwargs):
        _check_transformers_version()
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer needs args=DPTrainingArguments(...)")
        self.trainable_info = None
        self.privacy_spec: PrivacySpec | None = None
        if args.dp_enabled:
            if model is None:
                raise ValueError("DPTrainer needs a model (model_init is not supported with DP)")
            if kwargs.get("optimizers", (None, None))[0] is not None or kwargs.get("optimizer_cls_and_kwargs"):
                raise ValueError("DPTrainer builds its own DP optimizer from --optim; do not pass optimizers=")
            _refuse_sharding(args)  # before HF's own FSDP checks (one process: "fsdp only works in distributed training")
            contract.check_head(model)  # a head whose loss DPTrainer does not compute as the model would
        if model is not None:
            # --trainable applies to non-private baselines too, so that they train the same parameters
            lora_config = {"r": args.lora_r, "lora_alpha": args.lora_alpha} if args.trainable == "lora" else None
            model, self.trainable_info = apply_trainable(model, args.trainable, lora_config)
            if args.dp_enabled and sharding.fsdp_requested(args):  # FSDP2 under DP: hf_dp.clipping.sharding
                sharding.check_model(model)
                sharding.check_processes(args)
        #: how each example's loss is computed under DP (hf_dp.models.loss; check_head refused heads without one)
        self.objective = (objective_for(model) or OBJECTIVES["sequence_classification"]) if model is not None else None
        self._fingerprint_source, self._train_fingerprint = train_dataset, None  # before any caching
        self._dp_init_kwargs = dict(kwargs)  # what a private selection's trials are built with (hf_dp.tuning.search)
        # --audit_canaries: the included canaries appended (the real rows stay the fingerprint's source; hf_dp.audit.canaries)
        train_dataset = canaries.attach(self, model, args, train_dataset, kwargs.get("processing_class"))
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        if args.dp_enabled:
            _check_eval_is_not_train(self.eval_dataset, self.train_dataset)
        self._prefix_cache, self.prefix_cache = False, None
        if args.cache_frozen_features:
            self._enable_prefix_cache()
        if args.dp_enabled:
            self.loss_is_scaled_for_ga = True  # our compute_loss returns a per-logical-batch quantity
            self._setup_privacy()
            self.add_callback(_BudgetGuard(self))

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        sharding.enable_on_cpu(self)  # --fsdp on CPU/gloo: the plugin Accelerate drops there (hf_dp.clipping.sharding)

    # ------------------------------------------------------------------------------------------------
    # frozen-prefix caching (--cache_frozen_features): hf_dp.models.cache_manager
    # ------------------------------------------------------------------------------------------------
    def _enable_prefix_cache(self) -> None:
        check_no_full_eval_cast(self.args)  # again: the arguments may have been changed after they were made
        self.prefix_cache = PrefixCacheManager(self.model, self.args, self.trainable_info, self.data_collator)
        self._prefix_cache = True
        self.train_dataset, self.eval_dataset = self.prefix_cache.cache_all(self.train_dataset, self.eval_dataset)
        self.data_collator = CachedFeaturesCollator()
        self._set_signature_columns_if_needed()  # else HF's column removal drops the cached keys
        for key in (CACHED_HIDDEN_KEY, PREFIX_SIGNATURE_KEY):
            if key not in self._signature_columns:
                self._signature_columns.append(key)

    def _suffix_ctx(self):
        """Forward-pass context for train/evaluate/predict (:func:`hf_dp.models.cache_manager.forward_context`)."""
        return forward_context(self.model, self.prefix_cache, getattr(self.args, "first_token_only", "auto"))

    def _check_not_train(self, dataset) -> None:
        """Under DP, at every evaluate() / predict(): the data evaluated is not (and does not overlap) the training
        set, whatever was passed at construction, nor the held-out private set a private selection scored its trials
        on (:func:`hf_dp.tuning.search.refuse_evaluating_the_score_set`)."""
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):
            dataset = self.eval_dataset.get(dataset)
        if getattr(self, "private_score_sets", None):
            from hf_dp.tuning.search import refuse_evaluating_the_score_set

            refuse_evaluating_the_score_set(self, dataset)
        if not self.args.dp_enabled:
            return
        for train in {id(x): x for x in (self._fingerprint_source, self.train_dataset) if x is not None}.values():
            _check_eval_is_not_train(dataset, train)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        self._check_not_train(eval_dataset if eval_dataset is not None else self.eval_dataset)
        if self._prefix_cache and eval_dataset is not None and not isinstance(eval_dataset, (str, dict)):
            eval_dataset = self.prefix_cache.cache(eval_dataset, metric_key_prefix)
        with self._suffix_ctx():
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
        self._check_not_train(test_dataset)
        if self._prefix_cache:
            test_dataset = self.prefix_cache.cache(test_dataset, metric_key_prefix)
        with self._suffix_ctx():
            return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------------
    def _setup_privacy(self) -> None:
        args = self.args
        if self.train_dataset is None:
            raise ValueError("DP training needs a train_dataset (its size N defines q and delta < 1/N)")
        try:
            n = len(self.train_dataset)
        except TypeError:
            raise ValueError("DP training needs a sized train_dataset (an IterableDataset cannot be Poisson-sampled)") from None
        if n == 0:
            raise ValueError("the training dataset is empty")
        contract.check_labels(self._fingerprint_source, getattr(self.model, "config", None), self.objective)
        contract.check_token_ids(self._fingerprint_source, getattr(self.model, "config", None))
        self._setup_units(n)
        canaries.extend_units(self, n)  # --audit_canaries: one unit per canary, included or not (N = real + m)
        n = self.num_units
        world = max(1, args.world_size)
        self.privacy_spec, steps_per_epoch, self.planned_epsilon = plan_mechanism(
            n=n, per_device_batch=args.per_device_train_batch_size, accumulation=args.gradient_accumulation_steps,
            world_size=world, delta=args.delta, epsilon=args.epsilon, noise_multiplier=args.noise_multiplier,
            max_grad_norm=args.per_sample_max_grad_norm, accountant=args.accountant, max_steps=args.max_steps,
            num_train_epochs=args.num_train_epochs,
        )
        spec = self.privacy_spec
        q, b, planned, sigma = spec.sample_rate, int(spec.expected_batch_size), spec.planned_steps, spec.noise_multiplier
        self.ledger = PrivacyLedger(spec)
        self.ledger.meta["privacy_unit"] = args.privacy_unit_column  # each run's record says what it protected
        lineage.adopt_model_ledger(self)  # the earlier runs the model carries (--prior_privacy; hf_dp.run.lineage)
        self.randomness = source_name(args.dp_seed, args.secure_rng)
        if self.randomness == SEEDED:
            logger.warning(
                "hf_dp: --dp_seed %s fixes the Poisson batches and the noise: anyone who knows the seed can "
                "recompute them and remove the noise from the released model. Use it for reproducible research "
                "only, and never reuse a seed: two runs with the same seed on datasets that differ in one "
                "example reveal that example's clipped gradient exactly. The seed is recorded in privacy.json "
                "and the model card.", args.dp_seed,
            )
        self._dp_sampler = PoissonBatchSampler(
            n, q, steps_per_epoch, micro_batches=args.gradient_accumulation_steps, seed=args.dp_seed,
            rank=args.process_index, world_size=world, secure=args.secure_rng, position=lambda: self.ledger.steps,
            units=self._unit_rows, max_rows_per_unit=args.max_rows_per_unit, allow_empty_units=self._audit is not None,
            stream_tag=lambda: self.ledger.meta.get("stream_tag"),
        )
        self._lengths_of = None
        self._set_sampler_lengths()  # refused here, before any step, if the lengths are unknown
        self._dp_noise_seed = args.dp_seed
        #: the run's lineage: a random public id written with every record of steps taken (a resume is a new run, its
        #: parent the checkpoint's run); under --dp_seed, a resume that is not a clean continuation keys its seeded
        #: streams with it (ledger.meta["stream_tag"], hf_dp.run.checkpointing.reconcile_resumed_ledger)
        self.run_id = secrets.token_hex(8)
        self._dp_optimizer: PrivateOptimizer | None = None
        self._loss_scale: float | None = None
        self._units: torch.Tensor | None = None  # the micro-batch's privacy units (rows -> 0..U-1), --privacy_unit_column
        self._empty_micro_batch = False
        self.clipping = self._choose_clipping(world)  # the engine's name (hf_dp.clipping.engines)
        self.clipping_engine: ClippingEngine = make_engine(self.clipping, self.model)
        self.ghost_clipper, self.grad_sampler = self.clipping_engine.clipper, self.clipping_engine.grad_sampler
        # the planner's start-of-run block (hf_dp.plan): public quantities only, no extra calibration
        from hf_dp.plan import run_block

        d = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        block, warning = run_block(n=n, batch_size=b, steps=planned, sigma=sigma, delta=args.delta, accountant=args.accountant,
                                   max_grad_norm=args.per_sample_max_grad_norm, params=d, epsilon=args.epsilon)
        logger.info(block)
        if warning:
            logger.warning(warning)
        self._contract_probe, self._rows_checked, self._several_rows = False, None, False
        self._planned_train_dataset = self.train_dataset
        #: the mechanism σ, q and the steps were planned for: every train() and every step must still run it
        self._planned_mechanism = contract.mechanism_snapshot(self)

    def _setup_units(self, rows: int) -> None:
        """``--privacy_unit_column``: the rows of each unit, read once from the training set given at construction
        (before any column removal); N = the number of units. Without it every row is its own unit."""
        col = self.args.privacy_unit_column
        self._unit_rows, self._unit_of_row = None, None
        self.num_units = rows
        if col is None:
            return
        if self._prefix_cache:
            raise ValueError(
                "--privacy_unit_column with --cache_frozen_features is not supported yet: the cache does not keep the "
                "unit column; drop one of the two flags"
            )
        self._unit_rows = _unit_rows(self._fingerprint_source, col)
        unit_of_row = torch.empty(rows, dtype=torch.long)
        for j, r in enumerate(self._unit_rows):
            unit_of_row[r] = j
        self._unit_of_row = unit_of_row
        self.num_units = len(self._unit_rows)

    def _choose_clipping(self, world: int) -> str:
        """``--clipping``: ``ghost`` (one backward pass) where it applies, else Opacus hooks; ``ghost_two_pass`` only
        when asked for (:func:`hf_dp.clipping.engines.choose_engine`). Any number of processes: under DDP every engine
        runs its forward/backward without DDP's gradient all-reduce (see :meth:`compute_loss`), and the privatizer
        all-reduces the noisy clipped sum once per logical batch. FSDP and DeepSpeed are refused."""
        _refuse_sharding(self.args, getattr(self, "is_fsdp_enabled", False), getattr(self, "is_deepspeed_enabled", False))
        self._fsdp = bool(getattr(self, "is_fsdp_enabled", False))
        if self._fsdp:  # FSDP2: two-pass ghost clipping only (hf_dp.clipping.sharding)
            if self.args.clipping == "auto":
                logger.info("hf_dp: --clipping auto chose ghost_two_pass: the only engine supported under FSDP")
            return choose_engine("ghost_two_pass", self.model, optim=self.args.optim, rule_cls=get_entry(self.args.optim).rule_cls,
                                 reduced_precision=bool(self.args.bf16 or self.args.fp16), logger=logger)
        return choose_engine(self.args.clipping, self.model, optim=self.args.optim, rule_cls=get_entry(self.args.optim).rule_cls,
                             reduced_precision=bool(self.args.bf16 or self.args.fp16), logger=logger)

    # ------------------------------------------------------------------------------------------------
    # data
    # ------------------------------------------------------------------------------------------------
    def _set_sampler_lengths(self) -> None:
        """group_by_length: the Poisson sampler orders each draw by these lengths (in memory only); else no order."""
        if not _group_by_length(self.args):
            self._dp_sampler.lengths, self._lengths_of = None, None
        elif self._lengths_of is not self.train_dataset:  # computed once per dataset object
            self._dp_sampler.lengths = example_lengths(self.train_dataset, self.args.length_column_name)
            self._lengths_of = self.train_dataset

    def _get_train_sampler(self, train_dataset=None):
        if self.args.dp_enabled:
            return None  # get_train_dataloader draws with the Poisson sampler; HF's would only be built and dropped
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if _group_by_length(self.args) and isinstance(dataset, CachedFeatures):  # HF reads lengths from input_ids
            return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                        lengths=dataset.lengths.tolist())
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        if _group_by_length(self.args):
            if self.args.dp_enabled:
                # group_by_length orders the training draws only: HF's grouped eval sampler would permute the rows of
                # predict() (a recipe's predictions file) — the recipes turn the strategy on by default under DP
                return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None
            if isinstance(eval_dataset, CachedFeatures):  # HF's grouping, with the cache's own lengths
                seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
                return LengthGroupedSampler(self.args.eval_batch_size, lengths=eval_dataset.lengths.tolist(),
                                            generator=torch.Generator().manual_seed(seed))
        return super()._get_eval_sampler(eval_dataset)

    def get_train_dataloader(self) -> DataLoader:
        base = super().get_train_dataloader()  # HF's column removal, collator, worker settings
        if not self.args.dp_enabled:
            return base
        dataset = base.dataset
        if len(dataset) != self._dp_sampler.num_rows:
            raise ValueError(
                f"the training dataset has {len(dataset)} rows, but this DPTrainer calibrated the noise for "
                f"{self._dp_sampler.num_rows} rows (N = {self._dp_sampler.num_samples}, q = B/N, delta < 1/N): "
                "train_dataset was replaced after the trainer was made; make a new DPTrainer for other data"
            )
        self._set_sampler_lengths()
        units = self._unit_of_row is not None
        if units:
            dataset = _UnitTagged(dataset, self._unit_of_row)
        return _PoissonDataLoader(
            dataset,
            batch_sampler=self._dp_sampler,
            collate_fn=_EmptySafeCollator(base.collate_fn, dataset, units=units, unit_column=self.args.privacy_unit_column,
                                          attribute=self._several_rows),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and torch.accelerator.is_available(),  # no CPU-only warning
        )

    # ------------------------------------------------------------------------------------------------
    # optimizer
    # ------------------------------------------------------------------------------------------------
    def _param_groups(self, model=None) -> list[dict]:
        """HF's decay / no-decay parameter groups, built as ``Trainer.create_optimizer`` builds them."""
        opt_model = self.model if model is None else model
        decay = self.get_decay_parameter_names(opt_model)
        named = list(opt_model.named_parameters())
        return [
            {"params": [p for n, p in named if n in decay and p.requires_grad], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay and p.requires_grad], "weight_decay": 0.0},
        ]

    def create_optimizer(self, model=None):
        if not self.args.dp_enabled:
            return super().create_optimizer(model)
        if self.optimizer is None:
            args, spec = self.args, self.privacy_spec
            hyper = rule_hyperparameters(
                args.optim, lr=args.learning_rate, weight_decay=args.weight_decay, optim_args=args.optim_args,
                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, gamma=args.bc_gamma,
                h1=args.macadam_h1, h2=args.macadam_h2,
            )
            self.optimizer = make_optimizer(
                args.optim, self._param_groups(model),
                noise_multiplier=spec.noise_multiplier, max_grad_norm=spec.max_grad_norm,
                expected_batch_size=spec.expected_batch_size, noise_seed=self._dp_noise_seed,
                secure_mode=args.secure_rng, ledger=self.ledger, max_epsilon=spec.target_epsilon, **hyper,
            )
            self.optimizer.sampler = self._dp_sampler
            if hasattr(self.optimizer.rule, "clamp_rate_every"):  # BC diagnostic only at the steps that are logged
                steps = args.logging_steps
                self.optimizer.rule.clamp_rate_every = int(steps) if steps >= 1 else 1
            if spec.target_epsilon is not None:
                self.optimizer.budget_steps = spec.planned_steps  # calibrate_noise_multiplier verified ε(planned) ≤ target
            self._dp_optimizer = self.optimizer
        return self.optimizer

    # ------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------
    def _capture_loss_scale(self, grad: torch.Tensor) -> None:
        self._loss_scale = float(grad.detach().float().reshape(-1)[0])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.args.dp_enabled or not model.training:
            inputs.pop(_EMPTY_KEY, None)
            inputs.pop(_UNITS_KEY, None)
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        empty = bool(inputs.pop(_EMPTY_KEY, False))
        units = inputs.pop(_UNITS_KEY, None)
        if "labels" not in inputs:
            raise ValueError(
                "the training batch has no 'labels': DP training computes each example's loss from them (a causal LM's "
                "collator makes them: DataCollatorForLanguageModeling(tokenizer, mlm=False))"
            )
        labels = inputs.pop("labels")
        objective = self.objective
        if objective.positions_from_mask and "position_ids" not in inputs and torch.is_tensor(inputs.get("attention_mask")):
            # each row's positions count its own tokens: a left-padded row's must not depend on the batch's padding
            inputs["position_ids"] = positions_from_mask(inputs["attention_mask"])
        # Under DDP the forward runs in no_sync for every micro-batch, the last one included: DDP's reducer then
        # expects no gradient (ghost clipping leaves none for linear weights) and all-reduces nothing — it would
        # only average the raw, unclipped gradients, which no DP engine uses. Each rank clips its own examples; the
        # privatizer adds the noise on rank 0 and all-reduces the noisy sum once per logical batch.
        sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) else contextlib.nullcontext()
        with sync:
            outputs = model(**inputs)
        contract.check_logits(outputs.logits, labels, objective)
        losses = per_example_loss(outputs.logits, labels, self.model.config, objective, inputs.get("attention_mask"))
        self._empty_micro_batch = empty
        self._units = None if units is None else units.to(losses.device)
        fsdp = getattr(self, "_fsdp", False) and sharding.is_fsdp_model(model)
        if fsdp:  # every micro-batch's pass 2 reduce-scattered, summed over ranks (hf_dp.clipping.sharding)
            sharding.prepare_micro_batch(model)
        # ghost_two_pass: its pass 1 (the norms) runs here; under FSDP on every rank for every micro-batch, the empty
        # one's placeholder included (its loss is then multiplied by 0), so that the ranks' all-gathers stay in step
        if (not empty or fsdp) and not self._contract_probe:
            losses = self.clipping_engine.before_backward(losses, self._dp_optimizer, **self._unit_kw())
        total = losses.sum() * 0.0 if empty else losses.sum()
        if total.requires_grad:
            total.register_hook(self._capture_loss_scale)
        self._rows_in_batch = labels.shape[0]
        loss = total / (self.privacy_spec.expected_batch_size / max(1, self.args.world_size))
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.dp_enabled:  # every micro-batch (a few comparisons): the arguments (a callback may change them)
            # and the optimizer HF steps (still the privatizer, with σ, C and B planned) are what the accountant was told
            contract.check_mechanism(self._planned_mechanism, contract.mechanism_snapshot(self, with_parameters=False))
            contract.check_optimizer(self)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.args.dp_enabled:
            if self._loss_scale is None:
                raise RuntimeError("internal error: the loss-scale hook did not fire during backward")
            if getattr(self, "_fsdp", False):  # the ranks' gradients were summed before each undoes its own scale
                if not sharding.is_fsdp_model(self.model):
                    raise RuntimeError("--fsdp was given but Accelerate did not shard the model (fully_shard); refusing "
                                       "to train it as another parallel mode")
                sharding.check_loss_scale_agrees(self._loss_scale)
            if self._empty_micro_batch and not getattr(self, "_fsdp", False):
                # (under FSDP the gradients are already the sum over ranks: the placeholder's part, 0, stays in it)
                # the placeholder row of an empty micro-batch contributes nothing — not even a rule's per-sample
                # offset (DP-SGD-L2's λθ, DP-MacAdam's −m̂/b), which would otherwise make a neighbouring dataset's
                # sum differ by up to 2C when its one extra example is the only one in the micro-batch
                self._discard_micro_batch()
            else:  # the clipped sum (ghost) or the per-sample gradients (hooks) go to the privatizer
                self.clipping_engine.after_backward(self._dp_optimizer, self._loss_scale, self._rows_in_batch, **self._unit_kw())
            self._loss_scale, self._units = None, None
        return loss

    def _unit_kw(self) -> dict:
        """``units=`` for the engine under ``--privacy_unit_column`` (rows -> 0..U-1); nothing when each row is a unit."""
        return {} if self._units is None else {"units": self._units}

    def _discard_micro_batch(self) -> None:
        """Drop what the backward of an empty micro-batch's placeholder row left (records, per-sample gradients)."""
        self.clipping_engine.discard(self._dp_optimizer)

    # ------------------------------------------------------------------------------------------------
    # privacy reporting
    # ------------------------------------------------------------------------------------------------
    def get_epsilon(self) -> float:
        """ε spent so far at δ (0 before training; ``inf`` for a non-private run)."""
        if not self.args.dp_enabled:
            return math.inf
        selection = getattr(self, "hyperparameter_selection", None)
        if selection is not None:  # the model a private selection released: the selection's total (hf_dp.tuning.search)
            return float(selection["total_epsilon"])
        return self.ledger.get_epsilon()  # the ledger counts every noisy step, an interrupted run's included

    def _record_spent(self, compute_epsilon: bool = True) -> None:
        """Write the record of steps taken (the count is what resumes rely on; ε is informative, and with
        ``compute_epsilon=False`` written only when the ledger already has it), the run's records in the checkpoints
        it resumed from, and the model's public ledger record (:func:`hf_dp.run.lineage.record_spent`)."""
        if self.args.dp_enabled:
            lineage.record_spent(self, compute_epsilon)
        else:
            lineage.mark_non_private(self)  # a DP-trained model trained further without DP: its config says so

    def floating_point_ops(self, inputs) -> int:
        """0 under DP: HF adds 6·params·(tokens of every private Poisson batch, padding included) into
        ``state.total_flos``, logged as ``total_flos`` and saved in ``trainer_state.json`` — a statistic of the
        batch sizes and lengths outside the mechanism, like ``include_num_input_tokens_seen``."""
        return 0 if self.args.dp_enabled else super().floating_point_ops(inputs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.args.dp_enabled:
            logs.pop("grad_norm", None)  # norm of the non-private gradient: never logged
            self._record_spent()  # persisted before it is reported (see hf_dp.run.checkpointing)
            logs["epsilon"] = self.get_epsilon()
            rule = getattr(self._dp_optimizer, "rule", None)
            if getattr(rule, "last_clamp_rate", None) is not None:
                logs["bc_clamp_rate"] = rule.last_clamp_rate
        super().log(logs, start_time)

    def privacy_report(self) -> dict:
        """All numbers of the guarantee, as written to ``privacy.json`` and the model card (see :mod:`hf_dp.hub.report`)."""
        return report.privacy_report(self) if self.args.dp_enabled else report.non_private_report(self)

    # ------------------------------------------------------------------------------------------------
    # saving
    # ------------------------------------------------------------------------------------------------
    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: float = 20, direction="minimize",
                              backend=None, hp_name=None, *, model_init=None, distribution="geometric", eta=None,
                              score_data=None, score_dataset=None, score_noise_multiplier=None, example_score=None,
                              **kwargs):
        """Under DP: private selection (``backend="dp_random_stopping"``, :mod:`hf_dp.tuning.search`): the best of K
        fresh DP runs, K random with mean ``n_trials`` (``distribution``: geometric, logarithmic, negative_binomial
        with ``eta``, poisson), each with a configuration drawn from ``hp_space`` (a dict ``{flag: [choices]}`` or HF's
        function ``trial -> dict``) and a model from ``model_init``, scored by ``compute_objective(evaluate())`` on an
        eval set declared public (``score_data="public"``) or by a DP score on held-out private data
        (``score_data="private"``: ``score_dataset``, ``example_score``, ``score_noise_multiplier``; its cost is in the
        total); each trial's σ is calibrated so that the selection's total ε meets ``--epsilon``. Afterwards this
        trainer holds the best trial's model, and ``get_epsilon()`` and
        ``privacy.json`` report the total. Without DP: HF's own search."""
        if not self.args.dp_enabled:
            return super().hyperparameter_search(hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)
        from hf_dp.tuning import search

        if kwargs:
            raise ValueError(f"hyperparameter_search under DP takes no backend options ({', '.join(sorted(kwargs))})")
        return search.run_search(self, hp_space=hp_space, compute_objective=compute_objective, n_trials=n_trials,
                                 direction=direction, backend=backend, model_init=model_init,
                                 distribution=distribution, eta=eta, score_data=score_data, hp_name=hp_name,
                                 score_dataset=score_dataset, score_noise_multiplier=score_noise_multiplier,
                                 example_score=example_score)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        if getattr(self, "hyperparameter_selection", None) is not None:
            from hf_dp.tuning.search import refuse_train_after_selection

            refuse_train_after_selection(self)
        # only complete checkpoints (with hf_dp's marker) are resumed from; see hf_dp.run.checkpointing
        resume_from_checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if self.args.dp_enabled and resume_from_checkpoint is not None:  # FSDP's sharded checkpoints (hf_dp.clipping.sharding)
            sharding.check_resume(resume_from_checkpoint, checkpointing.read_marker(resume_from_checkpoint),
                                  getattr(self, "_fsdp", False), self.args.world_size)
        self.resumed_from = resume_from_checkpoint
        canaries.before_train(self, resume_from_checkpoint)  # --audit_canaries: no resume, one train()
        if self.args.dp_enabled and self._dp_optimizer is not None:
            # an interrupted step's clipped sums (e.g. an exception between micro-batches) never reach a later step
            self._dp_optimizer.discard_pending()
            self.clipping_engine.clear()
            opt = self._dp_optimizer
            if resume_from_checkpoint is None and opt.max_epsilon is not None and opt._would_exceed_budget():
                raise ValueError(
                    f"refusing to train: {self.ledger.steps} noisy steps were already taken (epsilon "
                    f"{self.get_epsilon():.4g}); one more would exceed the target epsilon={opt.max_epsilon}"
                )
        lineage.before_train(self, resume_from_checkpoint)  # the model's ledger, another run's checkpoints (hf_dp.run.lineage)
        with self._suffix_ctx(), _library_bars_off():
            if self.args.dp_enabled:
                self._check_contract()
            out = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        canaries.after_train(self)  # --audit_canaries: score, bound (trainer.audit_record), drop the draw
        return out

    def num_examples(self, dataloader) -> int:
        # --audit_canaries: HF logs this (and derives train_samples_per_second from it) — real rows + m, not + included
        if getattr(self, "_audit", None) is not None and isinstance(dataloader, _PoissonDataLoader):
            return self._audit.public_rows
        return super().num_examples(dataloader)

    def _check_contract(self) -> None:
        """At every ``train()``, before any step (see :mod:`hf_dp.run.contract`): the mechanism is still the one planned,
        every rank holds the same data in the same order, and each example's loss depends on that example alone."""
        if self.train_dataset is not self._planned_train_dataset:
            raise ValueError(
                "train_dataset was replaced after the DPTrainer was built: N, the fingerprint that resumes, ranks and "
                "the model's ledger compare, and the label checks describe the dataset given at construction; make a "
                "new DPTrainer for other data"
            )
        contract.check_flags(self.args)  # HF flags refused under DP, also when set on trainer.args after construction
        contract.check_mechanism(self._planned_mechanism, contract.mechanism_snapshot(self))
        if self.args.world_size > 1:
            contract.check_ranks_agree(self._train_data_info()["sha256"], self._planned_mechanism)
        if self._rows_checked is not self.data_collator:  # the dataset is fixed (above); again if the collator changed
            loader = self.get_train_dataloader()
            outcome = contract.check_every_row(loader.dataset, loader.collate_fn, getattr(self.model, "config", None), self.objective)
            # a collator seen to emit several rows (or none) for one example: every micro-batch's rows are attributed
            # to their examples, also when the row count happens to equal the number of examples drawn
            self._several_rows = outcome.endswith("several rows per example")
            self._rows_checked = self.data_collator
        outcome = contract.probe_independence(self)
        if outcome != "passed":
            logger.warning("hf_dp: the per-example contract could not be verified on a probe micro-batch (%s)", outcome)

    def _load_optimizer_and_scheduler(self, checkpoint):  # private HF API: see HF_PRIVATE_OVERRIDES
        # steps taken by an earlier train() of this trainer (not those of earlier runs its ledger started from)
        taken_here = (self.ledger.steps if getattr(self, "resumed_ledger_steps", None) is not None else self.ledger.own_steps) if self.args.dp_enabled else 0
        if checkpoint is not None and self._prefix_cache:
            evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
            self.prefix_cache.check_after_resume([("train", self.train_dataset)] + [("eval", v) for v in evals], checkpoint)
        if checkpoint is not None and self.args.dp_enabled and getattr(self, "_fsdp", False):
            sharding.load_checkpoint_state(self, checkpoint)  # the privatizer's sharded state, the ledger, the scheduler
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if self.args.dp_enabled:
            lineage.after_optimizer_load(self, checkpoint)
        if checkpoint is not None and self.args.dp_enabled:
            checkpointing.reconcile_resumed_ledger(self, checkpoint, taken_here)

    def _train_data_info(self) -> dict:
        """N and a SHA-256 fingerprint of the training set (before any caching), recorded in checkpoint markers."""
        if self._train_fingerprint is None:
            self._train_fingerprint = checkpointing.dataset_fingerprint(self._fingerprint_source)
        return {"num_samples": self.privacy_spec.dataset_size, "sha256": self._train_fingerprint}

    def _save_checkpoint(self, model, trial):  # private HF API: see HF_PRIVATE_OVERRIDES
        # HF writes checkpoint-N in place, then rotates old checkpoints; we defer the rotation until the
        # completion marker is on disk, so a complete checkpoint exists at every instant.
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self._record_spent()
        if self.args.should_save and os.path.isdir(folder):
            checkpointing.remove_marker(folder)
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        self._saving_checkpoint = True  # save_model writes a checkpoint's model, not a release (not the folder's name)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
            self._saving_checkpoint = False
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()  # every rank's files (rng_state_i.pth; FSDP: its shards) are written
        if self.args.should_save:
            checkpointing.write_marker(folder, self._checkpoint_info())
            rotate_checkpoints(
                output_dir=self._get_output_dir(trial=trial),
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:  # private HF API: see HF_PRIVATE_OVERRIDES
        if self.args.dp_enabled and getattr(self, "_fsdp", False):
            sharding.save_checkpoint_state(self, output_dir)  # the model's and the privatizer's shards, the scheduler
        else:
            super()._save_optimizer_and_scheduler(output_dir)

    def _checkpoint_info(self) -> dict:
        info = {"hf_dp_version": __version__, "global_step": self.state.global_step, "differential_privacy": self.args.dp_enabled}
        if getattr(self, "is_fsdp_enabled", False):  # sharded: resumed under FSDP with as many processes (hf_dp.clipping.sharding)
            info["fsdp"] = {"world_size": self.args.world_size}
        if self.args.dp_enabled:
            info.update(
                ledger_steps=self.ledger.steps, epsilon=self.get_epsilon(), privacy_spec=self.privacy_spec.as_dict(),
                train_data=self._train_data_info(), run_id=self.run_id,
            )
        return info

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        output_dir = output_dir or self.args.output_dir
        # a checkpoint iff called from _save_checkpoint (a release folder may be named "checkpoint-…" too)
        is_checkpoint = getattr(self, "_saving_checkpoint", False)
        self._record_spent()  # on record (and in the model's config.json: hf_dp.run.lineage) before the model is written
        if getattr(self, "_fsdp", False) and sharding.is_fsdp_model(self.model) and is_checkpoint and not self.args.save_only_model:
            # FSDP2, a checkpoint: the model stays sharded (its shards are written with the optimizer's, by
            # _save_optimizer_and_scheduler: hf_dp.clipping.sharding.save_checkpoint_state); rank 0 writes its config
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                self.model.config.save_pretrained(output_dir)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        elif getattr(self, "_fsdp", False) and sharding.is_fsdp_model(self.model):
            # FSDP2: the full model gathered from the shards (every rank takes part), written by rank 0 as a plain
            # save_pretrained folder (HF's own FSDP save path reads the Accelerate state, see hf_dp.clipping.sharding)
            state_dict = sharding.full_state_dict(self.model)
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                release = sharding.plain_release(self.model, state_dict)  # LoRA: merged, as without FSDP
                release.save_pretrained(output_dir, state_dict=None if release is not self.model else state_dict)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        # LoRA: the release is the merged plain model, DP or not (an adapter alone cannot be loaded without its base)
        elif self.trainable_info is not None and self.trainable_info.mode == "lora" and not is_checkpoint:
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                unwrap_for_save(self.model).save_pretrained(output_dir)
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        else:
            super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:  # non-private runs too: their card says so and records what was trained
            self._record_spent()
            self._write_privacy_files(output_dir)
            checkpointing.apply_umask(output_dir, ("*.safetensors", "*.bin"))  # HF writes the weights 0600

    def _write_privacy_files(self, output_dir: str, eval_results: dict | None = None) -> None:
        eval_results = eval_results if eval_results is not None else report.latest_eval_metrics(self.state.log_history)
        # base model, task, labels, data and title from what was set on the trainer, else the config and dataset
        write_privacy_artifacts(output_dir, self.privacy_report(), eval_results=eval_results, **card_fields(self))

    def create_model_card(self, *args, **kwargs):
        # hf_dp's card for non-private runs too (it says non-private, once): HF's card would replace it
        if self.is_world_process_zero():
            self._write_privacy_files(self.args.output_dir)
