"""An audit's reference models draw a step's Poisson batches together (``privkit.batched.many``).

One draw of uniforms from the first reference model's sample stream, each row compared with its
model's rate and cut at its model's size: each record of model j joins its batch independently at
j's rate. Checked as statistics over many steps: batch sizes binomial at each model's own size and
rate, records' inclusion frequencies at the rate, no record past a model's size, independence
between models; the models drawn alone keep their own streams' batches bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from privkit.batched.many import JointSampling, LocalDp, _step_batches
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.seeding import noise_generator

SIZES = [30, 55, 80, 41]
RATES = [0.1, 0.3, 0.5, 0.25]
STEPS = 2000


def _jobs(fast: list[bool]) -> list[LocalDp]:
    return [
        LocalDp(
            torch.zeros(n, 2),
            torch.zeros(n, dtype=torch.long),
            DpSgdStep(1.0, 1.0, q, n),
            noise_generator(10 + j, "poisson", reproducible=True),
            noise_generator(10 + j, "noise", reproducible=True),
            fast=f,
        )
        for j, (n, q, f) in enumerate(zip(SIZES, RATES, fast))
    ]


def _offsets(jobs) -> torch.Tensor:
    return torch.tensor([0] + [len(j.y) for j in jobs]).cumsum(0)


def test_joint_batches_have_each_models_poisson_law():
    jobs = _jobs([True] * 4)
    offsets = _offsets(jobs)
    joint = JointSampling.of(jobs, offsets)
    assert joint is not None
    sizes = np.zeros((STEPS, 4), int)
    hits = [np.zeros(n) for n in SIZES]
    for t in range(STEPS):
        counts, glob = _step_batches(jobs, joint, offsets)
        for j, c in enumerate(counts):
            idx = glob[j, :c] - offsets[j]
            assert (glob[j, c:] == 0).all()
            assert all(0 <= i < SIZES[j] for i in idx.tolist())
            assert (idx[1:] > idx[:-1]).all()  # increasing, no repeats
            hits[j][idx.numpy()] += 1
        sizes[t] = counts
    for j, (n, q) in enumerate(zip(SIZES, RATES)):
        # batch sizes: binomial(n, q) (chi-square over the likely sizes, tails pooled)
        law = stats.binom(n, q)
        lo, hi = int(law.ppf(0.005)), int(law.ppf(0.995))
        observed = [np.sum(sizes[:, j] <= lo)]
        observed += [np.sum(sizes[:, j] == k) for k in range(lo + 1, hi)]
        observed += [np.sum(sizes[:, j] >= hi)]
        expected = [law.cdf(lo)] + [law.pmf(k) for k in range(lo + 1, hi)] + [law.sf(hi - 1)]
        p = stats.chisquare(observed, np.array(expected) * STEPS).pvalue
        assert p > 1e-3, f"model {j}: batch sizes not binomial (p={p:.2g})"
        # every record at the rate (5 standard errors: a false alarm at most ~1e-4 over them all)
        assert np.abs(hits[j] / STEPS - q).max() < 5 * np.sqrt(q * (1 - q) / STEPS)
    # independent models: their batch sizes uncorrelated
    r = np.corrcoef(sizes.T)[np.triu_indices(4, 1)]
    assert np.abs(r).max() < 4 / np.sqrt(STEPS)


def test_a_wrong_rate_is_told_apart():
    """The power control of the law test: a model drawn at 0.9x its rate fails it."""
    jobs = _jobs([True] * 4)
    joint = JointSampling.of(jobs, _offsets(jobs))
    joint.rates = joint.rates * torch.tensor([[0.9], [1.0], [1.0], [1.0]])
    sizes = np.array([_step_batches(jobs, joint, _offsets(jobs))[0][0] for _ in range(STEPS)])
    p = stats.ttest_1samp(sizes, SIZES[0] * RATES[0]).pvalue
    assert p < 1e-4


def test_models_drawn_alone_keep_their_own_streams_batches():
    mixed = _jobs([False, True, False, True])
    alone = _jobs([False, False, False, False])
    offsets = _offsets(mixed)
    joint = JointSampling.of(mixed, offsets)
    assert joint.rows.tolist() == [1, 3]
    for _ in range(50):
        counts, glob = _step_batches(mixed, joint, offsets)
        for j in (0, 2):
            own = alone[j].step.sample(alone[j].sample_gen)
            assert counts[j] == len(own)
            assert torch.equal(glob[j, : counts[j]], own + offsets[j])
    # fewer than two fast models: each draws alone
    assert JointSampling.of(_jobs([False, True, False, False]), offsets) is None


def test_mask_takes_a_rate_per_row():
    for source in (torch.Generator().manual_seed(0), np.random.default_rng(0)):
        m = DpRandom(source).mask(3, 20000, rate=torch.tensor([[0.0], [0.5], [1.0]]))
        assert m.dtype == torch.bool and m.shape == (3, 20000)
        assert not m[0].any() and m[2].all()
        assert abs(float(m[1].float().mean()) - 0.5) < 0.02
