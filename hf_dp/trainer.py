"""``DPTrainer``: private fine-tuning through ``transformers.Trainer``.

Each override does HF's part through ``super()`` and the DP part through a function of the module that owns it
(docs/architecture.md walks one step and one release through them):

* ``__init__``: freezes by ``--trainable``, optionally caches the frozen prefix, then plans the run's privacy state
  once (:func:`hf_dp.run.setup.setup_privacy`): the :class:`~hf_dp.privacy.mechanism.Mechanism` (q = B/N, σ, the
  steps, from public inputs), the ledger, the Poisson sampler and the clipping engine, in one
  :class:`~hf_dp.run.state.PrivacyState` (``self.dp``). The model itself is never wrapped: saving and evaluation are
  HF's own.
* ``get_train_dataloader``: HF's dataset and collator drawn by the Poisson sampler (:func:`hf_dp.run.data.poisson_loader`);
  ``training_step`` trains only on its micro-batches, each once, in order (:func:`hf_dp.run.step.check_drawn_by`).
* ``create_optimizer``: the registered update rule wrapped in the privatizer (clip, noise once, ÷B, ledger).
* ``compute_loss`` / ``training_step``: **the loss-scaling contract** — ``compute_loss`` returns Σ_i ℓ_i / (B / world
  size) and a hook on Σ_i ℓ_i measures the factor every later scaling applied before the backward pass; per-example
  gradients are divided by exactly that factor before clipping, so each example's clipped vector is clip_C(∇ℓ_i)
  whatever the Trainer does to the loss (``num_items_in_batch`` is ignored). Under DDP the forward runs in
  ``no_sync``; under FSDP2 ghost clipping runs on the shards and each rank adds the noise to its own shard
  (:mod:`hf_dp.clipping.sharding`).
* ``log``: adds ``epsilon`` and drops HF's ``grad_norm`` (the non-private gradient's norm); the logged training loss is
  not private. ``hyperparameter_search``: private selection under DP (:mod:`hf_dp.tuning.search`).
* ``save_model`` / ``create_model_card``: a plain ``PreTrainedModel`` (LoRA merged), ``privacy.json`` and a card.
* Checkpoints (:mod:`hf_dp.run.checkpointing`, :mod:`hf_dp.run.spent`): the rule state and the ledger, no seed;
  batches and noise are fresh after a resume, and ε counts every noisy step ever taken.

The private transformers API it overrides is listed, with the reason for each, in :mod:`hf_dp.run.hf_api`.
"""

from __future__ import annotations

import contextlib
import logging
import operator

import torch
from torch.utils.data import DataLoader, SequentialSampler
from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler

from hf_dp.arguments import DPTrainingArguments, check_no_full_eval_cast
from hf_dp.clipping import sharding
from hf_dp.run import checkpointing, contract, lineage, release, setup, spent, step
from hf_dp.run.hf_api import HF_PRIVATE_API_CHECKED_WITH, HF_PRIVATE_CALLS, HF_PRIVATE_OVERRIDES  # noqa: F401 (re-exported)
from hf_dp.run.hf_api import library_bars_off, no_cpu_pin_memory_warning
from hf_dp.run.checkpoint_hooks import CheckpointOverrides
from hf_dp.run.ledger_hooks import LedgerOverrides
from hf_dp.audit import canaries
from hf_dp.hub import report, write_privacy_artifacts
from hf_dp.hub.describe import CARD_SETTINGS, card_fields
from hf_dp.models import apply_trainable, check_full_precision, lora_config_of
from hf_dp.models.cache_manager import PrefixCacheManager, forward_context
from hf_dp.models.prefix_cache import CACHED_HIDDEN_KEY, PREFIX_SIGNATURE_KEY, CachedFeatures, CachedFeaturesCollator
from hf_dp.run.state import PrivacyState
from hf_dp.models.loss import OBJECTIVES, objective_for
from hf_dp.run.data import EMPTY_KEY as _EMPTY_KEY, PHASE_KEY as _PHASE_KEY, UNITS_KEY as _UNITS_KEY
from hf_dp.run.draws import DRAWN_KEY as _DRAWN_KEY
from hf_dp.run.data import PoissonDataLoader as _PoissonDataLoader
from hf_dp.run.data import check_eval_is_not_train as _check_eval_is_not_train, refuse_sharding as _refuse_sharding
from hf_dp.run.data import group_by_length, poisson_loader, split_to_bounds

