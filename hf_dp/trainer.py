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
  into ``gradient_accumulation_steps`` micro-batches per rank (one above the run's public token bound is split in
  ``training_step``, :func:`hf_dp.run.data.split_to_bounds`).
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
  (``--fsdp full_shard``) ghost clipping runs on the shards (one backward by default, its clipped sums
  reduce-scattered: :mod:`hf_dp.clipping.fsdp_ghost`) and each rank adds the noise to its own shard
  (:mod:`hf_dp.clipping.sharding`); DeepSpeed is refused under DP (docs/fsdp.md).
* ``log``: adds ``epsilon`` (spent so far) and drops HF's ``grad_norm`` (the *non-private* gradient's norm). The
  logged training loss is **not** private (computed from the private batch); eval metrics are the eval set's.
* ``hyperparameter_search``: under DP, private selection (:mod:`hf_dp.tuning.search`): the best of a random number of
  fresh DP runs, ε the selection's total (``backend="dp_random_stopping"``; without DP, HF's own search).
* ``save_model`` / ``create_model_card``: a plain ``PreTrainedModel`` (LoRA merged), the tokenizer,
  ``privacy.json`` and a model card stating the guarantee.

Checkpoints (:mod:`hf_dp.run.checkpointing`, :mod:`hf_dp.run.spent`): HF's optimizer state carries the rule state and
the ledger, no seed: batches and noise are fresh after a resume (:mod:`hf_dp.privacy.randomness`). ``_save_checkpoint``
writes the completion marker after HF's files and before old checkpoints rotate; ``train(resume_from_checkpoint=…)``
resumes only from a complete checkpoint, refuses changed privacy settings or other training data, and ε counts every
noisy step ever taken, an interrupted run's past the checkpoint included. Under FSDP2 a checkpoint is sharded
(:mod:`hf_dp.clipping.sharding`) and resumes under FSDP with as many processes.

