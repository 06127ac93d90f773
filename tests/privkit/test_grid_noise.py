"""Release-mode noise on a data-independent grid (privkit.mechanisms.grid_noise).

References: the rounded Gaussian's pmf ``Phi((k + 1/2) / s) - Phi((k - 1/2) / s)`` (scipy) for the
sampler (chi-square at fixed keys, so the tests cannot flake; the same test rejects the discrete
Gaussian, so it can fail); mpmath at 200 bits for float64 ``ndtri``; exact rational arithmetic
(``fractions``) for the grid arithmetic; the Gaussian mechanism's closed-form hockey-stick
divergence (Balle & Wang 2018) for the accounting, against the exact divergence of the released
integers and of Canonne, Kamath & Steinke's discrete Gaussian.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath as mp
import numpy as np
import pytest
import torch
from scipy import stats

from privkit.errors import PrivkitError
from privkit.mechanisms.dp_random import DpRandom, aes_generator
from privkit.mechanisms.grid_noise import (
    GRID_BITS,
    Grid,
    NumpyBits,
    grid_release,
    rounded_gaussian,
    rounded_sensitivity,
    snap_add,
)


def _bits(key: int) -> NumpyBits:
    return NumpyBits(aes_generator(key=key))


def _rounded_pmf(scale: float, support: np.ndarray) -> np.ndarray:
    return stats.norm.cdf((support + 0.5) / scale) - stats.norm.cdf((support - 0.5) / scale)


def _discrete_gaussian_pmf(scale: float, support: np.ndarray) -> np.ndarray:
    w = np.exp(-(support.astype(float) ** 2) / (2 * scale**2))
    return w / w.sum()


def _chi2_pvalue(draws: np.ndarray, pmf) -> float:
    """Chi-square of the draws against ``pmf`` over the integers, cells of expected count < 5 pooled
    into the two tails."""
    lo, hi = int(draws.min()) - 1, int(draws.max()) + 1
    support = np.arange(lo, hi + 1)
    p = pmf(support)
    p = np.concatenate([[1 - p.sum() + p[0]], p[1:]])  # everything below lo + 1 in the first cell
    counts = np.bincount((draws - lo).astype(np.int64), minlength=len(support))
    expected = p * len(draws)
    keep = expected >= 5
    obs = np.concatenate([counts[keep], [counts[~keep].sum()]])
    exp_ = np.concatenate([expected[keep], [expected[~keep].sum()]])
    if exp_[-1] == 0:
        obs, exp_ = obs[:-1], exp_[:-1]
    exp_ = exp_ * obs.sum() / exp_.sum()
    return float(stats.chisquare(obs, exp_).pvalue)


# ----------------------------------------------------------------------------- the sampler
@pytest.mark.parametrize("scale,key", [(0.6, 1), (1.5, 2), (4.0, 3)])
def test_sampler_draws_the_rounded_gaussian_not_the_discrete_one(scale, key):
    draws = rounded_gaussian(scale, 200_000, _bits(key)).numpy()
    assert np.all(draws == np.round(draws))
    assert _chi2_pvalue(draws, lambda k: _rounded_pmf(scale, k)) > 1e-3
    if scale < 2:  # there the two laws differ by more than this sample resolves: the test has power
        assert _chi2_pvalue(draws, lambda k: _discrete_gaussian_pmf(scale, k)) < 1e-6


def test_sampler_moments_at_the_release_scale():
    grid = Grid.for_release(1.0, 1.0, 10**6)
    k = rounded_gaussian(grid.scale, 400_000, _bits(4)).numpy() / grid.scale
    n = len(k)
    assert abs(k.mean()) < 5 / math.sqrt(n)
    assert abs(k.var() - 1.0) < 5 * math.sqrt(2 / n)  # (the rounding adds 1 / (12 s^2): invisible)
    assert stats.kstest(k, "norm").pvalue > 1e-3
    p = 2 * stats.norm.sf(3.0)  # tails: Binomial(n, p) counts beyond 3 sd, within 5 of its sds
    assert abs((np.abs(k) > 3).sum() - n * p) < 5 * math.sqrt(n * p)


@pytest.mark.parametrize("scale", [0.15, 1.5, 2.0**24 + 12345.678, 2.0**50])
def test_fast_path_decides_every_cell_as_the_exact_comparison_does(scale):
    """With every cell settled by mpmath (margin 1) the same stream gives the same integers: the
    float64 decisions agree with the exact ones wherever they decide."""
    fast = rounded_gaussian(scale, 1500, _bits(5))
    exact = rounded_gaussian(scale, 1500, _bits(5), margin=1.0)
    assert torch.equal(fast, exact)


def test_cells_straddling_a_boundary_read_more_bits():
    from privkit.mechanisms.grid_noise import _settle

    class Counting:
        def __init__(self):
            self.inner, self.words = _bits(6), 0

        def bits64(self):
            self.words += 1
            return self.inner.bits64()

    scale = 3.0  # the boundary Phi(0.5 / 3) lies inside the 53-bit cell holding it
    with mp.workprec(200):
        cell = int(mp.floor(mp.ncdf(mp.mpf(0.5) / scale) * 2**53))
    src = Counting()
    k = _settle(cell, scale, src)
    assert src.words >= 1 and k in (0, 1)
    assert _settle(cell - 10, scale, src) == 0 and _settle(cell + 10, scale, src) == 1


def test_float64_ndtri_error_is_far_inside_the_margin():
    rng = np.random.default_rng(0)
    cells = np.concatenate(
        [
            rng.integers(0, 2**53, 3000, dtype=np.int64),
            rng.integers(0, 2**20, 300),
            2**53 - 1 - rng.integers(0, 2**20, 300),
        ]
    )
    mids = (cells.astype(np.float64) + 0.5) * 2.0**-53
    got = torch.special.ndtri(torch.from_numpy(mids)).numpy()
    worst = 0.0
    with mp.workprec(200):
        for m, g in zip(mids, got):
            true = mp.sqrt(2) * mp.erfinv(2 * mp.mpf(float(m)) - 1)
            worst = max(worst, float(abs(g - true) / (abs(true) + 2.0**-44)))
    assert worst < 2.0**-48  # the decision's margin is 2**-44 relative


def test_cpu_erfinv_inverse_error_is_far_inside_the_margin_over_the_bulk():
    """The bulk's faster inverse on the CPU, ``sqrt(2) * erfinv((2 u + 1) * 2**-53 - 1)``, against
    mpmath at 200 bits: uniform cells of the bulk (|z| <= 3), and dense runs at erfinv's switch
    between its two approximations (|y| = 0.7) and at |z| = 3."""
    from privkit.mechanisms.grid_noise import _bulk_inverse, _erfinv_agrees, _erfinv_argument

    rng = np.random.default_rng(1)
    lo, hi = (int(stats.norm.cdf(z) * 2**53) for z in (-3.0, 3.0))
    edges = [int(stats.norm.cdf(z) * 2**53) for z in (-3.0, 3.0, -1.0364334, 1.0364334)]
    cells = np.concatenate(
        [rng.integers(lo, hi, 3000, dtype=np.int64)]
        + [e + rng.integers(-(2**14), 2**14, 200) for e in edges]
    )
    u = torch.from_numpy(cells.astype(np.float64))
    y = _erfinv_argument(u)
    got = torch.special.erfinv(y).mul_(math.sqrt(2.0)).numpy()
    assert _erfinv_agrees()
    np.testing.assert_allclose(_bulk_inverse(u, 2.0**24).numpy(), got * 2.0**24, rtol=2**-52)
    worst = 0.0
    with mp.workprec(200):
        for c, yy, g in zip(cells.tolist(), y.tolist(), got):
            assert mp.mpf(yy) == (2 * mp.mpf(c) + 1) / mp.mpf(2) ** 53 - 1  # the argument is exact
            true = mp.sqrt(2) * mp.erfinv(mp.mpf(yy))
            worst = max(worst, float(abs(g - true) / (abs(true) + 2.0**-44)))
    assert worst < 2.0**-48  # the decision's margin is 2**-44 relative


def test_a_cpu_erfinv_that_disagrees_with_ndtri_is_not_used(monkeypatch):
    """A build whose erfinv were, say, float32-accurate fails the process's check: the bulk falls
    back to ndtri and every cell is still decided as the exact comparison decides it (with the
    float32 erfinv trusted, 623 of these 1500 draws would differ)."""
    from privkit.mechanisms import grid_noise

    erfinv = torch.special.erfinv
    monkeypatch.setattr(torch.special, "erfinv", lambda y: erfinv(y.float()).double())
    monkeypatch.setattr(torch.Tensor, "erfinv_", lambda y: y.copy_(erfinv(y.float())))
    grid_noise._erfinv_agrees.cache_clear()
    try:
        assert not grid_noise._erfinv_agrees()
        u = torch.tensor([0.3, 0.5, 0.9], dtype=torch.float64) * 2.0**53
        mids = u * 2.0**-53 + 2.0**-54
        assert torch.equal(grid_noise._bulk_inverse(u, 3.0), torch.special.ndtri(mids) * 3.0)
        scale = 2.0**24 + 12345.678
        fast = rounded_gaussian(scale, 1500, _bits(5))
        assert torch.equal(fast, rounded_gaussian(scale, 1500, _bits(5), margin=1.0))
    finally:
        grid_noise._erfinv_agrees.cache_clear()


# ----------------------------------------------------------------------------- the grid
def test_grid_is_a_power_of_two_and_its_noise_covers_the_rounding():
    rng = np.random.default_rng(1)
    for _ in range(300):
        std, sens, dim = (
            10 ** rng.uniform(-6, 6),
            10 ** rng.uniform(-6, 6),
            int(10 ** rng.uniform(0, 9)),
        )
        g = Grid.for_release(std, sens, dim)
        assert math.frexp(g.gamma)[0] == 0.5  # a power of two
        assert 2.0**GRID_BITS <= std / g.gamma < 2.0 ** (GRID_BITS + 1)
        # exact rationals: the rounded input's sensitivity is at least sens + gamma sqrt(dim) ...
        rounded = Fraction(rounded_sensitivity(sens, g.gamma, dim))
        assert (
            rounded >= Fraction(sens)
            and (rounded - Fraction(sens)) ** 2 >= Fraction(g.gamma) ** 2 * dim
        )
        # ... and the accounted multiplier std / sens is at most the mechanism's own, gamma s over
        # sens + gamma sqrt(dim): (gamma s sens / std - sens)^2 >= gamma^2 dim
        excess = Fraction(g.gamma) * Fraction(g.scale) * Fraction(sens) / Fraction(std) - Fraction(
            sens
        )
        assert excess >= 0 and excess**2 >= Fraction(g.gamma) ** 2 * dim
        assert g.std <= std * (1 + g.gamma * math.sqrt(dim) / sens) * (
            1 + 1e-12
        )  # and not much more
    with pytest.raises(PrivkitError, match="std"):
        Grid.for_release(float("nan"), 1.0, 3)
    with pytest.raises(PrivkitError, match="sensitivity"):
        Grid.for_release(1.0, 0.0, 3)


def test_a_grid_is_kept_per_release_shape_and_bad_values_are_refused_every_time():
    # a training asks for the same grid at every step: the exact search runs once
    first = Grid.for_release(np.float64(1.1), 1.0, np.int64(50_890))
    assert Grid.for_release(1.1, 1.0, 50_890) is first
    assert Grid.for_release(1.1, 2.0, 50_890) != first  # another sensitivity, another scale
    unwidened = Grid.for_release(1.1, None, 50_890)
    assert 1.1 <= unwidened.std < first.std  # no rounding to cover
    for _ in range(2):
        with pytest.raises(PrivkitError, match="dim must be >= 1; found 0"):
            Grid.for_release(1.1, 1.0, 0)


def test_rounding_moves_neighbours_apart_by_at_most_gamma_sqrt_d():
    rng = np.random.default_rng(2)
    gamma, d = 2.0**-10, 400

    def snapped(v):
        return gamma * np.round(v / gamma)

    for _ in range(50):  # random neighbours: within the bound
        x = rng.normal(scale=3.0, size=d)
        step = rng.normal(size=d)
        xp = x + step * (0.3 / np.linalg.norm(step))
        assert np.linalg.norm(snapped(x) - snapped(xp)) <= rounded_sensitivity(0.3, gamma, d)
    # the worst case: every coordinate just below half-way, the neighbour just above
    tiny = 2.0**-30
    x = (rng.integers(-5000, 5000, d) + 0.5) * gamma - tiny
    xp = x + 15 * gamma + 2 * tiny
    sens = float(np.linalg.norm(xp - x))
    moved = float(np.linalg.norm(snapped(x) - snapped(xp)))
    assert moved <= rounded_sensitivity(sens, gamma, d)
    assert moved - sens > 0.99 * gamma * math.sqrt(d)  # the bound is attained


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_released_float_is_a_function_of_the_grid_integer_alone(dtype):
    """Two inputs whose rounded value plus noise is the same integer give the same bits, and the
    float equals gamma * that integer correctly rounded (exact rationals)."""
    gamma = 2.0**-14
    rng = np.random.default_rng(3)
    x = torch.as_tensor(rng.normal(scale=50.0, size=2000), dtype=dtype)
    k = torch.as_tensor(rng.integers(-(2**27), 2**27, 2000), dtype=torch.float64)
    before = x.clone()
    out = snap_add(x, k, gamma)
    assert torch.equal(x, before)  # the clean value is read, never written (float64 too)
    r = torch.round(x.double() / gamma)
    shift = torch.as_tensor(rng.integers(-(2**20), 2**20, 2000), dtype=torch.float64)
    # another input, on another grid point, with the noise that lands on the same integer
    other = snap_add(((r + shift) * gamma).to(dtype), k - shift, gamma)
    assert torch.equal(out, other)
    for o, ri, ki in zip(out.tolist()[:200], r.tolist()[:200], k.tolist()[:200]):
        exact = Fraction(int(ri) + int(ki)) * Fraction(gamma)
        want = float(exact) if dtype == torch.float64 else float(np.float32(float(exact)))
        assert o == want


def test_the_release_primitive_puts_every_parameter_on_one_grid():
    from privkit.mechanisms import gaussian_release

    src = DpRandom(aes_generator(key=8))
    clean = torch.randn(50, 40, generator=torch.Generator().manual_seed(0))
    out, receipt = gaussian_release(clean, std=0.7, sensitivity=1.0, source=src, dim=10**6)
    assert receipt.noise_multiplier == 0.7 and receipt.event.noise_multiplier == 0.7
    grid = Grid.for_release(0.7, 1.0, 10**6)
    assert out.dtype == clean.dtype and out.shape == clean.shape
    assert torch.equal(out.double() / grid.gamma, torch.round(out.double() / grid.gamma))
    z = ((out - clean).double() / grid.std).flatten().numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3
    seeded = DpRandom(torch.Generator().manual_seed(4))
    assert torch.equal(
        gaussian_release(clean, std=0.7, sensitivity=1.0, source=seeded)[0],
        clean + 0.7 * torch.randn(50, 40, generator=torch.Generator().manual_seed(4)),
    )


def test_grid_release_on_a_word_stream_matches_its_bits():
    """The device stream's adapter: 53-bit draws from word pairs, as ChaChaStream.uniform53 forms them."""
    from privkit.mechanisms.device_random import ChaChaStream
    from privkit.mechanisms.grid_noise import WordBits

    bits = WordBits(ChaChaStream("cpu", key=9)).bits53(1000)
    uni = ChaChaStream("cpu", key=9).uniform53(1000)
    assert torch.equal((bits + 0.5) / 2.0**53, uni)
    grid = Grid.for_release(2.0, 1.0, 100)
    out = grid_release(torch.zeros(100), grid, WordBits(ChaChaStream("cpu", key=9)))
    assert torch.equal(out.double() / grid.gamma, torch.round(out.double() / grid.gamma))


