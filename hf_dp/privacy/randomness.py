"""Where the DP randomness comes from: Poisson inclusion draws and Gaussian noise.

The accountant assumes that every step's batch and every step's noise are *fresh*: independent of
every other step's. Nothing has to be replayed — not after a resume, not in a second ``train()`` —
so hf_dp never stores a seed or a generator state, and three sources cover every use:

* **OS entropy** (default): each stream is a ``torch.Generator`` (Mersenne Twister on the CPU, Philox on
  CUDA; fast, on the parameters' device) started from fresh OS entropy (:mod:`secrets`) when the stream
  starts — once per sampler iteration, once per privatizer (a resumed or rebuilt optimizer starts a new
  one), once per (step, parameter, shard) under FSDP. With several processes the sampler's stream must be the same
  on every rank (:mod:`hf_dp.privacy.sampler`: all draw one sample and share it out): rank 0 draws a key of 256 bits
  of OS entropy at every ``train()`` and broadcasts it in memory (:func:`shared_entropy_key`); each iteration's
  stream is keyed by (that key, the ledger step at which it starts), and the key is forgotten when ``train()``
  ends. On the CPU the whole 19,968-bit Mersenne Twister state
  is set (:func:`stream_generator`): ``manual_seed`` keeps only the low 32 bits of a seed there, so
  streams seeded through it would have 2³² possible outputs and two of a run's many FSDP streams would
  draw the same noise after about 2¹⁶ streams (birthday bound). The state is held only in memory. MT is not a cryptographic generator: its seed is unpredictable,
  but whoever observes enough of its *output* could in principle reconstruct its state; the noise
  itself is never released, only noisy sums, so this is the usual choice of DP libraries (Opacus'
  default) — ``--secure_rng`` removes the question.
* **A fixed seed** (``--dp_seed``, reproducible research): each stream's state is derived from a hash of
  (seed, purpose, the ledger's stream tag when set, rank — 0 for the Poisson draw that all ranks share —, the ledger
  step at which the stream starts; FSDP's noise shards by parameter and offset) — on the CPU
  the whole Mersenne Twister state, expanded from SHAKE-256 of that key, so distinct keys never share a stream. An
  uninterrupted run is reproducible, and so is a clean continuation of its checkpoint (nothing computed past it, no
  other resume of it: the tag stays unset); a ``train()`` that continues a ledger without resuming (a second
  ``train()``, a new trainer on a model carrying its ledger) tags its streams with its run id and start step
  (:func:`hf_dp.run.lineage.before_train`: a clean resume of the run's checkpoint may start at the same step), and any other resume — e.g. of checkpoint-2 after its run went on to checkpoint-4, whose own resume
  starts at the same ledger step — tags its streams with its own run id
  (:func:`hf_dp.run.spent.reconcile_resumed_ledger`), so no batch or noise is ever reused. Whoever knows the seed can recompute the batches and
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


def derived_seed(seed: int, *key) -> int:
    """A 256-bit seed from ``(seed, *key)`` (SHA-256 of the whole seed and key): the ``--dp_seed`` of a sub-run (a
    private selection's trial) or the seed of a Python ``random.Random`` (which uses every bit of an int seed), so that
    two distinct seeds never key the same stream (a 31- or 32-bit derived seed would, e.g. 5 and 5 + 2³² after
    ``manual_seed``)."""
    return int.from_bytes(hashlib.sha256(":".join(str(p) for p in (seed, *key)).encode()).digest(), "little")


def source_name(seed: int | None, secure: bool) -> str:
    if secure and seed is not None:
        raise ValueError("--secure_rng draws from the OS CSPRNG and cannot be seeded: drop --dp_seed (or --secure_rng)")
    return CSPRNG if secure else (SEEDED if seed is not None else ENTROPY)


#: PyTorch's CPU generator state (``torch.Generator.get_state()``): the Mersenne Twister's 624 32-bit words are stored
#: as little-endian uint64 at this byte offset (after the initial seed, ``left``, ``seeded`` and ``next``)
_MT_WORDS, _MT_OFFSET, _MT_STATE_BYTES = 624, 24, 5056


def _mt_words(seed: int | None, key: tuple) -> bytes:
    """624 32-bit words as little-endian uint64 (the layout of the generator state): from the OS CSPRNG (``seed``
    None), else SHAKE-256 of (seed, *key)."""
    import numpy as np

    if seed is None:
        raw = secrets.token_bytes(4 * _MT_WORDS)
    else:
        raw = hashlib.shake_256(":".join(str(p) for p in (seed, *key)).encode()).digest(4 * _MT_WORDS)
    return np.frombuffer(raw, dtype="<u4").astype("<u8").tobytes()


def stream_generator(seed: int | None, *key, device="cpu") -> torch.Generator:
    """A new ``torch.Generator`` on ``device`` keyed by ``(seed, *key)``, or from OS entropy when ``seed`` is None.

    On the CPU (Mersenne Twister) the generator's whole state is set — 624 words from the OS CSPRNG or from SHAKE-256 of
    the key — because ``manual_seed`` there keeps only the seed's low 32 bits (2³² streams in all; distinct keys would
    collide, e.g. two FSDP noise streams of one run drawing the same noise). ``initial_seed()`` still reports
    ``mix(seed, *key)`` (a label of the stream, not its state). On CUDA (Philox, 64-bit seeds) ``manual_seed`` with a
    63-bit hash or 63 bits of OS entropy."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else mix(seed, *key))
    if gen.device.type != "cpu":
        return gen
    state = gen.get_state()
    if state.numel() != _MT_STATE_BYTES:  # pragma: no cover - a torch whose CPU generator state has another layout
        raise RuntimeError(f"hf_dp: unexpected torch CPU generator state ({state.numel()} bytes, expected "
                           f"{_MT_STATE_BYTES}): re-check hf_dp.privacy.randomness.stream_generator for this torch")
    raw = bytearray(state.numpy().tobytes())
    raw[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS] = _mt_words(seed, key)
    raw[8:12] = (1).to_bytes(4, "little", signed=True)  # left = 1: the next draw regenerates (twists) the state
    gen.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
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


#: bits of the ranks' shared sampling key
SHARED_KEY_BITS = 256


def shared_entropy_key(device=None) -> int | None:
    """A key of :data:`SHARED_KEY_BITS` bits of OS entropy that every process of the default group holds: rank 0's,
    broadcast in memory (a collective: every rank calls it at the same point); ``None`` with one process or without
    torch.distributed. ``device``: where the broadcast tensor lives (the CPU under gloo; the rank's accelerator under
    NCCL)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if device is None or dist.get_backend() == "gloo":
        device = torch.device("cpu")
    t = torch.frombuffer(bytearray(secrets.token_bytes(SHARED_KEY_BITS // 8)), dtype=torch.uint8).to(device)
    dist.broadcast(t, src=0)  # every rank's own bytes are replaced by rank 0's
    return int.from_bytes(bytes(t.cpu().tolist()), "little")
