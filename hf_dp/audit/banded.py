"""The many-run audit of correlated noise (``--noise_mechanism banded_sqrt --noise_bands b``; issue 52 item 6).

What runs
---------
With ``noise_bands`` = b (``python -m hf_dp.audit --noise_bands B``) :func:`hf_dp.audit.many_runs.run_trials` drives the
real b-banded mechanism: :func:`~hf_dp.optim.make_optimizer` with ``noise_mechanism="banded_sqrt", noise_bands=b`` (the
privatizer's :class:`~hf_dp.privacy.banded.BandedNoise`: step t's clipped sum gets σ·C·s·w_t, w = M⁻¹z) and the real
cyclic Poisson sampler (:class:`~hf_dp.privacy.sampler.PoissonBatchSampler` with ``bands=b`` and the rows' partitions:
at step t only partition t mod b is eligible, each of its units drawn at rate b·q). The claim is the real accountant's
ε for that mechanism, :func:`~hf_dp.privacy.accounting.compute_epsilon` with ``bands=b`` (DP-SGD at rate min(1, b·q)
over ⌈T/b⌉ rounds, :func:`~hf_dp.privacy.banded.dp_sgd_equivalent`). b = 1 is today's audit: with
``noise_mechanism="banded_sqrt", noise_bands=1`` the noise (``BandedNoise(1)`` returns z) and the draws (the plain
Poisson draw) are today's, bit for bit (``tests/test_audit_banded.py`` checks it).

The canary's partition (:func:`audit_partitions`). Every canary row is in partition 0, the background rows in
partitions i mod b. Partition 0 is the audited position — the worst case the accounting allows: its steps are
0, b, 2b, …, ⌈T/b⌉ of them (the most any partition gets, the accountant's rounds), and when b divides T every one of
their columns of M~ = M/s is complete (b entries, norm exactly 1), so the equivalence with DP-SGD is exact for it; a unit
of partition j > 0 has as many steps only if j < T mod b, and its last column may be cut by the end of the run (norm
< 1: less signal). The assignment is passed to the sampler directly rather than hashed from the row
(:func:`hf_dp.privacy.cyclic.row_partitions`): the accounting holds for any fixed public assignment, and a
trainer-side adversary reaches the same position by choosing the canary's content until its hash lands in partition 0
(b tries on average).

Batched trials stay exact (K coordinates = K independent trials, see :mod:`hf_dp.audit.many_runs`): (i) each row's
gradient is supported on its own trial's coordinate, so joint clipping is per-trial clipping; (ii) the banded noise is
i.i.d. across coordinates: z_t is i.i.d. N(0, (σCs)²) per coordinate and :meth:`BandedNoise.correlate` is an
element-wise linear recursion along the steps (w_t = z_t − Σ_k c_k w_{t−k}, coordinate by coordinate), so coordinate k's
noise sequence depends on coordinate k's draws only and is identically distributed in every k; (iii) the batchable
rules act coordinate-wise with public scalars (the noise figure σ·C·s·√V_n/B of DP-AdamBC/-AdamW-BC depends on the step's
position only); (iv) the sampler draws each unit with its own uniform, so the canaries (all in partition 0) are
included independently of each other.

The statistic. The test statistic stays ⟨θ_0 − θ_T, u⟩. It is valid for the banded mechanism as for any: θ_T is a
post-processing of the released privatized gradients, themselves the post-processing s·M⁻¹(M~x + σCz) of the analysed
mechanism. It is not the most powerful one: for one unit of partition 0 the likelihood ratio of the whole sequence of
privatized gradients y is a function of the whitened projections ⟨M y/s, M~e_t⟩ at its steps t (complete columns with
disjoint supports: independent N(σ-scaled participation, σ²C²)), i.e. exactly the DP-SGD-equivalent test. For a
deterministic participation (b·q = 1) the final iterate is a linear test of y whose signal-to-noise ratio is
(participations)/(σ·s·‖M⁻ᵀ1‖) for SGD, against the likelihood-ratio test's √⌈T/b⌉/σ: a fraction that grows with T/b
towards (Σ_k c_k)/(√b·s) (Cauchy–Schwarz: ≤ 1) — 0.90, 0.92, 0.94 for b = 2 at T = 8, 16, 64; 0.81, 0.85, 0.88 for
b = 4 at T = 16, 32, 128; 0.74, 0.79 for b = 8 at T = 32, 64 — so with b·q = 1 and small b this audit loses little. With b·q < 1 the likelihood ratio
Σ_t log(1 − p + p·e^((a_t − ½)/σ²)) would weigh each step's evidence and be stronger in the tails; it needs every
step's privatized gradient, which this audit does not record. And for the broken variant below the final iterate is
*more* powerful than the claimed mechanism's likelihood ratio when T/b is large (the over-stated cancellation shows in
the sum: at b = 2, T = 64 its SNR is 13.4/σ against 12.0/σ for the banded whitening, √32/σ = 5.66/σ claimed).

The one-run audit (``--audit_canaries`` with ``--noise_bands``; ``python -m hf_dp.audit --one_run --noise_bands B``).
Its assumptions hold for banded noise: each canary is included independently with probability ½ before training, and
then trained as any unit — each canary unit, included or not, gets its cyclic Poisson partition from a hash of its own
public content (:meth:`hf_dp.audit.canaries.TrainerCanaries.identities`, :func:`hf_dp.run.setup.cyclic_partitions`),
never from its bit, and is drawn at its partition's steps at rate b·q; the bound needs the mechanism to be (ε, δ)-DP
for adding or removing any one unit, which the accounting gives for any fixed public assignment. Gradient canaries are
scored by the likelihood ratio of the whitened privatized gradients at their partition's steps
(:class:`hf_dp.audit.canary_kinds.BandedLikelihoodRatio`), the claimed mechanism's Neyman–Pearson test.

The broken variant (``variant="banded_overstated"``): the cancellation over-stated. The privatizer gets the full square
root factorization — ``BandedNoise(T)``: the coefficients c_0 … c_{T−1} over the run, its own column norm s_T — while
the sampler keeps the b partitions and the accountant is told b bands. A realistic wiring bug (the noise's band count
taken from the run length instead of ``--noise_bands``, or the truncation dropped): every step's noise is still scaled
by its own factor's column norm, so each step alone looks as private as claimed, but the full factor's columns overlap,
and the unit's participations b steps apart add up coherently in the prefix sums the noise cancels in: the true
sensitivity ‖M~_T x‖ exceeds √⌈T/b⌉ and grows with T/b (√32 = 5.66 claimed against 16.8 at b = 2, T = 64). The same
negative control as ``tests/test_correlated_accounting.py``, through the real privatizer and sampler. It needs T > b
(with T ≤ b the banded factor is the full one).
"""

