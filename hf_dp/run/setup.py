"""The mechanism one DP run plans, once, when its ``DPTrainer`` is made (``DPTrainer._setup_privacy``).

:func:`setup_privacy` sizes and checks the training set (labels, token ids: :mod:`hf_dp.run.contract`), reads the
privacy units (:func:`setup_units`; N = the number of units, or ``--public_dataset_size`` when declared:
:func:`hf_dp.privacy.planning.public_size`, said once by :func:`say_dataset_size`), plans the mechanism
(:func:`hf_dp.privacy.planning.plan_mechanism`: q = B/N, the steps, σ), makes the ledger (continuing the model's own:
:func:`hf_dp.run.lineage.adopt_model_ledger`), the Poisson sampler, the clipping engine (:func:`choose_clipping`),
logs the planner's start-of-run block (:func:`hf_dp.plan.run_block`) and keeps the snapshot of the mechanism that
every ``train()`` and every step compares with (:func:`hf_dp.run.contract.mechanism_snapshot`). At every ``train()``
:func:`share_sampling_key` then gives several ranks the key of their one Poisson draw. Its functions take the pieces
they use (the run's privacy state ``dp``, :class:`hf_dp.run.state.PrivacyState`, the arguments, the model, the
training set), never the trainer, and fill the state.
"""

from __future__ import annotations

import logging
import math
import secrets

import torch

from hf_dp.clipping import choose_engine, make_engine
from hf_dp.clipping.common import TokenBounds, gamma
from hf_dp.models.precision import check_full_precision
from hf_dp.optim import get_entry, make_optimizer, rule_hyperparameters
from hf_dp.plan import calibrated_for, calibration_scope, run_block, run_expectation
from hf_dp.privacy.accounting import PrivacyLedger
from hf_dp.privacy.cyclic import partitions_digest, row_partitions, unit_partitions
from hf_dp.privacy.mechanism import Mechanism
from hf_dp.privacy.planning import LARGER_THAN_DECLARED, public_size
from hf_dp.privacy.randomness import ENTROPY, SEEDED, shared_entropy_key, source_name
from hf_dp.privacy.sampler import PoissonBatchSampler
from hf_dp.privacy.selection import HOLDER, plan_role
from hf_dp.run import contract, lineage
from hf_dp.run.data import example_lengths, refuse_sharding, set_sampler_lengths, unit_rows

logger = logging.getLogger("hf_dp.trainer")  # DPTrainer's set-up messages keep the trainer's logger name