logger = logging.getLogger(__name__)


class DPTrainer(LedgerOverrides, CheckpointOverrides, Trainer):
    """``transformers.Trainer`` with differential privacy (see the module docstring); its ledger and checkpoint
    overrides are in :class:`hf_dp.run.ledger_hooks.LedgerOverrides` and :class:`hf_dp.run.checkpoint_hooks.CheckpointOverrides`.

    Use exactly like ``Trainer`` with :class:`~hf_dp.arguments.DPTrainingArguments`. After training:
    ``get_epsilon()`` (ε spent), ``privacy_report()`` (all numbers of the guarantee).
    """

    def __init__(self, model=None, args: DPTrainingArguments | None = None, train_dataset=None, **kwargs):
        setup.check_transformers_version()
        if not isinstance(args, DPTrainingArguments):
            raise TypeError("DPTrainer needs args=DPTrainingArguments(...)")
        self.trainable_info = None
        # the run's privacy state, filled by hf_dp.run.setup (hf_dp.run.state); private or not is fixed here
        self.dp = PrivacyState(enabled=bool(args.dp_enabled))
        if args.dp_enabled:
            if model is None:
                raise ValueError("DPTrainer needs a model (model_init is not supported with DP)")
            if kwargs.get("optimizers", (None, None))[0] is not None or kwargs.get("optimizer_cls_and_kwargs"):
                raise ValueError("DPTrainer builds its own DP optimizer from --optim; do not pass optimizers=")
            _refuse_sharding(args)  # before HF's own FSDP checks (one process: "fsdp only works in distributed training")
            contract.check_head(model)  # a head whose loss DPTrainer does not compute as the model would
            check_full_precision(model, "the model")  # before LoRA wraps it; again after (setup) and at every train()
        if model is not None:
            # --trainable applies to non-private baselines too, so that they train the same parameters
            model, self.trainable_info = apply_trainable(model, args.trainable, lora_config_of(args))
            if args.dp_enabled and sharding.fsdp_requested(args):  # FSDP2 under DP: hf_dp.clipping.sharding
                sharding.check_model(model)
                sharding.check_processes(args)
        #: how each example's loss is computed under DP (hf_dp.models.loss; check_head refused heads without one)
        self.objective = (objective_for(model) or OBJECTIVES["sequence_classification"]) if model is not None else None
        self._fingerprint_source, self._train_fingerprint = train_dataset, None  # before any caching
        self._dp_init_kwargs = dict(kwargs)  # what a private selection's trials are built with (hf_dp.tuning.search)
        # --audit_canaries: the included canaries appended (the real rows stay the fingerprint's source; hf_dp.audit.canaries)
        train_dataset, self.dp.audit = canaries.attach(self.objective, model, args, train_dataset,
                                                       kwargs.get("processing_class"))
        super().__init__(model=model, args=args, train_dataset=train_dataset, **kwargs)
        if args.dp_enabled:
            _check_eval_is_not_train(self.eval_dataset, self.train_dataset)
        self._prefix_cache, self.prefix_cache = False, None
        if args.cache_frozen_features:
            self._enable_prefix_cache()
        if args.dp_enabled:
            self.loss_is_scaled_for_ga = True  # our compute_loss returns a per-logical-batch quantity
            self._setup_privacy()
            self.add_callback(spent.BudgetGuard(self.dp, self._record_spent))

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if sharding.enable_on_cpu(self.accelerator, self.args):  # --fsdp on CPU/gloo: the plugin Accelerate drops there
            self.is_fsdp_enabled = True
        sharding.set_wrap_classes(self.accelerator, self.model)  # --fsdp without layer classes: the model's own blocks

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

    @contextlib.contextmanager
    def _canary_scoring(self, preprocess_logits):
        """HF's evaluation loop with ``preprocess_logits`` and no ``compute_metrics`` (it reads both from the trainer):
        a causal LM's canary scores (:func:`hf_dp.audit.canaries.canary_scores`)."""
        saved = self.preprocess_logits_for_metrics, self.compute_metrics
        self.preprocess_logits_for_metrics, self.compute_metrics = preprocess_logits, None
        try:
            yield
        finally:
            self.preprocess_logits_for_metrics, self.compute_metrics = saved

    def _check_not_train(self, dataset) -> None:
        """Under DP, at every evaluate() / predict(): the data evaluated is not (and does not overlap) the training
        set, whatever was passed at construction, nor the held-out private set a private selection scored its trials
        on (:func:`hf_dp.tuning.private_score.refuse_evaluating_the_score_set`)."""
        if isinstance(dataset, str) and isinstance(self.eval_dataset, dict):
            dataset = self.eval_dataset.get(dataset)
        if self.dp.selection.score_sets:
            from hf_dp.tuning.private_score import refuse_evaluating_the_score_set

            refuse_evaluating_the_score_set(self.dp.selection.score_sets, dataset)
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
        with self._suffix_ctx(), no_cpu_pin_memory_warning():
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
        self._check_not_train(test_dataset)
        if self._prefix_cache:
            test_dataset = self.prefix_cache.cache(test_dataset, metric_key_prefix)
        with self._suffix_ctx(), no_cpu_pin_memory_warning():
            return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------------
    def _setup_privacy(self) -> None:
        # the mechanism planned once (hf_dp.run.setup); --audit_canaries appends its units and wraps the engine
        setup.setup_privacy(self.dp, self.args, self.model, self.train_dataset, self._fingerprint_source, self.objective,
                            prefix_cache=self._prefix_cache, fsdp=self.is_fsdp_enabled, deepspeed=self.is_deepspeed_enabled,
                            audit_units=canaries.extend_units, audit_engine=canaries.wrap_engine)

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
        return poisson_loader(self.dp, self.args, base, self.train_dataset, audit_parts=canaries.loader_parts)

    # ------------------------------------------------------------------------------------------------
    # optimizer
    # ------------------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if not self.args.dp_enabled:
            return super().create_optimizer(model)
        if self.optimizer is None:  # the privatizer over the update rule, planned at set-up (hf_dp.run.setup)
            model = self.model if model is None else model  # its decay / no-decay groups, as HF builds them
            self.optimizer = self.dp.optimizer = setup.make_private_optimizer(
                self.dp, self.args, model, self.get_decay_parameter_names(model))
            canaries.check_optimizer(self.dp.audit, self.dp.optimizer)  # --audit_kind gradient: a rule it can audit
        return self.optimizer

    # ------------------------------------------------------------------------------------------------
    # the step
    # ------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.args.dp_enabled or not model.training:
            inputs.pop(_EMPTY_KEY, None)
            inputs.pop(_UNITS_KEY, None)
            inputs.pop(_PHASE_KEY, None)
            inputs.pop(_DRAWN_KEY, None)
            canaries.pop_rows(self.dp.audit, inputs)
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        rows = canaries.pop_rows(self.dp.audit, inputs)  # --audit_kind gradient: each row's canary id (-1: a real row)

        def audit_losses(losses, empty):  # a gradient canary's loss is 0; an input canary's is not in the logged loss
            losses = canaries.zero_canary_losses(self.dp.audit, losses, rows, empty, self.dp.contract.probe)
            self.dp.step.canary_loss = canaries.input_canary_loss(self.dp.audit, losses, rows, empty)
            return losses
        # Σ_i ℓ_i / (B / world size), the loss scale HF applies measured by a hook (hf_dp.run.step)
        loss, outputs = step.private_loss(self.dp, model, inputs, self.objective, self.model.config,
                                          self.args.world_size, audit_losses)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        contract.check_private_fixed(self.dp, self.args)  # a callback may flip args.disable_dp mid-run
        if not self.args.dp_enabled:
            return super().training_step(model, inputs, num_items_in_batch)
        # every micro-batch (a few comparisons): the arguments (a callback may change them) and the optimizer HF steps
        # (still the privatizer, with σ, C and B planned) are what the accountant was told
        contract.check_mechanism(self.dp.contract.planned, contract.mechanism_snapshot(self.args, self.dp.mechanism))
        contract.check_optimizer(self.optimizer, self.dp.optimizer, self.dp.mechanism)
        step.check_drawn_by(self.dp, inputs)  # drawn by this trainer's Poisson loader, and not trained on before
        loss = None  # a micro-batch above the run's public token bound runs as several (hf_dp.run.data.split_to_bounds),
        parts = split_to_bounds(inputs, self.dp.bounds, fsdp=self.dp.fsdp)  # summed in float64
        with self.dp.engine.active(self.dp.optimizer), self.dp.optimizer.parts() if len(parts) > 1 else contextlib.nullcontext():
            for part in parts:
                out = canaries.logged_loss(self.dp, super().training_step(model, part, num_items_in_batch),
                                           self.args.world_size)
                loss = out if loss is None else loss + out
                step.after_micro_batch(self.dp, self.model)  # the clipped sums to the privatizer
        return loss

    # ------------------------------------------------------------------------------------------------
    # privacy reporting
    # ------------------------------------------------------------------------------------------------
    def privacy_report(self) -> dict:
        """All numbers of the guarantee, as written to ``privacy.json`` and the model card (see :mod:`hf_dp.hub.report`)."""
        run = report.RunFacts(self.args, getattr(self.objective, "name", None), self.trainable_info,
                              bool(self._prefix_cache), tuple(self.callback_handler.callbacks), self.eval_dataset)
        if not self.dp.enabled:  # private or not as built (a train() with other args is refused)
            return report.non_private_report(run, self.optimizer, self.state.global_step)
        ledger = lineage.take_later_runs(self.dp, self.args, self.model)  # the model's later runs taken in first
        return report.privacy_report(self.dp.mechanism, ledger, run.with_state(self.dp), epsilon=self.get_epsilon())

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

    def _adopt_trial(self, winner) -> None:
        """Become a private selection's winner (hf_dp.tuning.search): own args and attributes it lacks stay."""
        own = {k: v for k, v in self.__dict__.items() if k not in winner.__dict__ or k == "args"}
        self.__dict__.update({**winner.__dict__, **own})

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        contract.check_private_fixed(self.dp, self.args)  # DP or not, as built (hf_dp.run.contract)
        if self.dp.selection.record is not None:
            from hf_dp.tuning.search import refuse_train_after_selection

            refuse_train_after_selection(self.dp.selection)
        # only complete checkpoints (with hf_dp's marker) are resumed from; see hf_dp.run.checkpointing
        resume_from_checkpoint = checkpointing.resolve_resume_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if self.args.dp_enabled and resume_from_checkpoint is not None:  # FSDP's sharded checkpoints (hf_dp.clipping.sharding)
            sharding.check_resume(resume_from_checkpoint, checkpointing.read_marker(resume_from_checkpoint),
                                  self.dp.fsdp, self.args.world_size)
        self.dp.lineage.resumed_from = resume_from_checkpoint
        canaries.before_train(self.dp.audit, resume_from_checkpoint)  # --audit_canaries: no resume, one train()
        self.dp.contract.accumulating = None  # every train() starts its steps at micro-batch 0 of a new draw
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
        # the model's ledger, another run's checkpoints (hf_dp.run.lineage)
        lineage.before_train(self.dp, self.args, self.model, resume_from_checkpoint, self._train_fingerprint)
        with self._suffix_ctx(), library_bars_off():
            if self.args.dp_enabled:
                self._check_contract()
                setup.share_sampling_key(self.dp, self.args)  # several ranks: the Poisson sampler's key of this train(), rank 0's
            try:
                out = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            except BaseException:
                canaries.after_train(self.dp, self.args, failed=True)  # --audit_canaries: drop the draw; no second train() on it
                raise
            finally:
                self.dp.sampling_key = None  # forgotten: a later train() draws its own
        # --audit_canaries: score (HF's evaluation loop on the canaries), bound (dp.audit_record), drop the draw
        canaries.after_train(self.dp, self.args, lambda state: canaries.canary_scores(self, state), self.get_epsilon)
        return out

    def num_examples(self, dataloader) -> int:
        # HF logs this and derives train_samples_per_second from it: the public N — the declared one (+ m canaries), else
        # units (+ m) under a unit column (rows are private there), else --audit_canaries' real rows + m (not + included);
        # the training loader is DPTrainer's, or a subclass's wrapper of it that shows its dataset
        shown = getattr(dataloader, "dataset", None)
        train = isinstance(dataloader, _PoissonDataLoader) or (
            shown is not None and any(shown is d for d in self.dp.contract.loader_dataset or ()))
        if train and self.args.public_dataset_size is not None:
            return int(self.dp.spec.dataset_size)
        if train and self.args.privacy_unit_column:
            return self.dp.units.count
        if train and self.dp.audit is not None:
            return self.dp.audit.public_rows
        return super().num_examples(dataloader)

    def _check_contract(self) -> None:
        """At every ``train()``, before any step: :func:`hf_dp.run.contract.check_at_train`."""
        contract.check_at_train(self.dp, self.args, self.model, self.train_dataset, self.data_collator, self.objective,
                                # DPTrainer's own loader (its dataset and collator), also under a subclass's override
                                loader=lambda: DPTrainer.get_train_dataloader(self), data_info=self._train_data_info,
                                compute_loss=self.compute_loss, prepare_inputs=self._prepare_inputs)

    def _train_data_info(self) -> dict:
        """N and a SHA-256 fingerprint of the training set (before any caching), recorded in checkpoint markers."""
        if self._train_fingerprint is None:
            self._train_fingerprint = checkpointing.dataset_fingerprint(self._fingerprint_source)
        return {"num_samples": self.dp.spec.dataset_size, "sha256": self._train_fingerprint}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        output_dir = output_dir or self.args.output_dir
        # a checkpoint iff called from _save_checkpoint (a release folder may be named "checkpoint-…" too)
        is_checkpoint = self.dp.saving_checkpoint
        self._record_spent()  # on record (and in the model's config.json: hf_dp.run.lineage) before the model is written
        # the plain model where HF's save would not write one (FSDP2's shards, LoRA merged): hf_dp.run.release
        if not release.save_model_folder(self.args, self.model, self.dp.fsdp, self.trainable_info, self.processing_class,
                                         output_dir, is_checkpoint):
            super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:  # non-private runs too: their card says so and records what was trained
            self._record_spent()
            self._write_privacy_files(output_dir)
            checkpointing.apply_umask(output_dir, ("*.safetensors", "*.bin"))  # HF writes the weights 0600
            if not is_checkpoint:
                release.drop_training_args(output_dir)  # a release holds no pickled arguments

    def _write_privacy_files(self, output_dir: str, eval_results: dict | None = None) -> None:
        eval_results = eval_results if eval_results is not None else report.latest_eval_metrics(self.state.log_history)
        # base model, task, labels, data and title from what was set on the trainer, else the config and dataset
        fields = card_fields(self.model, self.args, self.train_dataset, getattr(self.objective, "name", None),
                             **{k: getattr(self, k, None) for k in CARD_SETTINGS})
        write_privacy_artifacts(output_dir, self.privacy_report(), eval_results=eval_results,
                                log_history=self.state.log_history, **fields)

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