from __future__ import annotations

from hf_dp.privacy.banded import BANDED_SQRT, INDEPENDENT, check_noise_mechanism, cyclic_rate

#: the broken variant with the cancellation over-stated (see the module docstring)
OVERSTATED = "banded_overstated"


def claimed_mechanism(cfg) -> tuple[str, int]:
    """``(noise_mechanism, b)`` the accountant is told: ``cfg.noise_mechanism`` (``None``: ``banded_sqrt`` when
    ``cfg.noise_bands`` > 1, else ``independent``) and ``cfg.noise_bands``, validated (``ValueError``)."""
    bands = cfg.noise_bands
    mechanism = cfg.noise_mechanism or (BANDED_SQRT if isinstance(bands, int) and bands > 1 else INDEPENDENT)
    return check_noise_mechanism(mechanism, bands)


def privatizer_noise(cfg) -> tuple[str, int]:
    """``(noise_mechanism, noise_bands)`` the privatizer is built with: the claimed ones, or for
    ``banded_overstated`` the full square root over the run (``banded_sqrt`` with T bands)."""
    if cfg.variant == OVERSTATED:
        return BANDED_SQRT, int(cfg.steps)
    return claimed_mechanism(cfg)


def sampler_bands(cfg) -> int:
    """The b of the cyclic Poisson sampler (1: plain Poisson sampling): the claimed b (1 for independent noise)."""
    mechanism, bands = claimed_mechanism(cfg)
    return 1 if mechanism == INDEPENDENT else bands


def audit_partitions(background: int, canaries: int, bands: int):
    """``[background + canaries]`` partitions: background row i in partition i mod b, every canary row in partition 0
    (the audited position, see the module docstring); ``None`` for b = 1."""
    import torch

    if bands == 1:
        return None
    return torch.cat([torch.arange(background) % bands, torch.zeros(canaries, dtype=torch.long)])


def check(cfg) -> None:
    """The banded settings of a mechanism-path audit, one sentence each (``ValueError``, starting ``error:``)."""
    try:
        _, bands = claimed_mechanism(cfg)
    except ValueError as e:
        raise ValueError(f"error: {e}") from None
    b = sampler_bands(cfg)
    try:
        cyclic_rate(cfg.sample_rate, b)  # b·q ≤ 1
    except ValueError as e:
        raise ValueError(f"error: {e}".replace("q = B/N", "--sample_rate q")) from None
    if cfg.variant == OVERSTATED and not cfg.steps > bands:
        raise ValueError(f"error: --variant {OVERSTATED} needs --steps > --noise_bands (the full square root over "
                         f"{cfg.steps} steps is the {bands}-banded one when the run has at most {bands} steps)")