def setup_privacy(dp, args, model, train_dataset, fingerprint_source, objective, *, prefix_cache: bool = False,
                  fsdp: bool = False, deepspeed: bool = False, audit_units=None, audit_engine=None) -> None:
    """``DPTrainer._setup_privacy``, once at construction, filling the run's privacy state ``dp``
    (:class:`hf_dp.run.state.PrivacyState`): the training set sized and its labels and token ids checked (on
    ``fingerprint_source``, the training set as given, against the model's config and its ``objective``), the privacy
    units read (N), the mechanism planned (q = B/N, the steps, σ), the ledger (continuing the model's own), the
    Poisson sampler, the clipping engine, the planner's start-of-run block, and the snapshot of that mechanism every
    ``train()`` and every step compares with. ``prefix_cache``: ``--cache_frozen_features`` is on; ``fsdp``,
    ``deepspeed``: HF enabled them. ``audit_units(dp, rows)`` and ``audit_engine(dp, engine)``: ``--audit_canaries``'
    hooks (:mod:`hf_dp.audit.canaries`: its units appended, the engine wrapped), passed by the trainer."""
    if train_dataset is None:
        raise ValueError("DP training needs a train_dataset (its size N defines q and delta < 1/N)")
    try:
        n = len(train_dataset)
    except TypeError:
        raise ValueError("DP training needs a sized train_dataset (an IterableDataset cannot be Poisson-sampled)") from None
    if n == 0:
        raise ValueError("the training dataset is empty")
    contract.check_labels(fingerprint_source, getattr(model, "config", None), objective)
    contract.check_token_ids(fingerprint_source, getattr(model, "config", None))
    setup_units(dp.units, n, args.privacy_unit_column, fingerprint_source, prefix_cache)
    if audit_units is not None:  # --audit_canaries: one unit per canary, included or not (N = real + m)
        audit_units(dp, n)
    n = dp.units.count  # the actual count: real units (+ --audit_canaries' m), what the sampler draws from
    # N the mechanism is planned from: --public_dataset_size (+ m canaries) when declared, else the actual count
    audit = dp.audit
    n_public = public_size(args.public_dataset_size, n, audit.m if audit is not None else 0)
    mechanism = Mechanism.plan(
        n=n_public, declared=args.public_dataset_size is not None, per_device_batch=args.per_device_train_batch_size,
        accumulation=args.gradient_accumulation_steps, world_size=args.world_size, delta=args.delta,
        epsilon=args.epsilon, noise_multiplier=args.noise_multiplier, max_grad_norm=args.per_sample_max_grad_norm,
        accountant=args.accountant, max_steps=args.max_steps, num_train_epochs=args.num_train_epochs,
        privacy_unit=args.privacy_unit_column, max_rows_per_unit=args.max_rows_per_unit,
        noise_mechanism=args.noise_mechanism, noise_bands=args.noise_bands)
    dp.mechanism, world, steps_per_epoch = mechanism, mechanism.world_size, mechanism.steps_per_epoch
    spec = dp.spec
    q, b, planned, sigma = spec.sample_rate, int(spec.expected_batch_size), spec.planned_steps, spec.noise_multiplier
    dp.ledger = PrivacyLedger(spec)
    dp.ledger.meta["privacy_unit"] = args.privacy_unit_column  # each run's record says what it protected
    lineage.adopt_model_ledger(dp, args, model, fingerprint_source)  # the earlier runs the model carries (--prior_privacy)
    dp.randomness = source_name(args.dp_seed, args.secure_rng)
    if dp.randomness == SEEDED:
        logger.warning(
            "hf_dp: --dp_seed %s fixes the Poisson batches and the noise: anyone who knows the seed can "
            "recompute them and remove the noise from the released model. Use it for reproducible research "
            "only, and never reuse a seed: two runs with the same seed on datasets that differ in one "
            "example reveal that example's clipped gradient exactly. The seed is recorded in privacy.json "
            "and the model card.", args.dp_seed,
        )
    # every actual unit is drawn at q = B/N_public, for round(1/q) steps an epoch: the actual count changes only how
    # many rows a draw finds; under cyclic Poisson sampling (banded noise) only the units of the step's partition, at
    # b·q, the step being the ledger's own steps when the batch is drawn
    dp.sampler = PoissonBatchSampler(
        n, q, steps_per_epoch, micro_batches=args.gradient_accumulation_steps, seed=args.dp_seed,
        rank=args.process_index, world_size=world, secure=args.secure_rng, position=lambda: dp.ledger.steps,
        units=dp.units.rows, max_rows_per_unit=args.max_rows_per_unit, allow_empty_units=dp.audit is not None,
        stream_tag=lambda: dp.ledger.meta.get("stream_tag"), shared_key=lambda: dp.sampling_key,
        bands=mechanism.bands,
        partitions=cyclic_partitions(mechanism.bands, fingerprint_source, args.privacy_unit_column, dp.units, dp.audit),
        phase=lambda: dp.ledger.own_steps,
    )
    if mechanism.bands > 1:  # every train() reads the rows again: partitions that changed are refused (contract)
        dp.contract.partitions = lambda: partitions_digest(
            cyclic_partitions(mechanism.bands, fingerprint_source, args.privacy_unit_column, dp.units, dp.audit),
            mechanism.bands)
    dp.sampling_key = None  # several ranks, OS entropy: set by share_sampling_key at every train()
    dp.lengths_of = None
    set_sampler_lengths(dp, args, train_dataset)  # refused here, before any step, if the lengths are unknown
    dp.noise_seed = args.dp_seed
    #: the run's lineage: a random public id written with every record of steps taken (a resume is a new run, its
    #: parent the checkpoint's run); under --dp_seed, a resume that is not a clean continuation keys its seeded
    #: streams with it (ledger.meta["stream_tag"], hf_dp.run.spent.reconcile_resumed_ledger)
    dp.run_id = secrets.token_hex(8)
    dp.optimizer = None  # a PrivateOptimizer, made by create_optimizer
    dp.step.loss_scale = None
    dp.step.units = None  # the micro-batch's privacy units (rows -> 0..U-1), --privacy_unit_column
    dp.step.empty = False
    dp.clipping = choose_clipping(args, model, fsdp, deepspeed)  # the engine's name (hf_dp.clipping.engines)
    dp.fsdp = bool(fsdp)  # FSDP2 under DP (hf_dp.clipping.sharding)
    dp.bounds = token_bounds(model, args, spec, world, units=dp.units.rows is not None)
    dp.loss_token_norm = loss_token_norm(args, objective, dp.bounds)
    check_row_lengths(train_dataset, dp.bounds.max_length, args.length_column_name)
    # --audit_kind gradient: the engine hands each drawn canary's gradient to the privatizer's clipping
    if dp.fsdp and dp.clipping == "ghost":  # its clipped sums reduce-scattered into the shards
        from hf_dp.clipping.fsdp_ghost import ShardedGhostEngine

        engine = ShardedGhostEngine(model, bounds=dp.bounds)
    else:
        engine = make_engine(dp.clipping, model, bounds=dp.bounds)
    dp.engine = audit_engine(dp, engine) if audit_engine is not None else engine
    engine.pause(True)  # recording only inside DPTrainer.training_step (ClippingEngine.active)
    # the planner's start-of-run block (hf_dp.plan): public quantities only, no extra calibration
    # a few lines by default; the noise figures and the table when asked (--log_level debug, or hf_dp's logger at DEBUG).
    # Under a private selection (hf_dp.privacy.selection.plan_context) a trial names its ε per trial, and a trainer that
    # only holds the selection prints nothing: the single run its σ is planned for is never made
    role = plan_role()
    dp.plan_announced = role != HOLDER
    if dp.plan_announced:
        d = sum(p.numel() for p in model.parameters() if p.requires_grad)
        expect = dict(n=n_public, batch_size=b, steps=planned, sigma=sigma, params=d,
                      calibrated=calibrated_for(getattr(model, "get_base_model", lambda: model)()),
                      causal_lm=getattr(objective, "name", None) == "causal_lm",  # the causal-LM verdict (hf_dp.plan)
                      optim=str(getattr(args.optim, "value", args.optim)), learning_rate=args.learning_rate,
                      schedule=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)))
        with calibration_scope(model):  # a causal LM trained from scratch: no calibrated verdict (hf_dp.plan.lm_verdict)
            block, warning = run_block(
                **expect, delta=args.delta, accountant=args.accountant, max_grad_norm=args.per_sample_max_grad_norm,
                epsilon=args.epsilon, sigma_note=role or "", detail=args.log_level == "debug" or logger.isEnabledFor(logging.DEBUG),
                bands=mechanism.bands)
            dp.plan_expectation = run_expectation(**expect)  # what the block said to expect, for the recipes' summary
        logger.info(block)
        if warning:
            logger.warning(warning)
        say_dataset_size(dp, args, n, n_public)
    dp.contract.probe, dp.contract.rows_checked, dp.contract.several_rows = False, None, False
    dp.contract.planned_dataset = train_dataset
    #: the mechanism σ, q and the steps were planned for: every train() and every step must still run it
    dp.contract.planned = contract.mechanism_snapshot(args, dp.mechanism, model)


