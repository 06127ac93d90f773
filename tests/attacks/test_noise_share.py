"""The noise scale's read of a long release (issue 32, item 2): past ``NOISE_READ`` coordinates
each release is read in a rotating share of its blocks. The share is fixed before any release,
so under the claim the statistic is still a chi-square over the coordinates read: the noise
test's p-values stay uniform over seeds, every coordinate is read once every ``stride``
releases, and noise that is too small everywhere, or missing from one tensor, is still caught."""

import numpy as np
import pytest
import torch
from scipy import stats

from attacks import whitebox
from attacks.conformance import MechanismClaim
from attacks.whitebox import GradientCanaries

SIZES = (600, 30, 300, 70)  # four tensors; blocks of 16 straddle their ends
DIM = sum(SIZES)
SIGMA, CLIP, STEPS = 1.3, 0.7, 12


@pytest.fixture
def shared(monkeypatch):
    """A release of DIM = 1000 coordinates past a read limit of 250: blocks of 16, stride 4."""
    monkeypatch.setattr(whitebox, "NOISE_READ", 250)
    monkeypatch.setattr(whitebox, "NOISE_BLOCK", 16)


def _canaries(seed: int = 0) -> GradientCanaries:
    return GradientCanaries(
        DIM, 40, clip_norm=CLIP, sample_rate=0.2, noise_multiplier=SIGMA, seed=seed
    )


def _observe(can: GradientCanaries, seed: int, factors=(1.0, 1.0, 1.0, 1.0)) -> None:
    """STEPS releases: a clean sum plus Gaussian noise of ``factors[j]`` x the claimed std in
    tensor j (1: the claim)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        clean = [torch.randn(n, generator=g) * 3 for n in SIZES]
        noise = [torch.randn(n, generator=g) * SIGMA * CLIP * f for n, f in zip(SIZES, factors)]
        can.observe([c + z for c, z in zip(clean, noise)], clean=clean)


def _noise_test(can: GradientCanaries):
    claim = MechanismClaim.repeated(0.2, SIGMA, can.steps, CLIP)
    return can.conformance(claim=claim).tests["noise"]


def test_the_shares_read_every_coordinate_once_every_stride_releases(shared):
    can = _canaries()
    assert can.noise_stride == 4
    read = np.zeros(DIM, dtype=np.int64)
    included = np.zeros(can.n, dtype=np.int64)
    dof = 0
    for phase in range(4):
        share = whitebox._NoiseShare.of(can, 4, phase)
        for a, b in share.ranges:
            read[a:b] += 1
        # a joined release's read (strided views, GPU form) takes the same coordinates
        flat = torch.arange(DIM)
        got = torch.cat([v.reshape(-1) for v in share.read(flat)])
        assert torch.equal(got, torch.cat([torch.arange(a, b) for a, b in share.ranges]))
        layout = whitebox._Layout.of(can, SIZES)
        starts = np.cumsum((0,) + SIZES[:-1])
        pieces = [(starts[j] + a, starts[j] + b) for j, a, b in share.pieces(layout)]
        assert sum(b - a for a, b in pieces) == sum(b - a for a, b in share.ranges)
        assert all(0 < b - a <= 16 for a, b in pieces)
        included += share.included
        dof += share.dof
        assert share.dof <= 250 + 16  # the limit, rounded up to a block
    assert np.all(read == 1)  # a partition of the release
    np.testing.assert_array_equal(included, can.included.astype(np.int64))
    assert dof == DIM - int(can.included.sum())


def test_a_release_within_the_read_limit_is_read_whole():
    can = _canaries()
    _observe(can, 0)
    assert can.noise_stride == 1
    assert can._noise_dof == [DIM - int(can.included.sum())] * STEPS


def test_under_the_claim_the_noise_test_s_p_values_are_uniform(shared):
    """The chi-square is exact under the claim: 300 seeds' p-values pass a KS test of uniformity,
    and the 5% test rejects at its rate (a binomial test), read in shares as read whole."""
    pvals = []
    for seed in range(300):
        can = _canaries(seed)
        _observe(can, 1000 + seed)
        # STEPS = 12 releases: three times every coordinate but the included canaries'
        assert sum(can._noise_dof) == 3 * (DIM - int(can.included.sum()))
        pvals.append(_noise_test(can).p_value)
    pvals = np.array(pvals)
    assert stats.kstest(pvals, "uniform").pvalue > 1e-3
    rejected = int((pvals < 0.05).sum())
    assert stats.binomtest(rejected, pvals.size, 0.05).pvalue > 1e-3


@pytest.mark.parametrize(
    "factors", [(0.9, 0.9, 0.9, 0.9), (1.0, 1.0, 0.0, 1.0), (0.0, 1.0, 1.0, 1.0)]
)
def test_too_little_noise_is_caught_read_in_shares(shared, factors):
    """Noise at 0.9x the claim everywhere, or missing from one tensor (30% or 60% of the
    coordinates), is rejected at every seed though each release reads a quarter of them."""
    for seed in range(10):
        can = _canaries(seed)
        _observe(can, 2000 + seed, factors)
        assert can.noise_stride == 4
        test = _noise_test(can)
        assert test.rejected, test.detail
        assert test.measured < 0.95


def test_the_share_is_the_same_read_on_every_path(shared, monkeypatch):
    """The per-tensor CPU read and the joined (GPU-form) read of the same shares give the same
    degrees of freedom and sums of squares."""
    cpu, joined = _canaries(), _canaries()
    _observe(cpu, 7)
    monkeypatch.setattr(whitebox, "joined_on", lambda device: True)
    _observe(joined, 7)
    joined._settle()  # its last release's copy is recorded at the next observation, or when read
    assert cpu._noise_dof == joined._noise_dof
    np.testing.assert_allclose(cpu._noise_ss, joined._noise_ss, rtol=1e-6)


def test_noise_read_sets_the_limit_per_canary_set(shared):
    """``noise_read`` overrides the module's limit: the dimension reads every release whole."""
    whole = GradientCanaries(DIM, 40, clip_norm=CLIP, sample_rate=0.2, noise_read=DIM)
    assert whole.noise_stride == 1
    _observe(whole, 3)
    assert whole._noise_dof == [DIM - int(whole.included.sum())] * STEPS
    assert (
        GradientCanaries(DIM, 40, clip_norm=CLIP, sample_rate=0.2, noise_read=100).noise_stride
        == 10
    )
    with pytest.raises(ValueError, match="noise_read must be an integer >= 1 or None; found 0"):
        GradientCanaries(DIM, 40, clip_norm=CLIP, sample_rate=0.2, noise_read=0)
