"""The privacy state of one ``DPTrainer`` run, in one object: :class:`PrivacyState` (``DPTrainer.dp``).

``DPTrainer`` makes an empty one when it is built; :func:`hf_dp.run.setup.setup_privacy` fills it once (the
:class:`~hf_dp.privacy.mechanism.Mechanism`, the ledger, the sampler, the clipping engine, the units); the rest of
hf_dp reads and updates its parts, never the trainer's attributes. What each part holds and who writes it:

================== ============================================== =================================================
part               holds                                          written by
================== ============================================== =================================================
``enabled``        a DP run (fixed at construction)               ``DPTrainer.__init__``
``mechanism``      the planned mechanism (immutable, public)      ``hf_dp.run.setup.setup_privacy``; a private
                                                                  selection's holder restates its target ε
``ledger``         the ε ledger (this model's runs)               setup; ``hf_dp.run.lineage`` continues it
``sampler``        the Poisson sampler                            setup
``optimizer``      the privatizer over the update rule            ``DPTrainer.create_optimizer``
``engine``         the per-example clipping engine                setup (``--audit_kind gradient`` wraps it)
``units``          the rows of each privacy unit (:class:`Units`) setup; ``--audit_canaries`` appends its own
``randomness``     the randomness source's name                   setup
``step``           what the current micro-batch left for the      ``DPTrainer.compute_loss`` / ``training_step``,
                   engine (:class:`MicroBatch`)                   the independence probe
``contract``       the planned snapshot the checks compare with   setup; ``hf_dp.run.contract`` (rows checked)
                   (:class:`ContractState`)
``lineage``        the resume and lineage records                 ``hf_dp.run.lineage``, ``hf_dp.run.spent``
                   (:class:`LineageState`)
``audit``          ``--audit_canaries``' state and record         ``hf_dp.audit.canaries``
``selection``      a private selection's record (:class:`Selection`) ``hf_dp.tuning.search``
================== ============================================== =================================================

Nothing here is written to disk as such: the ledger goes into ``optimizer.pt`` through the privatizer's state, and
privacy.json is written from the mechanism and the ledger (:mod:`hf_dp.hub.report`). The sampling key (``sampling_key``)
lives only for one ``train()``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any


@dataclass(repr=False)
class Units:
    """The privacy units: under ``--privacy_unit_column`` the training rows of each unit (read once at set-up) and each
    row's unit; ``count`` is the actual number of units (rows without the column), ``--audit_canaries``' m included."""

    rows: list | None = None
    of_row: Any = None  # torch.LongTensor: row -> unit
    count: int = 0


@dataclass(repr=False)
class MicroBatch:
    """What one micro-batch's ``compute_loss`` leaves for ``training_step`` to hand to the engine (reset after it)."""

    loss_scale: float | None = None  # the factor HF applied to the loss before backward (its hook's gradient)
    units: Any = None  # the micro-batch's row -> unit map (0..U-1), under units
    empty: bool = False  # an empty micro-batch's placeholder row: its backward adds nothing
    rows: int | None = None  # rows in the micro-batch
    canary_loss: Any = None  # --audit_canaries: the input canaries' share, kept out of the logged loss


@dataclass(repr=False)
class ContractState:
    """What every ``train()`` and every step compares with (:mod:`hf_dp.run.contract`)."""

    planned: dict | None = None  # the mechanism snapshot taken at set-up (hf_dp.run.contract.mechanism_snapshot)
    planned_dataset: Any = None  # the training set σ, q and the steps were planned for
    probe: bool = False  # the independence probe is running (no clipping, no records)
    rows_checked: Any = None  # the collator whose rows were checked (hf_dp.run.contract.check_every_row)
    several_rows: bool = False  # that collator gives several rows per example
    partitions: Any = None  # cyclic Poisson sampling: recomputes the partitions' digest from the training set as given
    #: a random number of this trainer that its training loader's collator puts in every micro-batch it makes
    #: (hf_dp.run.draws.DRAWN_KEY): a micro-batch without it did not come from DPTrainer's Poisson loader
    loader_token: int = field(default_factory=lambda: secrets.randbits(62))
    last_draw: int | None = None  # the sampler's number of the last micro-batch trained on (strictly increasing)
    #: (logical draw, micro-batches of it trained on) of the step being accumulated: the next micro-batch must be the
    #: next of that logical draw, or (once all were) micro-batch 0 of a new one; ``None`` at every train()
    accumulating: tuple | None = None
    seen_yielded: int = 0  # the sampler's yielded count at the last missing tag (did DPTrainer's loader draw since?)
    loader_dataset: tuple | None = None  # the training loader's datasets (HF's; with unit tags): DPTrainer.num_examples