def say_dataset_size(dp, args, actual: int, n_public: int) -> None:
    """Once, with the plan: where N came from — the declared public size, or the actual count treated as public
    (with the flag that declares one) — and, to the operator only (never in the release), an actual count far above
    the declared size (each draw finds that many more rows than B; the mechanism is unchanged). ``dp``: the run's
    privacy state (its audit and its planned B)."""
    what = "units" if args.privacy_unit_column else "training examples"
    audit = dp.audit
    canaries = f" + {audit.m:,} canary units" if audit is not None else ""
    declared = args.public_dataset_size
    if declared is None:
        logger.info(
            "hf_dp: N = %s%s, the actual count of %s, is treated as public: q = B/N, sigma and the steps are computed "
            "from it, and under add/remove adjacency it differs between neighbouring datasets; declare a public size "
            "with --public_dataset_size N to plan the mechanism from public inputs only", f"{n_public:,}",
            f" (real{canaries})" if canaries else "", what)
        return
    logger.info("hf_dp: N = %s (%s%s) is the declared public size of the %s (--public_dataset_size): q = B/N, sigma, "
                "the steps, B and delta < 1/N are planned from it; the actual count only changes how many rows each "
                "Poisson draw finds", f"{n_public:,}", f"{declared:,}", canaries, what)
    real = actual - (audit.m if audit is not None else 0)
    if real > LARGER_THAN_DECLARED * declared:
        logger.warning(
            "hf_dp: the training set has about %.1f times as many %s as declared: it is larger than the declared "
            "--public_dataset_size, so each step draws about that many times the planned B = %s (q = B/N is fixed, so "
            "the guarantee holds and the divisor stays B; micro-batches grow with it). This line is for you: it is not "
            "in the release", real / declared, what, f"{dp.spec.expected_batch_size:g}")


