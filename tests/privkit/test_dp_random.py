"""DP randomness: AES-CTR keyed from the OS in release mode, torch's own draws in reproducible mode.

References: the AES-128 known answer (all-zero key and block -> 66e94bd4ef8a2c3b884cfa59ca342b2e,
the first vector of NIST's AESAVS KeySbox/VarTxt tables); torch's own generator for the
reproducible streams; N(0, sigma^2) and Binomial(n, q) for the release streams (KS and moment
tests at fixed keys, so they cannot flake).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from randomgen import AESCounter
from scipy import stats

from privkit.mechanisms import gaussian_release
from privkit.mechanisms.dp_random import DpRandom, aes_generator
from privkit.mechanisms.dp_sgd_step import poisson_batch
from privkit.mechanisms.opacus_streams import _PoissonBatches, use_noise_source
from privkit.seeding import derive_seed, noise_generator, noise_rng, torch_generator


def test_stream_is_aes128_counter_mode():
    block = aes_generator(key=0).bit_generator.random_raw(2).astype("<u8").tobytes()
    assert block.hex() == "66e94bd4ef8a2c3b884cfa59ca342b2e"


def test_release_streams_are_aes_and_fresh():
    a, b = (
        noise_generator(7, "noise", reproducible=False),
        noise_generator(7, "noise", reproducible=False),
    )
    assert isinstance(a.source.bit_generator, AESCounter) and not a.seeded_torch
    assert not torch.equal(a.randn(16), b.randn(16))
    assert not torch.equal(a.mask(64, rate=0.5), b.mask(64, rate=0.5))
    assert not torch.equal(a.randperm(64), b.randperm(64))
    r1, r2 = noise_rng(7, "x", reproducible=False), noise_rng(7, "x", reproducible=False)
    assert isinstance(r1.bit_generator, AESCounter)
    assert (
        r1.bit_generator.state["s"]["seed"].tolist() != r2.bit_generator.state["s"]["seed"].tolist()
    )
    with pytest.raises(ValueError, match="key"):
        aes_generator(key=2**128)


def test_reproducible_mode_draws_exactly_as_torch():
    src = noise_generator(5, "noise", reproducible=True)
    ref = torch_generator(derive_seed(5, "noise"))
    assert src.seeded_torch
    assert torch.equal(src.randn(3, 7), torch.randn(3, 7, generator=ref))
    assert torch.equal(
        src.randn((4,), dtype=torch.float64), torch.randn(4, generator=ref, dtype=torch.float64)
    )
    assert torch.equal(src.mask(2, 50, rate=0.3), torch.rand(2, 50, generator=ref) < 0.3)
    assert torch.equal(src.randperm(20), torch.randperm(20, generator=ref))
    out, ref_out = torch.empty(2, 5), torch.empty(2, 5)
    src.randn(2, 5, out=out)
    torch.randn(2, 5, generator=ref, out=ref_out)
    assert torch.equal(out, ref_out)
    # a plain torch generator passed to the DP-SGD step is drawn from as before
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(
        poisson_batch(100, 0.2, g1), torch.nonzero(torch.rand(100, generator=g2) < 0.2).flatten()
    )


def test_release_noise_is_gaussian_with_the_requested_std():
    sigma = 1.7
    src = DpRandom(aes_generator(key=12345))
    total = {"w": torch.zeros(300, 400), "b": torch.zeros(400)}
    z = (
        torch.cat(
            [
                v.flatten()
                for v in gaussian_release(total, std=sigma, sensitivity=1.0, source=src)[0].values()
            ]
        )
        .double()
        .numpy()
    )
    assert stats.kstest(z, "norm", args=(0.0, sigma)).pvalue > 1e-3
    n = len(z)  # mean within 5 standard errors; variance within 5 (its sd is sigma^2 sqrt(2 / n))
    assert abs(z.mean()) < 5 * sigma / np.sqrt(n)
    assert abs(z.var() - sigma**2) < 5 * sigma**2 * np.sqrt(2 / n)
    z64 = src.randn(50_000, dtype=torch.float64)
    assert z64.dtype == torch.float64 and stats.kstest(z64.numpy(), "norm").pvalue > 1e-3
    into = torch.empty(2, 3)
    assert src.randn(2, 3, out=into) is into and torch.isfinite(into).all()


def test_release_sampling_rates_and_permutations():
    src = DpRandom(aes_generator(key=99))
    n, q, reps = 500, 0.05, 400
    counts = torch.stack([src.mask(n, rate=q) for _ in range(reps)]).sum(1).numpy()
    # batch sizes are Binomial(n, q): mean within 5 standard errors, dispersion test on the variance
    assert abs(counts.mean() - n * q) < 5 * np.sqrt(n * q * (1 - q) / reps)
    assert stats.chi2.sf(counts.var(ddof=1) * (reps - 1) / (n * q * (1 - q)), reps - 1) > 1e-3
    perm = src.randperm(1000)
    assert perm.dtype == torch.int64 and sorted(perm.tolist()) == list(range(1000))
    sizes = [len(b) for b in _PoissonBatches(n, q, reps, src)]
    assert len(sizes) == reps and abs(np.mean(sizes) - n * q) < 5 * np.sqrt(n * q * (1 - q) / reps)


def test_opacus_noise_swap_adds_gaussian_noise_of_std_sigma_c():
    p = torch.nn.Parameter(torch.zeros(200, 100))
    p.summed_grad = torch.zeros(200, 100)
    opt = types.SimpleNamespace(noise_multiplier=0.8, max_grad_norm=2.5, params=[p])
    use_noise_source(opt, DpRandom(aes_generator(key=7)))
    opt.add_noise()
    assert p.grad.shape == p.shape
    assert stats.kstest(p.grad.flatten().double().numpy(), "norm", args=(0.0, 2.0)).pvalue > 1e-3
