"""Every DP stream has the entropy its key (or the OS) gives it, not 32 bits.

PyTorch's CPU generator (Mersenne Twister) keeps only the low 32 bits of ``manual_seed``'s argument, so streams seeded
through it have 2³² possible outputs: among a run's many FSDP noise streams (one per step, parameter and shard) two
drew the same noise after about 2¹⁶ streams (birthday bound), and a DP-score test drawing 20,000 OS-entropy streams
saw a repeated value (in CI). ``hf_dp.privacy.randomness.stream_generator`` now sets the generator's
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


# ------------------------------------------------------------------ --dp_seed values equal modulo 2^32 (issue 38 item 1)
#: seeds whose low 32 bits agree: a fresh run's noise stream seeded by manual_seed(dp_seed) drew the same noise for both
SEED_PAIRS = [(5, 5 + 2**32), (7, 7 + 3 * 2**32), (2**32 - 1, 2**33 - 1), (123, 123 + 2**40)]


def _privatizer_noise(seed: int, steps: int = 3) -> torch.Tensor:
    """The noise a fresh privatizer with ``noise_seed=seed`` adds at its first ``steps`` steps (nothing summed)."""
    import opacus

    from hf_dp.optim import make_optimizer

    model = torch.nn.Linear(6, 3).double()
    opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                         noise_seed=seed, lr=0.0)
    out = []
    for _ in range(steps):
        opt.step()
        out.append(torch.cat([p.grad.reshape(-1) for p in opt.params]).clone())
    return torch.stack(out)


def test_privatizer_seeds_equal_modulo_2_to_the_32_draw_different_noise():
    for a, b in SEED_PAIRS:
        na, nb = _privatizer_noise(a), _privatizer_noise(b)
        assert not torch.allclose(na, nb), (a, b)  # before the fix: identical at every step
        assert torch.equal(na, _privatizer_noise(a))  # the same seed still reproduces the noise exactly
        assert float(na.abs().min()) > 0


def test_two_runs_with_dp_seed_5_and_5_plus_2_to_the_32_draw_different_noise(tmp_path, monkeypatch):
    """Whole DPTrainer runs: before the fix the two runs added the same noise at every step (the Poisson draws,
    keyed by stream_generator, already differed); a rerun with the same seed reproduces every draw and noise."""
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, spy_draws_and_noise

    draws, noises = spy_draws_and_noise(monkeypatch)
    tok = make_tokenizer(tmp_path / "tok")
    ds, collator = make_pair_dataset(tok, n=32, seed=0), make_collator(tok)

    def run(seed, out):
        del draws[:], noises[:]
        args = dp_args(str(tmp_path / out), epsilon=None, noise_multiplier=1.0, max_steps=3,
                       per_device_train_batch_size=8, dp_seed=seed, save_strategy="no")
        DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=collator).train()
        return list(draws), list(noises)

    d5, n5 = run(5, "a")
    d5b, n5b = run(5, "b")
    dbig, nbig = run(5 + 2**32, "c")
    assert len(n5) == len(nbig) == 3
    assert d5 == d5b and all(torch.equal(x, y) for x, y in zip(n5, n5b))  # same seed: the same run
    for x, y in zip(n5, nbig):  # before the fix: equal up to the rounding of grad - summed_grad (1e-8)
        assert not torch.allclose(x, y, atol=1e-3)