def share_sampling_key(dp, args) -> None:
    """At every ``train()`` under DP, on every rank, before any batch is drawn: with several processes and OS entropy,
    the key of this ``train()``'s Poisson streams (``dp.sampling_key``), rank 0's 256 bits broadcast in memory
    (:func:`hf_dp.privacy.randomness.shared_entropy_key`), so that every rank draws the one sample it shares out
    (:mod:`hf_dp.privacy.sampler`); ``DPTrainer.train`` forgets it when it returns or raises. Then, with several
    processes, every rank checks that all would draw the same sample (:func:`hf_dp.run.contract.check_ranks_share_draw`)."""
    dp.sampling_key = None
    if max(1, args.world_size) <= 1:
        return
    if dp.randomness == ENTROPY:
        key = shared_entropy_key(args.device)
        if key is None:
            raise ValueError(f"world_size is {args.world_size} but torch.distributed is not initialized: the "
                             "ranks cannot share their Poisson draws; launch with torchrun (or accelerate launch)")
        dp.sampling_key = key
    contract.check_ranks_share_draw(dp.sampler, dp.ledger, dp.sampling_key)


def cyclic_partitions(bands: int, source, column: str | None, units, audit=None) -> torch.Tensor | None:
    """Cyclic Poisson sampling's partitions (``bands`` > 1; else ``None``), once, before training, from the training
    set as given (``source``): each unit's by a hash of its ``column`` value (the units' rows from ``units``,
    :class:`hf_dp.run.state.Units`), each row's by a hash of its own columns (:mod:`hf_dp.privacy.cyclic`).
    ``audit`` (``--audit_canaries``' state, its m units after the real ones): each canary unit's by a hash of its own
    public identity (``audit.identities()``: index and content, never its inclusion bit), included or not."""
    if bands <= 1:
        return None
    if callable(getattr(source, "with_format", None)) and getattr(source, "column_names", None) is not None:
        source = source.with_format(None)  # the stored content: no format's column subset, no transform
    if column is None:
        parts = row_partitions(source, bands)  # the source holds the real rows only (the canaries are appended later)
    else:
        values = list(source[column]) if getattr(source, "column_names", None) is not None else None
        real = units.rows if audit is None else units.rows[: audit.real_units]
        first = [int(rows[0]) for rows in real]
        parts = unit_partitions([values[r] if values is not None else source[r][column] for r in first], bands)
    if audit is not None:
        parts = torch.cat([parts, unit_partitions(audit.identities(), bands)])
    return parts


