"""Where the DP randomness comes from: Poisson inclusion draws and Gaussian noise.

The accountant assumes that every step's batch and every step's noise are *fresh*: independent of
every other step's. Nothing has to be replayed — not after a resume, not in a second ``train()`` —
so hf_dp never stores a seed or a generator state, and three sources cover every use:

* **OS entropy** (default): each stream is a ``torch.Generator`` (Mersenne Twister, fast, on the
  parameters' device) seeded with 64 bits from :func:`secrets.randbits` when the stream starts —
  once per sampler iteration, once per privatizer (a resumed or rebuilt optimizer starts a new one).
  The seed is held only in memory. MT is not a cryptographic generator: its seed is unpredictable,
  but whoever observes enough of its *output* could in principle reconstruct its state; the noise
  itself is never released, only noisy sums, so this is the usual choice of DP libraries (Opacus'
  default) — ``--secure_rng`` removes the question.
* **A fixed seed** (``--dp_seed``, reproducible research): each stream is seeded by a hash of
  (seed, purpose, rank, the ledger step at which the stream starts). An uninterrupted run is
  reproducible; a resumed run or a second ``train()`` starts new, independent streams (the ledger step
  differs), so no batch or noise is ever reused. Whoever knows the seed can recompute the batches and
  the noise, i.e. remove the noise from a released model's updates: the card and ``privacy.json`` say so.
* **A cryptographically secure generator** (``--secure_rng``): uniforms from :func:`os.urandom` (the
  kernel's CSPRNG), 53 bits each; Gaussians by Box–Muller in float64; the noise of each coordinate is
  the sum of four such Gaussians divided by 2 — Opacus' ``secure_mode`` construction against
  floating-point attacks (Holohan et al. 2021, n = 2) — computed on the CPU and moved to the
  parameters' device. It cannot be seeded.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets

import torch

#: names of the three sources (recorded in privacy.json)
ENTROPY, SEEDED, CSPRNG = "os_entropy", "fixed_seed", "csprng"


def mix(*parts) -> int:
    """A 63-bit seed from a tuple (SHA-256): independent-looking streams for distinct tuples."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def source_name(seed: int | None, secure: bool) -> str:
    if secure and seed is not None:
        raise ValueError("--secure_rng draws from the OS CSPRNG and cannot be seeded: drop --dp_seed (or --secure_rng)")
    return CSPRNG if secure else (SEEDED if seed is not None else ENTROPY)


def stream_generator(seed: int | None, *key, device="cpu") -> torch.Generator:
    """A new ``torch.Generator`` on ``device``: seeded by ``mix(seed, *key)``, or from OS entropy when ``seed`` is None."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else mix(seed, *key))
    return gen


def csprng_uniform(n: int) -> torch.Tensor:
    """``n`` float64 uniforms in (0, 1] from the OS CSPRNG (53 random bits each)."""
    if n <= 0:
        return torch.zeros(0, dtype=torch.float64)
    words = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
    return ((words & ((1 << 53) - 1)).to(torch.float64) + 1.0) * 2.0**-53


def csprng_normal(n: int) -> torch.Tensor:
    """``n`` standard normal float64 draws from the OS CSPRNG (Box–Muller)."""
    half = (n + 1) // 2
    u = csprng_uniform(2 * half)
    r = torch.sqrt(-2.0 * torch.log(u[:half]))
    theta = (2.0 * math.pi) * u[half:]
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)])[:n]


def secure_gaussian_like(reference: torch.Tensor, std: float) -> torch.Tensor:
    """N(0, std²) noise shaped like ``reference`` from the OS CSPRNG: (Σ of 4 Gaussians)/2 per
    coordinate (Opacus' secure-mode construction), in float64, cast to ``reference``'s dtype and device."""
    n = reference.numel()
    if std == 0 or n == 0:
        return torch.zeros_like(reference)
    z = csprng_normal(4 * n).view(4, n).sum(0) * (0.5 * std)
    return z.view(reference.shape).to(device=reference.device, dtype=reference.dtype)