What the overrides hand off takes the trainer as an argument (:mod:`hf_dp.run`): ``setup``, ``data`` (the training
loader), ``contract`` (checks), ``spent`` (steps spent, the budget stop), ``release``, ``lineage`` (the model's ledger).
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator

import torch
from torch.utils.data import DataLoader, SequentialSampler
from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler

from hf_dp.arguments import DPTrainingArguments, check_no_full_eval_cast
from hf_dp.clipping import sharding
from hf_dp.run import checkpointing, contract, lineage, release, setup, spent
from hf_dp.audit import canaries
from hf_dp.hub import report, write_privacy_artifacts
from hf_dp.hub.describe import card_fields
from hf_dp.models import apply_trainable
from hf_dp.models.cache_manager import PrefixCacheManager, forward_context
from hf_dp.models.prefix_cache import CACHED_HIDDEN_KEY, PREFIX_SIGNATURE_KEY, CachedFeatures, CachedFeaturesCollator
from hf_dp.run.state import PrivacyState
from hf_dp.models.loss import OBJECTIVES, objective_for, per_example_loss, positions_from_mask
from hf_dp.run.data import EMPTY_KEY as _EMPTY_KEY, UNITS_KEY as _UNITS_KEY, PoissonDataLoader as _PoissonDataLoader
from hf_dp.run.data import check_eval_is_not_train as _check_eval_is_not_train, refuse_sharding as _refuse_sharding
from hf_dp.run.data import group_by_length, poisson_loader, split_to_bounds

logger = logging.getLogger(__name__)

# Private transformers API DPTrainer depends on: the one list to re-check on a transformers upgrade.
# Checked against transformers 5.23.0 and 5.24.0 (5.24 changed neither method; hf_dp.run.setup.check_transformers_version admits
# >=5.0,<6). Everything else DPTrainer overrides is public — __init__, get_train_dataloader,
# create_optimizer, compute_loss, training_step, log, train, evaluate, predict, save_model,
# create_model_card, create_accelerator_and_postprocess (--fsdp on CPU: hf_dp.clipping.sharding), num_examples,
# hyperparameter_search (under DP: hf_dp.tuning.search) — and the budget stop is a TrainerCallback (hf_dp.run.spent.BudgetGuard).
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


class DPTrainer(Trainer):
    """``transformers.Trainer`` with differential privacy (see the module docstring).

    Use exactly like ``Trainer`` with :class:`~hf_dp.arguments.DPTrainingArguments`. After training:
    ``get_epsilon()`` (ε spent), ``privacy_report()`` (all numbers of the guarantee).
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, **kwargs):
        setup.check_transformers_version()
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer needs args=DPTrainingArguments(...)")
        self.trainable_info = None
        self.dp = PrivacyState()  # the run's privacy state, filled by hf_dp.run.setup (hf_dp.run.state)
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
            self.add_callback(spent.BudgetGuard(self))

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        sharding.enable_on_cpu(self)  # --fsdp on CPU/gloo: the plugin Accelerate drops there (hf_dp.clipping.sharding)
        sharding.set_wrap_classes(self)  # --fsdp without layer classes: the model's own blocks (hf_dp.clipping.sharding)

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
        on (:func:`hf_dp.tuning.private_score.refuse_evaluating_the_score_set`)."""
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):
            dataset = self.eval_dataset.get(dataset)
        if self.dp.selection.score_sets:
            from hf_dp.tuning.private_score import refuse_evaluating_the_score_set

            refuse_evaluating_the_score_set(self, dataset)
        if not self.args.dp_enabled:
            return
        for train in {id(x): x for x in (self._fingerprint_source, self.train_dataset) if x is not None}.values():
            _check_eval_is_not_train(dataset, train)

    def _eval_cache(self, key: str | None = None):
        """The eval set(s) as the frozen-prefix cache, built when first needed (not before the first training step)."""
        if self._prefix_cache and self.eval_dataset is not None:
            self.eval_dataset = self.prefix_cache.cache_eval(self.eval_dataset, key)
        return self.eval_dataset

    def get_eval_dataloader(self, eval_dataset=None):
        if self._prefix_cache and self.eval_dataset is not None:  # the trainer's own eval set: cached when first read
            if eval_dataset is None or isinstance(eval_dataset, str):
                self._eval_cache(eval_dataset)
            elif eval_dataset is self.eval_dataset:  # HF's evaluate() passes the set itself
                eval_dataset = self._eval_cache()
        return super().get_eval_dataloader(eval_dataset)

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
        # the mechanism planned once (hf_dp.run.setup); --audit_canaries appends its units and wraps the engine
        setup.setup_privacy(self, audit_units=canaries.extend_units, audit_engine=canaries.wrap_engine)

    # ------------------------------------------------------------------------------------------------
    # data
    # ------------------------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        if self.args.dp_enabled:
            return None  # get_train_dataloader draws with the Poisson sampler; HF's would only be built and dropped
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if group_by_length(self.args) and isinstance(dataset, CachedFeatures):  # HF reads lengths from input_ids
            return LengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps,
                                        lengths=dataset.lengths.tolist())
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        if group_by_length(self.args):
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
        # the Poisson loader over HF's dataset and collator (hf_dp.run.data); --audit_kind gradient tags its canaries
        return poisson_loader(self, base, audit_parts=canaries.loader_parts)

    # ------------------------------------------------------------------------------------------------
    # optimizer
    # ------------------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if not self.args.dp_enabled:
            return super().create_optimizer(model)
        if self.optimizer is None:  # the privatizer over the update rule, planned at set-up (hf_dp.run.setup)
            self.optimizer = self.dp.optimizer = setup.make_private_optimizer(self, model)
            canaries.check_optimizer(self, self.dp.optimizer)  # --audit_kind gradient: a rule it can audit
        return self.optimizer

    # ------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------
    def _capture_loss_scale(self, grad: torch.Tensor) -> None:
        self.dp.step.loss_scale = float(grad.detach().float().reshape(-1)[0])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.args.dp_enabled or not model.training:
            inputs.pop(_EMPTY_KEY, None)
            inputs.pop(_UNITS_KEY, None)
            canaries.pop_rows(self, inputs)
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        empty = bool(inputs.pop(_EMPTY_KEY, False))
        units = inputs.pop(_UNITS_KEY, None)
        canary_rows = canaries.pop_rows(self, inputs)  # --audit_kind gradient: each row's canary id (-1: a real row)
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
        losses = canaries.zero_canary_losses(self, losses, canary_rows, empty)  # their gradient: the engine's wrapper
        self.dp.step.canary_loss = canaries.input_canary_loss(self, losses, canary_rows, empty)  # not in the logged loss
        self.dp.step.empty = empty
        self.dp.step.units = None if units is None else units.to(losses.device)
        fsdp = self.dp.fsdp and sharding.is_fsdp_model(model)
        if fsdp:  # every micro-batch's pass 2 reduce-scattered, summed over ranks (hf_dp.clipping.sharding)
            sharding.prepare_micro_batch(model)
        # ghost_two_pass: its pass 1 (the norms) runs here; under FSDP on every rank for every micro-batch, the empty
        # one's placeholder included (its loss is then multiplied by 0), so that the ranks' all-gathers stay in step
        if (not empty or fsdp) and not self.dp.contract.probe:
            losses = self.dp.engine.before_backward(losses, self.dp.optimizer, **self._unit_kw())
        total = losses.sum() * 0.0 if empty else losses.sum()
        if total.requires_grad:
            total.register_hook(self._capture_loss_scale)
        self.dp.step.rows = labels.shape[0]
        loss = total / (self.dp.spec.expected_batch_size / max(1, self.args.world_size))
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.args.dp_enabled:  # every micro-batch (a few comparisons): the arguments (a callback may change them)
            # and the optimizer HF steps (still the privatizer, with σ, C and B planned) are what the accountant was told
            contract.check_mechanism(self.dp.contract.planned, contract.mechanism_snapshot(self, with_parameters=False))
            contract.check_optimizer(self)
        if not self.args.dp_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        loss = None  # a micro-batch above the run's public token bound runs as several (hf_dp.run.data.split_to_bounds),
        parts = split_to_bounds(inputs, self.dp.bounds, fsdp=self.dp.fsdp)  # summed in float64
        with self.dp.engine.active(self.dp.optimizer), self.dp.optimizer.parts() if len(parts) > 1 else contextlib.nullcontext():
            for part in parts:
                out = canaries.logged_loss(self, super().training_step(model, part, num_items_in_batch))
                loss = out if loss is None else loss + out
                self._after_micro_batch()
        return loss

    def _after_micro_batch(self) -> None:
        if self.dp.step.loss_scale is None:
            raise RuntimeError("internal error: the loss-scale hook did not fire during backward")
        if self.dp.fsdp:  # the ranks' gradients were summed before each undoes its own scale
            if not sharding.is_fsdp_model(self.model):
                raise RuntimeError("--fsdp was given but Accelerate did not shard the model (fully_shard); refusing "
                                   "to train it as another parallel mode")
            sharding.check_loss_scale_agrees(self.dp.step.loss_scale)
        if self.dp.step.empty and not self.dp.fsdp:  # (FSDP: the placeholder's 0 is in the sum)
            # an empty micro-batch's placeholder row adds nothing, not even a rule's per-sample offset (λθ, −m̂/b: else
            # up to 2C between neighbours when the one extra example is alone in its micro-batch)
            self._discard_micro_batch()
        else:  # the clipped sum (ghost) or the per-sample gradients (hooks) go to the privatizer
            self.dp.engine.after_backward(self.dp.optimizer, self.dp.step.loss_scale, self.dp.step.rows, **self._unit_kw())
        self.dp.step.loss_scale, self.dp.step.units = None, None

    def _unit_kw(self) -> dict:
        """``units=`` for the engine under ``--privacy_unit_column`` (rows -> 0..U-1); nothing when each row is a unit."""
        return {} if self.dp.step.units is None else {"units": self.dp.step.units}

    def _discard_micro_batch(self) -> None:
        """Drop what the backward of an empty micro-batch's placeholder row left (records, per-sample gradients)."""
        self.dp.engine.discard(self.dp.optimizer)

    # ------------------------------------------------------------------------------------------------
    # privacy reporting
    # ------------------------------------------------------------------------------------------------
    def get_epsilon(self) -> float:
        """ε spent so far at δ (0 before training; ``inf`` for a non-private run)."""
        if not self.args.dp_enabled:
            return math.inf
        selection = self.dp.selection.record
        if selection is not None:  # the model a private selection released: the selection's total (hf_dp.tuning.search)
            return float(selection["total_epsilon"])
        return lineage.take_later_runs(self).ledger.get_epsilon()  # every step of the model, an interrupted run's included

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
            self._record_spent()  # persisted before it is reported (see hf_dp.run.spent)
            logs["epsilon"] = self.get_epsilon()
            rule = getattr(self.dp.optimizer, "rule", None)
            if getattr(rule, "last_clamp_rate", None) is not None:
                logs["bc_clamp_rate"] = rule.last_clamp_rate
        super().log(logs, start_time)

    def privacy_report(self) -> dict:
        """All numbers of the guarantee, as written to ``privacy.json`` and the model card (see :mod:`hf_dp.hub.report`)."""
        return report.privacy_report(lineage.take_later_runs(self)) if self.args.dp_enabled else report.non_private_report(self)

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
        if self.dp.selection.record is not None:
            from hf_dp.tuning.search import refuse_train_after_selection

            refuse_train_after_selection(self)
        # only complete checkpoints (with hf_dp's marker) are resumed from; see hf_dp.run.checkpointing
        resume_from_checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if self.args.dp_enabled and resume_from_checkpoint is not None:  # FSDP's sharded checkpoints (hf_dp.clipping.sharding)
            sharding.check_resume(resume_from_checkpoint, checkpointing.read_marker(resume_from_checkpoint),
                                  self.dp.fsdp, self.args.world_size)
        self.dp.lineage.resumed_from = resume_from_checkpoint
        canaries.before_train(self, resume_from_checkpoint)  # --audit_canaries: no resume, one train()
        if self.args.dp_enabled and self.dp.optimizer is not None:
            # an interrupted step's clipped sums (e.g. an exception between micro-batches) never reach a later step
            self.dp.optimizer.discard_pending()
            self.dp.engine.clear()
            opt = self.dp.optimizer
            if resume_from_checkpoint is None and opt.max_epsilon is not None and opt._would_exceed_budget():
                raise ValueError(
                    f"refusing to train: {self.dp.ledger.steps} noisy steps were already taken (epsilon "
                    f"{self.get_epsilon():.4g}); one more would exceed the target epsilon={opt.max_epsilon}"
                )
        lineage.before_train(self, resume_from_checkpoint)  # the model's ledger, another run's checkpoints (hf_dp.run.lineage)
        with self._suffix_ctx(), _library_bars_off():
            if self.args.dp_enabled:
                self._check_contract()
                setup.share_sampling_key(self)  # several ranks: the Poisson sampler's key of this train(), rank 0's
            try:
                out = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            except BaseException:
                canaries.after_train(self, failed=True)  # --audit_canaries: drop the draw; no second train() on it
                raise
            finally:
                self.dp.sampling_key = None  # forgotten: a later train() draws its own
        canaries.after_train(self)  # --audit_canaries: score, bound (trainer.dp.audit_record), drop the draw
        return out

    def num_examples(self, dataloader) -> int:
        # HF logs this and derives train_samples_per_second from it: the public N — the declared one (+ m canaries), else
        # units (+ m) under a unit column (rows are private there), else --audit_canaries' real rows + m (not + included)
        if isinstance(dataloader, _PoissonDataLoader) and self.args.public_dataset_size is not None:
            return int(self.dp.spec.dataset_size)
        if isinstance(dataloader, _PoissonDataLoader) and self.args.privacy_unit_column:
            return self.dp.units.count
        if isinstance(dataloader, _PoissonDataLoader) and self.dp.audit is not None:
            return self.dp.audit.public_rows
        return super().num_examples(dataloader)

    def _check_contract(self) -> None:
        """At every ``train()``, before any step: :func:`hf_dp.run.contract.check_at_train`."""
        contract.check_at_train(self)

    def _load_optimizer_and_scheduler(self, checkpoint):  # private HF API: see HF_PRIVATE_OVERRIDES
        # steps taken by an earlier train() of this trainer (not those of earlier runs its ledger started from)
        taken_here = (self.dp.ledger.steps if self.dp.lineage.resumed_ledger_steps is not None else self.dp.ledger.own_steps) if self.args.dp_enabled else 0
        if checkpoint is not None and self._prefix_cache:
            evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
            self.prefix_cache.check_after_resume([("train", self.train_dataset)] + [("eval", v) for v in evals], checkpoint)
        if checkpoint is not None and self.args.dp_enabled and self.dp.fsdp:
            sharding.load_checkpoint_state(self, checkpoint)  # the privatizer's sharded state, the ledger, the scheduler
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if self.args.dp_enabled:
            lineage.after_optimizer_load(self, checkpoint)
        if checkpoint is not None and self.args.dp_enabled:
            spent.reconcile_resumed_ledger(self, checkpoint, taken_here)

    def _train_data_info(self) -> dict:
        """N and a SHA-256 fingerprint of the training set (before any caching), recorded in checkpoint markers."""
        if self._train_fingerprint is None:
            self._train_fingerprint = checkpointing.dataset_fingerprint(self._fingerprint_source)
        return {"num_samples": self.dp.spec.dataset_size, "sha256": self._train_fingerprint}

    def _save_checkpoint(self, model, trial):  # private HF API: see HF_PRIVATE_OVERRIDES
        # the completion marker before HF's rotation of old checkpoints (hf_dp.run.checkpointing.save_around)
        with checkpointing.save_around(self, trial):
            super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:  # private HF API: see HF_PRIVATE_OVERRIDES
        if self.args.dp_enabled and self.dp.fsdp:
            sharding.save_checkpoint_state(self, output_dir)  # the model's and the privatizer's shards, the scheduler
        else:
            super()._save_optimizer_and_scheduler(output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        output_dir = output_dir or self.args.output_dir
        # a checkpoint iff called from _save_checkpoint (a release folder may be named "checkpoint-…" too)
        is_checkpoint = self.dp.saving_checkpoint
        self._record_spent()  # on record (and in the model's config.json: hf_dp.run.lineage) before the model is written
        # the plain model where HF's save would not write one (FSDP2's shards, LoRA merged): hf_dp.run.release
        if not release.save_model_folder(self, output_dir, is_checkpoint):
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


#: read-only views of the run's privacy state (``DPTrainer.dp``, :class:`hf_dp.run.state.PrivacyState`) under the names
#: users and earlier releases of hf_dp read: ``trainer.ledger``, ``trainer.privacy_spec``, …
_STATE_VIEWS = {
    "mechanism": "mechanism", "ledger": "ledger", "privacy_spec": "spec", "run_id": "run_id", "randomness": "randomness",
    "num_units": "units.count", "token_bounds": "bounds", "clipping": "clipping", "clipping_engine": "engine",
    "audit_record": "audit_record", "hyperparameter_selection": "selection.record", "resumed_from": "lineage.resumed_from",
    "planned_epsilon": "mechanism.planned_epsilon", "dataset_size_source": "mechanism.dataset_size_source",
    "ghost_clipper": "engine.clipper", "grad_sampler": "engine.grad_sampler",
}


def _state_view(path: str) -> property:
    get = operator.attrgetter(path)

    def view(self):
        try:
            return get(self.dp)
        except AttributeError:  # a part not made (a non-private run, or before set-up)
            return None
    return property(view, doc=f"``self.dp.{path}`` (read-only)")


for _name, _path in _STATE_VIEWS.items():
    setattr(DPTrainer, _name, _state_view(_path))