def setup_units(units, rows: int, column: str | None, source, prefix_cache: bool = False) -> None:
    """``--privacy_unit_column`` (``column``): the rows of each unit, read once from the training set given at
    construction (``source``, before any column removal), into ``units`` (:class:`hf_dp.run.state.Units`); N = the
    number of units. Without it every row is its own unit. ``prefix_cache``: ``--cache_frozen_features`` is on."""
    units.rows, units.of_row = None, None
    units.count = rows
    if column is None:
        return
    if prefix_cache:
        raise ValueError(
            "--privacy_unit_column with --cache_frozen_features is not supported yet: the cache does not keep the "
            "unit column; drop one of the two flags"
        )
    units.rows = unit_rows(source, column)
    unit_of_row = torch.empty(rows, dtype=torch.long)
    for j, r in enumerate(units.rows):
        unit_of_row[r] = j
    units.of_row = unit_of_row
    units.count = len(units.rows)


def choose_clipping(args, model, fsdp: bool = False, deepspeed: bool = False) -> str:
    """``--clipping``: ``ghost`` (one backward pass) where it applies, else Opacus hooks; ``ghost_two_pass`` only
    when asked for (:func:`hf_dp.clipping.engines.choose_engine`). Any number of processes: under DDP every engine
    runs its forward/backward without DDP's gradient all-reduce (see ``DPTrainer.compute_loss``), and the privatizer
    all-reduces the noisy clipped sum once per logical batch. Under FSDP2 (``fsdp``: HF enabled it) one-pass ghost
    clipping by default (:mod:`hf_dp.clipping.fsdp_ghost`), two passes when asked; DeepSpeed is refused."""
    refuse_sharding(args, fsdp, deepspeed)
    check_full_precision(model, "the model")  # trainable or frozen: the --bf16 refusal's reason, and more
    if fsdp:  # FSDP2: one-pass ghost clipping (auto), or two passes when asked (hf_dp.clipping.fsdp_ghost)
        mode = "ghost_two_pass" if args.clipping == "ghost_two_pass" else "ghost"
        if args.clipping == "auto":
            logger.info("hf_dp: --clipping auto chose ghost (one-backward ghost clipping, clipped sums reduce-scattered "
                        "into the shards) under FSDP; --clipping ghost_two_pass keeps no layer records")
        return choose_engine(mode, model, optim=args.optim, rule_cls=get_entry(args.optim).rule_cls,
                             reduced_precision=bool(args.bf16 or args.fp16), logger=logger)
    return choose_engine(args.clipping, model, optim=args.optim, rule_cls=get_entry(args.optim).rule_cls,
                         reduced_precision=bool(args.bf16 or args.fp16), logger=logger)