# ----------------------------------------------------------------------------- the accounting
def _gaussian_delta(eps: float, mu: float) -> float:
    """Balle & Wang (2018), Theorem 8: the Gaussian mechanism's delta(eps) at mu = Delta / sigma."""
    return float(
        stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
    )


def _hockey_stick(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(0.0, p - math.exp(eps) * q).sum())


@pytest.mark.parametrize("scale", [0.3, 0.5, 1.0, 2.0, 4.0])
def test_released_integers_are_as_private_as_the_gaussian_the_ledger_records(scale):
    """One coordinate, neighbours one grid step apart (Delta = gamma): the exact hockey-stick
    divergence of the released integers never exceeds the closed form at mu = 1 / s. The discrete
    Gaussian (Canonne, Kamath & Steinke 2020) at the same scale does exceed it, which is why
    privkit releases the rounded Gaussian: accounted as a continuous Gaussian, the discrete one
    would print an epsilon below the truth."""
    k = np.arange(-400, 402)
    rounded = _rounded_pmf(scale, k)
    discrete = _discrete_gaussian_pmf(scale, k)
    exceeded = 0.0
    for eps in [0.0, 0.25, 0.5, 1.0, 2.0, 3.0]:
        closed = _gaussian_delta(eps, 1.0 / scale)
        for p in (rounded, rounded[::-1]):  # both directions (add and remove)
            assert _hockey_stick(p[1:], p[:-1], eps) <= closed + 1e-12
        exceeded = max(exceeded, _hockey_stick(discrete[1:], discrete[:-1], eps) - closed)
    assert exceeded > 1e-4


