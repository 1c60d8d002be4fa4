"""Every DP stream has the entropy its key (or the OS) gives it, not 32 bits.

PyTorch's CPU generator (Mersenne Twister) keeps only the low 32 bits of ``manual_seed``'s argument, so streams seeded
through it have 2³² possible outputs: among a run's many FSDP noise streams (one per step, parameter and shard) two
drew the same noise after about 2¹⁶ streams (birthday bound), and a DP-score test drawing 20,000 OS-entropy streams
saw a repeated value (CI, this session). ``hf_dp.privacy.randomness.stream_generator`` now sets the generator's
whole state.
"""

from __future__ import annotations

import torch

from hf_dp.privacy.randomness import mix, stream_generator


def _first(gen: torch.Generator, n: int = 8) -> torch.Tensor:
    return torch.randn(n, generator=gen, dtype=torch.float64)


def test_torch_cpu_manual_seed_keeps_32_bits():
    """Why: the premise of the fix (if a torch release changes it, this test says so)."""
    a, b = torch.Generator(), torch.Generator()
    a.manual_seed(5)
    b.manual_seed(5 + (1 << 32))
    assert torch.equal(_first(a), _first(b))


def test_keys_whose_hashes_agree_in_32_bits_draw_different_streams():
    # two keys whose 63-bit hashes agree in their low 32 bits (birthday search over ~2^16 keys)
    seen, pair = {}, None
    for i in range(400_000):
        low = mix(7, "fsdp_noise", i) & 0xFFFFFFFF
        if low in seen:
            pair = (seen[low], i)
            break
        seen[low] = i
    assert pair is not None
    i, j = pair
    assert mix(7, "fsdp_noise", i) != mix(7, "fsdp_noise", j)
    gi, gj = stream_generator(7, "fsdp_noise", i), stream_generator(7, "fsdp_noise", j)
    assert not torch.equal(_first(gi), _first(gj))  # before the fix: the same stream
    assert torch.equal(_first(stream_generator(7, "fsdp_noise", i)), _first(stream_generator(7, "fsdp_noise", i)))
    assert stream_generator(7, "fsdp_noise", i).initial_seed() == mix(7, "fsdp_noise", i)  # still the stream's label


def test_os_entropy_streams_do_not_repeat_and_are_standard_normal():
    draws = torch.stack([_first(stream_generator(None), 1)[0] for _ in range(50_000)])
    assert len(set(draws.tolist())) == draws.numel()  # 2^32 states: ≈ 25 % chance of a repeat among 50,000
    assert abs(float(draws.mean())) < 5 / 50_000**0.5 and abs(float(draws.std()) - 1) < 0.02
    u = torch.rand(200_000, generator=stream_generator(3, "poisson", 0, 0), dtype=torch.float64)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.005