@dataclass(repr=False)
class LineageState:
    """The run's place in the model's history (:mod:`hf_dp.run.lineage`, :mod:`hf_dp.run.spent`)."""

    refs: dict = field(default_factory=dict)  # the models' public ledger records this trainer has read
    data: Any = None  # the training data's reference (hf_dp.run.lineage.DataRef)
    budget_steps: int | None = None  # the budget stop's steps, once computed
    resume_steps: int | None = None  # ledger steps at a resume's start
    resume_start: int | None = None  # this run's steps past its resume start here
    resumed_ledger_steps: int | None = None  # the ledger's steps just after a resume's load
    resumed_from: str | None = None  # the checkpoint train() resumed from


@dataclass(repr=False)
class Selection:
    """A private hyper-parameter selection (:mod:`hf_dp.tuning.search`) run from, or released by, this trainer."""

    record: dict | None = None  # privacy.json's hyperparameter_selection (the released model's)
    started: bool = False  # a search began here: its budget is spent, no second one
    models: list = field(default_factory=list)  # weak references to the models used, to refuse their reuse
    score_sets: tuple = ()  # the held-out private sets a DP score read: never evaluated afterwards
    trial: int | None = None  # this trainer is (or holds) trial number `trial` of a private selection


@dataclass(repr=False)
class PrivacyState:
    """The privacy state of one run (see the module docstring): ``DPTrainer.dp``. Its ``repr`` names the public
    mechanism only: the parts hold private facts (each unit's rows, the actual count under a declared N, the sampling
    key of a ``train()``) that a printed trainer or a log line must not show."""

    enabled: bool = False  # a DP run (not --disable_dp), fixed when built (hf_dp.run.contract.check_private_fixed)
    mechanism: Any = None  # hf_dp.privacy.mechanism.Mechanism
    ledger: Any = None  # hf_dp.privacy.accounting.PrivacyLedger
    sampler: Any = None  # hf_dp.privacy.sampler.PoissonBatchSampler
    optimizer: Any = None  # hf_dp.privacy.privatizer.PrivateOptimizer (create_optimizer)
    engine: Any = None  # hf_dp.clipping.engines.ClippingEngine
    clipping: str | None = None  # the engine's name (ghost, ghost_two_pass, hooks)
    bounds: Any = None  # hf_dp.clipping.common.TokenBounds: the run's public token bounds
    loss_token_norm: int | None = None  # --lm_loss_weighting token: the public length a sequence's token sum is divided by
    randomness: str | None = None  # hf_dp.privacy.randomness: entropy, csprng or seeded
    noise_seed: int | None = None  # --dp_seed (None: not seeded)
    run_id: str | None = None  # a random public id of this run (a resume is a new run)
    fsdp: bool = False  # FSDP2 under DP (hf_dp.clipping.sharding)
    sampling_key: bytes | None = None  # several ranks under OS entropy: rank 0's key of this train() only
    lengths_of: Any = None  # the dataset the sampler's lengths were read from (group_by_length)
    plan_announced: bool = False  # the planner's block was printed (not for a selection's holder)
    plan_expectation: Any = None  # hf_dp.plan.Expectation: the result the block said to expect (the recipes' summary)
    units: Units = field(default_factory=Units)
    step: MicroBatch = field(default_factory=MicroBatch)
    contract: ContractState = field(default_factory=ContractState)
    lineage: LineageState = field(default_factory=LineageState)
    audit: Any = None  # hf_dp.audit.canaries' state under --audit_canaries
    audit_record: dict | None = None  # the one-run audit's record, once audited
    selection: Selection = field(default_factory=Selection)
    saving_checkpoint: bool = False  # HF is writing a checkpoint (save_model writes no release then)

    def __repr__(self) -> str:
        return f"PrivacyState(mechanism={self.mechanism!r}, clipping={self.clipping!r}, randomness={self.randomness!r})"

    @property
    def spec(self):
        """The accountant's numbers (:class:`~hf_dp.privacy.accounting.PrivacySpec`) of the planned mechanism."""
        return None if self.mechanism is None else self.mechanism.spec