def test_release_mode_ledgers_equal_reproducible_ones():
    """The defence changes no ledger: a DP-SGD run records the same events in both modes."""
    from privkit.data import FederationConfig, build_federation
    from privkit.trainers import train

    fed = build_federation(FederationConfig(partition="shards", clients=20, seed=0))
    cfg = {
        "arch": "mlp",
        "feature_dim": 16,
        "rounds": 1,
        "local_steps": 2,
        "batch_size": 32,
        "client_fraction": 0.25,
        "noise_multiplier": 1.3,
        "target_epsilon": 1e6,
        "lr": 0.1,
        "device": "cpu",
    }
    a = train("dp-fedavg", fed, cfg, seed=3)
    b = train("dp-fedavg", fed, {**cfg, "reproducible_noise": True}, seed=3)
    ra, rb = a.ledger.to_dict(), b.ledger.to_dict()
    for d in (ra, rb):
        d.pop("reproducible_noise"), d.pop("noise", None)
    assert ra == rb


@pytest.mark.parametrize("scale", [3.0, 2.0**24 + 0.5])
def test_settle_ends_on_the_same_integer_from_any_start(scale):
    """The float64 estimate only sets where the exact search starts: from mpmath's erfinv (no
    guess), from the estimate, or from integers several steps away, the same k comes out."""
    from privkit.mechanisms.grid_noise import _settle

    rng = np.random.default_rng(7)
    for cell in rng.integers(0, 2**53, size=6, dtype=np.int64).tolist():
        src = _bits(8)
        k = _settle(int(cell), scale, src)
        for guess in (float(k), float(k + 4), float(k - 3), math.inf):
            assert _settle(int(cell), scale, src, guess) == k