def param_groups(model, decay, weight_decay: float) -> list[dict]:
    """HF's decay / no-decay parameter groups of ``model``, built as ``Trainer.create_optimizer`` builds them:
    ``decay``, the names ``Trainer.get_decay_parameter_names`` gives, get ``weight_decay``."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay and p.requires_grad], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay and p.requires_grad], "weight_decay": 0.0},
    ]


def token_bounds(model, args, spec, world: int, units: bool = False) -> TokenBounds:
    """The run's public :class:`~hf_dp.clipping.common.TokenBounds`, from public inputs only: ``--dp_max_length`` (else
    an SFT config's ``max_length``, else the model's maximum positions) and a micro-batch of R rows, R far above the
    planned micro-batch b = B/(ranks × accumulation): b + 10√b + 10 (a Poisson micro-batch exceeds it with probability
    below 1e-19 at b ≥ 1), times ``--max_rows_per_unit`` (else 4) under privacy units. A larger micro-batch is split
    (:func:`hf_dp.run.data.split_to_bounds`)."""
    b = float(spec.expected_batch_size) / (max(1, world) * max(1, args.gradient_accumulation_steps))
    rows = math.ceil(b + 10 * math.sqrt(b) + 10) * ((args.max_rows_per_unit or 4) if units else 1)
    length = args.dp_max_length or getattr(args, "max_length", None)
    return TokenBounds.for_model(model, length if isinstance(length, int) and length > 0 else None, rows,
                                 micro_batches=args.gradient_accumulation_steps * max(1, world))


def loss_token_norm(args, objective, bounds) -> int | None:
    """``--lm_loss_weighting token``: the public length each sequence's token sum is divided by (the run's
    ``--dp_max_length``, else the bound :func:`token_bounds` chose), for a causal LM; refused for another head."""
    if getattr(args, "lm_loss_weighting", "sequence") != "token":
        return None
    if objective is None or not objective.token_labels:
        raise ValueError("--lm_loss_weighting token weighs a causal LM's tokens; this model's loss has one label per "
                         "example: drop the flag")
    return int(bounds.max_length)


def check_row_lengths(dataset, max_length: int, length_column_name: str = "length") -> None:
    """Refuse, before any step, a training row longer than the run's public ``max_length`` (where the rows' lengths
    can be read: a tokenized dataset, a prefix cache); a batch that pads beyond it is refused at its step."""
    try:
        lengths = example_lengths(dataset, length_column_name)
    except (ValueError, TypeError, KeyError):
        return  # rows tokenized by the collator: checked per micro-batch (hf_dp.run.data.split_to_bounds)
    if len(lengths) and int(lengths.max()) > max_length:
        raise ValueError(f"a training row has {int(lengths.max())} tokens, more than the run's public --dp_max_length "
                         f"{max_length} (the bound of ghost clipping's rounding allowance): truncate the rows to it, or "
                         "raise --dp_max_length")


def make_private_optimizer(dp, args, model, decay):
    """``DPTrainer.create_optimizer`` under DP: the update rule ``--optim`` names over HF's decay / no-decay groups of
    ``model`` (``decay``: ``Trainer.get_decay_parameter_names(model)``), wrapped in the privatizer with the planned σ,
    C and B, the run's ledger and target ε, drawing from the run's Poisson sampler (``dp``: the run's privacy state;
    :func:`hf_dp.optim.make_optimizer`)."""
    spec = dp.spec
    hyper = rule_hyperparameters(
        args.optim, lr=args.learning_rate, weight_decay=args.weight_decay, optim_args=args.optim_args,
        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, gamma=args.bc_gamma,
        h1=args.macadam_h1, h2=args.macadam_h2,
    )
    optimizer = make_optimizer(
        args.optim, param_groups(model, decay, args.weight_decay),
        noise_multiplier=spec.noise_multiplier, max_grad_norm=spec.max_grad_norm,
        expected_batch_size=spec.expected_batch_size, noise_seed=dp.noise_seed,
        secure_mode=args.secure_rng, ledger=dp.ledger, max_epsilon=spec.target_epsilon,
        noise_mechanism=spec.noise_mechanism, noise_bands=spec.noise_bands, **hyper,
    )
    optimizer.sampler = dp.sampler
    # the hooks' clipped sum is formed in float32 over at most the bounds' terms: each example's share of its rounding
    # is γ of that count times its clipped norm, so it is clipped to C/(1 + γ) (ghost clipping adds γ·S_i to its norm)
    optimizer.sum_allowance = gamma(dp.bounds.sum_terms + 2)
    if hasattr(optimizer.rule, "clamp_rate_every"):  # BC diagnostic only at the steps that are logged
        steps = args.logging_steps
        optimizer.rule.clamp_rate_every = int(steps) if steps >= 1 else 1
    if spec.target_epsilon is not None:
        optimizer.budget_steps = spec.planned_steps  # calibrate_noise_multiplier verified ε(planned) ≤ target
    return optimizer


def check_transformers_version() -> None:
    """hf_dp runs on transformers >=5.0,<6 (the private API it overrides: ``hf_dp.trainer.HF_PRIVATE_OVERRIDES``)."""
    import transformers
    from packaging import version

    from hf_dp import __version__

    v = version.parse(transformers.__version__)
    if v < version.parse("5.0.0") or v.major >= 6:
        raise RuntimeError(
            f"hf_dp {__version__} supports transformers >=5.0,<6; found {transformers.__version__}. "
            "Install a supported version: pip install 'transformers>=5,<6'"
        )
