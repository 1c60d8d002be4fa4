"""``DPTrainingArguments``: ``transformers.TrainingArguments`` plus the DP flags.

Every HF flag keeps its meaning. Added flags (all parsed by ``HfArgumentParser``):

* ``--optim`` additionally accepts the DP optimizer names from :mod:`hf_dp.optim` (``dp_sgd``,
  ``dp_sgd_l2``, ``dp_adam``, ``dp_adambc``, ``dp_adamw``, ``dp_adamw_bc``, ``dp_macadam``). HF's own
  names are refused unless ``--disable_dp`` is given: a run is never silently non-private.
* ``--epsilon`` (target ε) or ``--noise_multiplier`` (σ), exactly one; ``--delta`` (1e-5; must be
  below 1/N, checked by the trainer once N is known); ``--per_sample_max_grad_norm`` (C);
  ``--accountant`` (``prv`` | ``rdp``); ``--trainable`` (``last_block`` | ``last_k:K`` | ``head`` |
  ``all`` | ``lora`` | ``bias``); ``--bc_gamma`` (γ' of the BC variants); ``--macadam_h1/--macadam_h2``;
  ``--secure_rng``; ``--dp_seed``; ``--disable_dp``; ``--privacy_unit_column`` / ``--max_rows_per_unit`` (the unit of
privacy: a column whose rows form one unit — user-level DP —, default one row); ``--public_dataset_size`` (N declared
public: the mechanism is planned from it, not from the actual count); ``--clipping`` (``auto`` | ``ghost`` | ``ghost_two_pass`` |
  ``hooks``: the per-example clipping engine); ``--cache_frozen_features`` (train the suffix from a cache of the frozen prefix);
  ``--noise_mechanism`` (``independent`` | ``banded_sqrt``) / ``--noise_bands`` (correlated noise with cyclic Poisson
  sampling, :mod:`hf_dp.privacy.banded`).

``--trainable`` applies to ``--disable_dp`` baselines too, so that they train the same parameters.

Batch semantics: expected logical batch B = per_device_train_batch_size × gradient_accumulation_steps
× world_size; the physical batch is about per_device_train_batch_size (memory), fluctuating with
Poisson sampling. Extra rule hyper-parameters (e.g. ``momentum`` of ``dp_sgd``) go through HF's
``--optim_args "momentum=0.9"`` (numbers, names such as ``"variant=adam_corr"`` (a published variant of the
rule, :class:`hf_dp.optim.base.Variant`), or true/false: ``"fused=false"`` makes DP-Adam/DP-AdamW/DP-MacAdam run
their transform chain instead of torch's fused Adam/AdamW kernel).

What every HF flag does under DP is decided by one registry, :data:`hf_dp.flags.FLAGS` (the table
``docs/privacy_flags.md`` is generated from it): for a DP run ``__post_init__`` applies its refusals and
adjustments before HF's own validation — e.g. ``max_grad_norm`` is set to 0 (HF would clip — and log
the norm of — the *non-private* summed gradient; DP clipping is per example with C), ``fp16`` is
refused (dynamic loss scaling skips steps based on private gradients; use bf16 or fp32) and so are
``include_num_input_tokens_seen`` (it would log Poisson batch sizes), ``auto_find_batch_size``,
``train_sampling_strategy`` sequential or batch_rebalance (``group_by_length`` orders each Poisson draw by length), ``hub_strategy checkpoint``, … A ``TrainingArguments``
field the registry does not classify (a newer transformers) is refused with DP when set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_dp import flags
from hf_dp.models import check_trainable, lora_targets
from hf_dp.models.precision import check_no_mixed_precision
from hf_dp.optim.registry import is_dp_optimizer, optimizer_names
from hf_dp.privacy.accounting import ACCOUNTANTS, check_delta, check_epsilon, check_noise_mechanism

#: the largest --epsilon accepted: beyond it the guarantee (a factor e^epsilon) bounds nothing, and σ calibration slows
MAX_EPSILON = 50.0


def check_no_full_eval_cast(args) -> None:
    """``--bf16_full_eval`` / ``--fp16_full_eval`` are refused with ``--cache_frozen_features`` (checked when the
    arguments are made, and again by DPTrainer in case they were changed since)."""
    for flag in ("bf16_full_eval", "fp16_full_eval"):
        if getattr(args, "cache_frozen_features", False) and getattr(args, flag, False):
            raise ValueError(
                f"--{flag} with --cache_frozen_features: HF's evaluate() casts the whole model, frozen prefix "
                "included, to half precision and leaves it so, after which the cached features are no longer this "
                "model's (evaluation runs only the trainable suffix on them anyway); use --bf16 (mixed precision, "
                "the weights stay float32), or drop one of the two flags"
            )


@dataclass
class DPTrainingArguments(TrainingArguments):
    # redefined so that HfArgumentParser accepts the DP names (TrainingArguments restricts --optim to HF's enum)
    optim: str = field(
        default="dp_adamw",
        metadata={
            "help": "DP optimizer: " + ", ".join(optimizer_names()) + ". HF optimizer names (adamw_torch, ...) "
            "only together with --disable_dp."
        },
    )
    epsilon: float | None = field(
        default=None, metadata={"help": "Target epsilon; sigma is calibrated so the planned run spends at most this."}
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "Noise multiplier sigma (instead of --epsilon); epsilon is then reported."}
    )
    delta: float = field(default=1e-5, metadata={"help": "Target delta; must be < 1/N."})
    per_sample_max_grad_norm: float = field(
        default=0.1, metadata={"help": "Per-example clipping norm C (L2, over all trainable parameters)."}
    )
    accountant: str = field(default="prv", metadata={"help": "Privacy accountant: prv (tight) or rdp.", "choices": list(ACCOUNTANTS)})
    trainable: str = field(
        default="last_block",
        metadata={"help": "Which parameters train: last_block (+pooler+head), last_k:K (the last K blocks +pooler+head), "
                          "head, all, lora, bias."},
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (with --trainable lora)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (with --trainable lora)."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "The modules LoRA adapts (with --trainable lora): names, or all-linear; "
                                        "default PEFT's for the model type (GPT-2: c_attn; Llama: q_proj v_proj)."})
    bc_gamma: float | None = field(default=None, metadata={"help": "gamma' floor of dp_adambc / dp_adamw_bc (default: the variant's — 1e-8, or 1e-10 with --optim_args variant=adam_corr)."})
    macadam_h1: float = field(default=1e-12, metadata={"help": "DP-MacAdam lower clamp h1 of the variance estimate."})
    macadam_h2: float = field(default=1.0, metadata={"help": "DP-MacAdam upper clamp h2 of the variance estimate."})
    secure_rng: bool = field(
        default=False,
        metadata={
            "help": "Poisson draws and noise from the OS CSPRNG (os.urandom; Gaussians as in Opacus' secure mode, "
            "against floating-point attacks). Cannot be combined with --dp_seed."
        },
    )
    dp_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of Poisson sampling and noise for a reproducible run. Default: OS entropy, never stored. "
            "Anyone who knows the seed can recompute batches and noise (remove the noise): it is recorded in "
            "privacy.json and the card; use it for research only and never reuse it across datasets."
        },
    )
    clipping: str = field(
        default="auto",
        metadata={
            "help": "Per-example clipping engine: ghost (one-backward ghost clipping, hf_dp.clipping.ghost), "
            "ghost_two_pass (ghost clipping in two backward passes: no records kept, ≈ 1.1× the non-private memory — less "
            "than ghost for short sequences and big batches —, about one more input-gradient backward of time), hooks (Opacus per-sample gradients), auto (ghost where "
            "it applies, else hooks).",
            "choices": ["auto", "ghost", "ghost_two_pass", "hooks"],
        },
    )
    cache_frozen_features: bool = field(
        default=False,
        metadata={
            "help": "Compute the frozen prefix (everything below the trained blocks: the last block, or the last K with "
            "last_k:K) once per example and train the suffix from that cache (needs --trainable last_block, last_k:K or head). Privacy is unchanged; the frozen prefix runs in eval "
            "mode (no dropout). Works with --bf16; refused with --bf16_full_eval / --fp16_full_eval (they cast the "
            "frozen prefix the cache was computed from)."
        },
    )
    cache_frozen_features_dtype: str = field(default="float32", metadata={"help": "float32 or bfloat16 storage of the cache."})
    cache_frozen_features_dir: str | None = field(default=None, metadata={"help": "Keep the cache in a memmap file in this folder."})
    first_token_only: str = field(
        default="auto",
        metadata={
            "help": "auto: when the head reads only the first position of the last block's output (BERT/RoBERTa/"
            "ELECTRA-style sequence classifiers), run that block's queries, feed-forward and norms for position 0 "
            "only (exact: same logits and gradients, fewer FLOPs; probed and verified on a dummy batch); off: never.",
            "choices": ["auto", "off"],
        },
    )
    disable_dp: bool = field(default=False, metadata={"help": "Train non-privately (baseline); requires an HF --optim."})
    keep_frozen_features_cache: bool = field(
        default=False,
        metadata={
            "help": "Keep the --cache_frozen_features_dir files (one _hf_dp_prefix_*.bin per cached dataset; they hold "
            "the hidden states of every training example). Default: each file is unlinked as soon as it is created "
            "(nothing is left behind, even after a crash). A cache folder inside --output_dir is refused unless this "
            "flag is given and the folder is output_dir itself or a subfolder whose name starts with '_' (pushes skip '_*')."
        },
    )
    privacy_unit_column: str | None = field(
        default=None,
        metadata={
            "help": "The unit of privacy: a training-set column (e.g. user_id, document_id) whose rows form one unit. "
            "Poisson sampling draws units (q = B/N_units, B counted in units), every row of a drawn unit enters that "
            "logical batch, each unit's summed gradient is clipped to C, and the accountant's N is the number of units: "
            "user-level (epsilon, delta)-DP. Default: each row is its own unit."
        },
    )
    max_rows_per_unit: int | None = field(
        default=None,
        metadata={
            "help": "With --privacy_unit_column: at most this many of a drawn unit's rows (a uniform random subset, drawn "
            "afresh at every step) enter the step; the unit's other rows are dropped from that step. Bounds a "
            "micro-batch's size; the guarantee is unchanged. Default: all rows of a drawn unit."
        },
    )
    dp_max_length: int | None = field(
        default=None,
        metadata={
            "help": "The most tokens of one training row (its padded length): a public bound from which ghost clipping's "
            "float32 rounding allowance is computed, so that each example's clip factor depends on that example alone "
            "(docs/privacy_flags.md). A longer batch is refused. Default: the model's maximum positions (a large "
            "maximum, e.g. Llama's, costs each clipped example a little of C: set it to your truncation length)."
        },
    )
    lm_loss_weighting: str = field(
        default="sequence",
        metadata={
            "help": "Causal LM loss: token mean, or token sum / --dp_max_length.",
            "choices": ["sequence", "token"],
        },
    )
    public_dataset_size: int | None = field(
        default=None,
        metadata={
            "help": "A public size N of the training set (the number of examples, or of units with "
            "--privacy_unit_column), declared instead of counted: q = B/N, sigma, the steps (an epoch is round(N/B) "
            "steps), the planner's batch, the divisor B and delta < 1/N then come from it, and the actual count only "
            "changes how many rows each Poisson draw finds (each example is drawn at rate q), so neighbouring datasets "
            "(add/remove one example or unit) get the same mechanism. Default: the actual count, treated as public "
            "(the run says so, and privacy.json and the card record it)."
        },
    )
    audit_canaries: int | None = field(
        default=None,
        metadata={
            "help": "One-run privacy audit (Steinke, Nasr & Jagielski 2023; hf_dp.audit.canaries): m >= 100 black-box "
            "canaries (random token sequences with random labels), each added to the training set with probability 1/2 "
            "by a draw kept in memory only (never in the model, checkpoints, logs or privacy.json); after training the "
            "canaries are scored, inclusion guessed, and an empirical lower bound on epsilon (at 95 percent confidence) written "
            "to privacy.json and the card: a lower bound that can expose a bug, never a proof of privacy. Every canary "
            "counts as a unit whether included or not: N = real units + m, q = B/N, so epsilon does not depend on the "
            "draw. Single-label sequence classifiers, and causal LMs (canaries without a label, scored by minus their "
            "per-token loss); no resume; 2*m*delta must be < 0.05."
        },
    )
    audit_kind: str = field(
        default="input",
        metadata={"help": "--audit_canaries' canaries: input (black-box: random token sequences with random labels, "
                          "scored by the trained model's label margin; a causal LM's without a label, scored by minus "
                          "their mean per-token loss) or gradient (white-box: each canary's gradient is "
                          "a random direction over the trainable parameters of norm 1000 C, clipped to C and noised "
                          "with its batch; scored by the inner product of the summed privatized gradients with it). "
                          "gradient needs an update rule without a per-sample transform (not dp_sgd_l2, dp_macadam) and "
                          "no --fsdp (hf_dp.audit.canaries)."},
    )
    audit_canary_length: int = field(
        default=32,
        metadata={"help": "Tokens per --audit_canaries canary (special tokens included; capped by the model's positions). "
                          "A public constant, never read from the training rows (canaries that depended on the private "
                          "data would break the guarantee); set it to the padded length of fixed-length data."},
    )
    noise_mechanism: str = field(
        default="independent",
        metadata={
            "help": "independent (DP-SGD's noise, fresh every step) or banded_sqrt (correlated noise that partly "
            "cancels across --noise_bands steps, with cyclic Poisson sampling; docs/guarantee.md).",
            "choices": ["independent", "banded_sqrt"],
        },
    )
    noise_bands: int = field(
        default=1,
        metadata={"help": "b, the bands of --noise_mechanism banded_sqrt (a whole number >= 1; b*q must be <= 1; 1 is "
                          "DP-SGD exactly). Needs --dataloader_num_workers 0."},
    )
    prior_privacy: str = field(
        default="auto",
        metadata={
            "help": "What the ledger does with earlier DP training of the model (hf_dp.run.lineage): auto (count every "
            "earlier run; one warning names those on other data or on data that cannot be compared, e.g. a re-ordered "
            "copy or a model loaded from a release), continue (the same count, without the warning), separate (count "
            "none: the data share no example; refused on the same data), or the path of a release's privacy.json (or "
            "its folder) whose runs start the ledger. With --epsilon the target is the model's total."
        },
    )

    def __post_init__(self):
        name = str(getattr(self.optim, "value", self.optim))
        dp_name = name if is_dp_optimizer(name) else None
        if self.disable_dp and self.audit_canaries:
            raise ValueError("--audit_canaries audits a DP run; a --disable_dp baseline has no epsilon to bound")
        if dp_name is not None:
            if self.disable_dp:
                raise ValueError(
                    f"--optim {dp_name} is a DP optimizer but --disable_dp was given; for a non-private baseline "
                    "use an HF optimizer such as adamw_torch"
                )
            self.optim = "adamw_torch"  # placeholder so TrainingArguments validates; restored below
        elif not self.disable_dp:
            raise ValueError(
                f"--optim {name} is not a DP optimizer: choose one of {', '.join(optimizer_names())}, "
                "or pass --disable_dp explicitly for a non-private baseline"
            )
        if dp_name is not None:
            # refusals and adjustments of HF's flags (fp16, max_grad_norm → 0, ...): hf_dp/flags.py, on the raw
            # values, before HF's own validation (which would e.g. import deepspeed first)
            flags.enforce(self)
        super().__post_init__()
        check_no_full_eval_cast(self)
        if dp_name is not None:
            self.optim = dp_name
            check_no_mixed_precision(self)  # HF reads ACCELERATE_MIXED_PRECISION in its __post_init__
            self._validate_dp()

    @property
    def dp_enabled(self) -> bool:
        return not self.disable_dp

    def _validate_dp(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of --epsilon (target) and --noise_multiplier (sigma)")
        if self.epsilon is not None:
            check_epsilon(self.epsilon)
            if self.epsilon > MAX_EPSILON:
                raise ValueError(
                    f"--epsilon {self.epsilon:g} is above hf_dp's ceiling of {MAX_EPSILON:g}: such a guarantee bounds "
                    "nothing (e^epsilon), and calibrating sigma for it takes minutes; use --epsilon <= "
                    f"{MAX_EPSILON:g}, or --disable_dp for a non-private baseline"
                )
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} must be a whole number >= 1 under DP, got {v!r}")
        if self.noise_multiplier is not None:
            s = self.noise_multiplier
            if not isinstance(s, (int, float)) or math.isnan(s) or math.isinf(s) or s <= 0:
                raise ValueError(f"--noise_multiplier must be a finite number > 0 (sigma = 0 is not private), got {s!r}")
        check_delta(self.delta)
        c = self.per_sample_max_grad_norm
        if not isinstance(c, (int, float)) or math.isnan(c) or math.isinf(c) or c <= 0:
            raise ValueError(f"--per_sample_max_grad_norm (C) must be a finite number > 0, got {c!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"--accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        check_trainable(self.trainable)
        lora_targets(self.lora_target_modules, self.trainable)
        if self.first_token_only not in ("auto", "off"):
            raise ValueError(f"--first_token_only must be 'auto' or 'off', got {self.first_token_only!r}")
        if self.clipping not in ("auto", "ghost", "ghost_two_pass", "hooks"):
            raise ValueError(f"--clipping must be one of auto, ghost, ghost_two_pass, hooks; got {self.clipping!r}")
        if self.privacy_unit_column is not None and (not isinstance(self.privacy_unit_column, str) or not self.privacy_unit_column.strip()):
            raise ValueError(f"--privacy_unit_column must name a column of the training set, got {self.privacy_unit_column!r}")
        k = self.max_rows_per_unit
        if k is not None:
            if self.privacy_unit_column is None:
                raise ValueError("--max_rows_per_unit needs --privacy_unit_column (without it every unit is one row)")
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"--max_rows_per_unit must be a whole number >= 1, got {k!r}")
        m = self.audit_canaries
        if m is not None:  # the limits of hf_dp.audit.canaries.check_canary_count (MIN_CANARIES, AUDIT_BETA)
            if isinstance(m, bool) or not isinstance(m, int) or m < 100:
                raise ValueError(f"--audit_canaries must be a whole number >= 100 (fewer canaries cannot refute any useful "
                                 f"epsilon), got {m!r}")
            if 2 * m * self.delta >= 0.05:
                raise ValueError(f"--audit_canaries {m} with --delta {self.delta:g}: 2*m*delta = {2 * m * self.delta:g} >= "
                                 "0.05, so the one-run bound can certify nothing; use fewer canaries or a smaller delta")
        if self.audit_kind not in ("input", "gradient"):  # hf_dp.audit.canaries.AUDIT_KINDS
            raise ValueError(f"--audit_kind must be one of input, gradient, got {self.audit_kind!r}")
        if m is not None and self.audit_kind == "gradient" and self.fsdp:  # the same sentence as hf_dp.audit.canaries
            raise ValueError("--audit_kind gradient is not supported with --fsdp: the canaries' gradients would be added "
                             "to sharded sums; use --audit_kind input")
        if self.lm_loss_weighting not in ("sequence", "token"):
            raise ValueError(f"--lm_loss_weighting must be sequence or token, got {self.lm_loss_weighting!r}")
        if self.dp_max_length is not None and (isinstance(self.dp_max_length, bool) or int(self.dp_max_length) != self.dp_max_length or self.dp_max_length < 1):
            raise ValueError(f"--dp_max_length must be a whole number >= 1, got {self.dp_max_length!r}")
        n = self.public_dataset_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError("--public_dataset_size must be a whole number >= 1 (the number of training examples, or of "
                             f"units with --privacy_unit_column, declared public), got {n!r}")
        L = self.audit_canary_length
        if isinstance(L, bool) or not isinstance(L, int) or L < 1:
            raise ValueError(f"--audit_canary_length must be a whole number >= 1, got {L!r}")
        if self.bc_gamma is not None and not self.bc_gamma > 0:
            raise ValueError(f"--bc_gamma must be > 0, got {self.bc_gamma}")
        mechanism, bands = check_noise_mechanism(self.noise_mechanism, self.noise_bands)
        if mechanism != "independent" and bands > 1:  # cyclic Poisson sampling: each batch drawn at its own step
            if self.dataloader_num_workers:
                raise ValueError(f"--noise_bands {bands} with --dataloader_num_workers {self.dataloader_num_workers}: "
                                 "worker processes draw batches ahead of the steps, and cyclic Poisson sampling must "
                                 "draw each step's batch from that step's partition; use --dataloader_num_workers 0")


def refuse_token_weighting(args, why: str) -> None:
    """A trainer whose per-example loss is its own (SFT, DPO, reward pairs: ``why``) refuses ``--lm_loss_weighting
    token``, DPTrainer's causal-LM loss; run by the configs and again by the trainers (the config may have changed)."""
    if getattr(args, "lm_loss_weighting", "sequence") != "sequence":
        raise ValueError(f"--lm_loss_weighting token is DPTrainer's causal-LM loss (recipes/clm.py); {why}: drop the "
                         "flag")