# ----------------------------------------------------------------------------- the release's bits
def test_cipher_bits_are_aes_128_in_counter_mode_under_a_key_from_the_stream():
    """CipherBits' words are AES-128 of the counter blocks 0, 1, 2, ... (big-endian, as CTR mode
    counts) under the key the stream's first two words make, read on across calls: checked
    against the block cipher applied to each counter block on its own (ECB)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from privkit.mechanisms.grid_noise import CipherBits

    key = aes_generator(key=21).bit_generator.random_raw(2).astype("<u8").tobytes()
    blocks = b"".join(i.to_bytes(16, "big") for i in range(40))
    stream = Cipher(algorithms.AES(key), modes.ECB()).encryptor().update(blocks)
    words = np.frombuffer(stream, dtype="<u8")
    bits = CipherBits(aes_generator(key=21))
    first, word, rest = bits.bits53(7), bits.bits64(), bits.bits53(72)
    assert torch.equal(first, torch.from_numpy((words[:7] >> np.uint64(11)).astype(np.float64)))
    assert word == int(words[7])
    assert torch.equal(rest, torch.from_numpy((words[8:80] >> np.uint64(11)).astype(np.float64)))


def test_a_release_stream_keys_its_noise_once_and_reads_on():
    """One DpRandom: one noise stream for all its releases (never the same bits twice); two
    secret streams: two keys."""
    src = DpRandom.secret()
    assert src.bits() is src.bits()
    a, b = src.bits().bits53(64), src.bits().bits53(64)
    assert not torch.equal(a, b)
    assert not torch.equal(DpRandom.secret().bits().bits53(64), DpRandom.secret().bits().bits53(64))
    u = src.bits().bits53(200_000).numpy() / 2.0**53
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    import pickle  # a copy (a worker's) keys its own noise stream from its copy of the AES stream

    copy = pickle.loads(pickle.dumps(DpRandom(aes_generator(key=22))))
    assert copy._cipher is None and copy.bits().bits53(8).shape == (8,)


def _boundary_cells(scale: float, boundary: float, reach: int = 4) -> list[int]:
    """The 53-bit cells around ``Phi(boundary / scale)``: the one holding it and ``reach`` on
    each side."""
    with mp.workprec(200):
        at = int(mp.floor(mp.ncdf(mp.mpf(boundary) / scale) * 2**53))
    return [at + d for d in range(-reach, reach + 1)]


@pytest.mark.parametrize("scale", [3.0, 1000.25, 2.0**24 + 0.5, 1.5 * 2.0**24])
def test_draws_near_a_boundary_are_settled_as_the_exact_search_settles_them(scale):
    """Cells next to a boundary (the only ones the one-boundary settle sees) get the integer of
    the two-sided exact search, on both sides of zero and of the boundary."""
    from privkit.mechanisms.grid_noise import _MARGIN, _settle, _undecided

    for boundary in (0.5, -0.5, 7.5, -float(math.floor(2.1 * scale)) - 0.5):
        cells = _boundary_cells(scale, boundary)
        got = _undecided(torch.tensor(cells, dtype=torch.float64), scale, _bits(30), _MARGIN)
        want = [_settle(c, scale, _bits(30)) for c in cells]
        assert got.tolist() == want
        assert want[0] == boundary - 0.5 and want[-1] == boundary + 0.5


def test_chunked_releases_decide_their_open_draws_together_as_one_pass_would(monkeypatch):
    """Several chunks (small ones here): their undecided draws, decided after the last chunk, get
    the integers every draw settled exactly gets, and the release snaps them."""
    from privkit.mechanisms import grid_noise

    monkeypatch.setattr(grid_noise, "_CHUNK", 700)
    scale = 2.0**24 + 12345.678
    fast = rounded_gaussian(scale, 3000, _bits(31))
    exact = rounded_gaussian(scale, 3000, _bits(31), margin=1.0)
    assert torch.equal(fast, exact)
    grid = Grid(2.0**-20, 1.5)  # s = 1.5: the tail, |k| > 4, left to the end
    clean = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    want = snap_add(clean, rounded_gaussian(grid.scale, 3000, _bits(32)), grid.gamma)
    assert torch.equal(grid_release(clean, grid, _bits(32)), want)


@pytest.mark.parametrize("scale", [0.15, 3.0, 2.0**24 + 0.5, 1.5 * 2.0**24])
def test_tail_cells_get_the_exact_integer_however_they_are_decided(scale):
    """Cells deep in both tails (|z| from 4.4 to 8.3, where a cell's image is up to a grid unit
    wide and more): decided by float64 with their own width, by one boundary or by the two-sided
    search, each gets the exact search's integer."""
    from privkit.mechanisms.grid_noise import _MARGIN, _settle, _undecided

    rng = np.random.default_rng(33)
    low = np.concatenate(  # Phi^-1(2**-19) = -4.4 and below; |z| near 6, where the image of a
        # cell at s = 2**24 is a grid unit wide
        [rng.integers(0, 2**34, 200), rng.integers(2**20, 2**25, 100), [0]]
    )
    cells = np.concatenate([low, 2**53 - 1 - low]).tolist()
    for c in cells:  # each on the same fresh stream: a cell spanning integers reads more bits
        got = _undecided(torch.tensor([float(c)], dtype=torch.float64), scale, _bits(34), _MARGIN)
        assert got.item() == _settle(c, scale, _bits(34)), c


def test_the_tail_decides_alike_in_torch_as_on_an_accelerator_and_in_numpy():
    """The CPU decides the open draws in numpy, an accelerator in torch: one function over both,
    run here with torch's functions on the CPU, gives the numpy path's integers (tail cells and
    cells next to a boundary, each on the same fresh stream)."""
    from privkit.mechanisms.grid_noise import _MARGIN, _NUMPY, _decide, _midpoint, _Torch

    scale = 1.5 * 2.0**24
    rng = np.random.default_rng(35)
    cells = rng.integers(0, 2**36, 60).tolist() + _boundary_cells(scale, 12345.5)
    for c in cells + [2**53 - 1 - c for c in cells]:
        u = torch.tensor([float(c)], dtype=torch.float64)
        a = torch.special.ndtri(_midpoint(u)).mul_(scale)
        in_torch = _decide(a.clone(), u, scale, _bits(36), _MARGIN, _Torch(torch.device("cpu")))
        in_numpy = _decide(a.numpy().copy(), u.numpy(), scale, _bits(36), _MARGIN, _NUMPY)
        assert in_torch.tolist() == in_numpy.tolist()


def test_a_stream_on_an_accelerator_draws_a_long_release_in_one_pass():
    """WordBits carries its stream's device: a stream on an accelerator draws every coordinate in
    one pass (the CPU's chunks would copy each chunk to the host), here a CPU ChaCha20 stream that
    says it is on a GPU."""
    from privkit.mechanisms.device_random import ChaChaStream
    from privkit.mechanisms.grid_noise import _CHUNK, WordBits

    class OnAGpu:
        device = torch.device("cuda")

        def __init__(self):
            self.inner, self.calls = ChaChaStream("cpu", key=37), []

        def bits53(self, n):
            self.calls.append(n)
            return self.inner.bits53(n)

        def words(self, blocks):
            return self.inner.words(blocks)

    stream = OnAGpu()
    bits = WordBits(stream)
    assert bits.device.type == "cuda"
    draws = rounded_gaussian(2.0**24, 2 * _CHUNK + 5, bits)
    assert stream.calls == [2 * _CHUNK + 5] and len(draws) == 2 * _CHUNK + 5
    cpu = WordBits(ChaChaStream("cpu", key=37))
    assert torch.equal(draws, rounded_gaussian(2.0**24, 2 * _CHUNK + 5, cpu))


def test_a_long_draw_of_cipher_bits_reads_the_stream_a_chunk_at_a_time():
    """More words than a chunk at once (a release drawn in one pass for an accelerator) are the
    same words as drawn chunk by chunk."""
    from privkit.mechanisms.grid_noise import _CHUNK, CipherBits

    whole = CipherBits(aes_generator(key=23)).bits53(2 * _CHUNK + 3)
    parts = CipherBits(aes_generator(key=23))
    pieces = [parts.bits53(_CHUNK), parts.bits53(_CHUNK + 3)]
    assert torch.equal(whole, torch.cat(pieces))
