"""The conformance test's parts beyond scale and influence, tested as statistics: the sampling law,
the noise's independence, its distribution and its independence from the batch size.

Validity: under the exact claim (and under mechanisms more private than claimed) each part
rejects at most at its level, over at least 200 seeds; the family of all parts at most at
``1 - confidence``. Invariance: permuting the records or the witness coordinates changes no
p-value. Power: each bug of realistic size (shuffled batches, a doubled rate, a weighted sampler,
reused or antithetic noise, noise broadcast across coordinates, uniform or Laplace noise of the
claimed variance, release divided by its batch size) is caught in at least 9 of 10 seeds, by the
part that names it.
"""

import math

import numpy as np
import pytest
from scipy import stats

from attacks.conformance import MechanismClaim, ProbeEvidence, conformance_test
from attacks.noise_law import distribution_test, independence_test, normalisation_test
from attacks.sampling_law import SamplingRecord, sampling_test
from attacks.validity import release_evidence

LEVEL = 0.05
STEPS, Q, SIGMA = 60, 0.05, 1.2


def _claim(steps=STEPS, q=Q, sigma=SIGMA):
    return MechanismClaim.repeated(q, sigma, steps, 1.0)


def _at_most(k: int, n: int, level: float) -> bool:
    """k rejections in n trials are consistent with a rate at most ``level`` (one-sided binomial
    test at 0.001: a valid test fails this about once in a thousand runs)."""
    return stats.binomtest(k, n, level, alternative="greater").pvalue > 1e-3


def _poisson_record(rng, n=400, steps=STEPS, q=Q):
    drawn = rng.random((steps, n)) < q
    return SamplingRecord(drawn.sum(0), drawn.sum(1))


def test_sampling_part_is_valid_under_the_claim_and_below_it():
    rng = np.random.default_rng(0)
    q = np.full(STEPS, Q)
    for rate in (Q, Q / 2):  # the claim's rate, then a sampler more private than claimed
        n = 250
        rejected = [
            sampling_test(_poisson_record(rng, q=rate), q, LEVEL).rejected for _ in range(n)
        ]
        assert _at_most(sum(rejected), n, LEVEL), (rate, sum(rejected))


def test_sampling_part_is_calibrated_not_degenerate():
    # at a generous level the subtests reject at a rate near it (a test that never rejects is no test)
    rng = np.random.default_rng(1)
    n = 300
    q = np.full(STEPS, Q)
    k = sum(sampling_test(_poisson_record(rng), q, 0.6).rejected for _ in range(n))
    assert 0.3 * n <= k <= 0.75 * n, k


def test_sampling_part_with_rates_that_change_between_releases():
    rng = np.random.default_rng(2)
    q = np.r_[np.full(30, 0.02), np.full(30, 0.08)]
    n = 250
    k = 0
    for _ in range(n):
        drawn = rng.random((60, 400)) < q[:, None]
        k += sampling_test(SamplingRecord(drawn.sum(0), drawn.sum(1)), q, LEVEL).rejected
    assert _at_most(k, n, LEVEL), k


@pytest.mark.parametrize(
    "bug, subtest",
    [
        ({"sampler": "shuffle"}, "regularity"),  # shuffled fixed-size batches
        ({"q_real": 2 * Q}, "rate"),  # the accountant's rate half the real one
        ({"sampler": "weighted"}, "heaviest"),  # one record in 20 drawn 10x as often
    ],
)
def test_sampling_bugs_are_caught_by_the_subtest_that_names_them(bug, subtest):
    rng = np.random.default_rng(3)
    res = [conformance_test(release_evidence(rng, **bug), _claim()) for _ in range(10)]
    caught = [subtest in r.tests["sampling"].failed for r in res]
    assert sum(caught) >= 9, [r.failed for r in res]


def test_a_record_twice_in_one_release_is_rejected_outright():
    counts = np.zeros(100, dtype=int)
    counts[:5] = 1
    rec = SamplingRecord(counts, np.array([5, 0, 0]), repeats=1)
    t = sampling_test(rec, np.full(3, 0.05), LEVEL)
    assert t.rejected and "heaviest" in t.failed and t.p_value == 0.0


def test_sampling_part_ignores_the_order_of_the_records():
    rng = np.random.default_rng(4)
    rec = _poisson_record(rng)
    perm = SamplingRecord(rng.permutation(rec.counts), rec.batch_sizes)
    q = np.full(STEPS, Q)
    assert sampling_test(rec, q, LEVEL).p_value == pytest.approx(
        sampling_test(perm, q, LEVEL).p_value, rel=1e-12
    )


def _gaussian_witness(rng, steps=STEPS, d=64, sigma=None):
    s = np.full(steps, SIGMA) if sigma is None else sigma
    return rng.normal(0.0, 1.0, (steps, d)) * s[:, None], s


@pytest.mark.parametrize("steps", [12, 60])  # without and with the consecutive-cosine statistic
def test_independence_and_distribution_parts_are_valid_over_300_seeds(steps):
    rng = np.random.default_rng(5)
    n = 300
    sigma = np.linspace(0.8, 2.0, steps)  # a claim whose noise changes between releases
    ind = dist = 0
    for _ in range(n):
        w, s = _gaussian_witness(rng, steps, sigma=sigma)
        ind += independence_test(w, s, LEVEL).rejected
        dist += distribution_test(w, s, LEVEL).rejected
    assert _at_most(ind, n, LEVEL) and _at_most(dist, n, LEVEL), (ind, dist)


def test_independence_part_is_exact_for_any_symmetric_noise_law():
    # it reads signs: heavy tails or bounded noise are the distribution part's, never its
    rng = np.random.default_rng(17)
    n = 300
    for law in (lambda: rng.standard_t(3, (STEPS, 64)), lambda: rng.uniform(-1, 1, (STEPS, 64))):
        k = sum(independence_test(law(), np.full(STEPS, SIGMA), LEVEL).rejected for _ in range(n))
        assert _at_most(k, n, LEVEL), k


def test_heavy_tailed_noise_is_named_by_the_distribution_part():
    rng = np.random.default_rng(18)
    res = [
        conformance_test(release_evidence(rng, noise_law="student", df=3.0), _claim())
        for _ in range(10)
    ]
    assert sum("distribution" in r.rejected for r in res) >= 9, [r.failed for r in res]


def test_distribution_part_is_calibrated_not_degenerate():
    rng = np.random.default_rng(6)
    n = 200
    k = sum(
        distribution_test(*_gaussian_witness(rng, 20, 16), level=0.5).rejected for _ in range(n)
    )
    assert 0.35 * n <= k <= 0.65 * n, k


def test_normalisation_part_is_valid_when_the_noise_ignores_the_batch():
    rng = np.random.default_rng(7)
    n = 300
    k = 0
    for _ in range(n):
        w, s = _gaussian_witness(rng)
        k += normalisation_test(w, s, rng.binomial(400, Q, STEPS), LEVEL).rejected
    assert _at_most(k, n, LEVEL), k


@pytest.mark.parametrize(
    "make, subtests",
    [
        (lambda w: w[np.zeros(len(w), dtype=int)], {"releases"}),  # generator re-seeded
        (lambda w: w[np.arange(len(w)) // 10 * 10], {"releases"}),  # reused for 10 releases
        (lambda w: np.r_[w[:30], -w[:30]], {"releases"}),  # antithetic
        # one draw broadcast to two coordinates (halves the rows' dimension: either statistic)
        (lambda w: np.c_[w[:, :32], w[:, :32]], {"releases", "coordinates"}),
        (lambda w: 0.6 * w + 0.8 * np.r_[w[:1], w[:-1]], {"consecutive", "releases"}),
    ],
)
def test_reused_noise_is_caught_by_the_independence_part(make, subtests):
    rng = np.random.default_rng(8)
    caught = 0
    for _ in range(10):
        w, s = _gaussian_witness(rng)
        t = independence_test(make(w), s, LEVEL / 6)
        caught += t.rejected and bool(subtests & set(t.failed))
    assert caught >= 9


@pytest.mark.parametrize("law", ["uniform", "laplace"])
def test_noise_of_the_claimed_variance_but_another_law_is_caught(law):
    rng = np.random.default_rng(9)
    res = [conformance_test(release_evidence(rng, noise_law=law), _claim()) for _ in range(10)]
    assert sum("distribution" in r.rejected for r in res) >= 9


def test_a_release_divided_by_its_batch_size_is_caught():
    rng = np.random.default_rng(10)
    res = [conformance_test(release_evidence(rng, by_batch=True), _claim()) for _ in range(10)]
    assert sum("normalisation" in r.rejected for r in res) >= 9


def test_permuting_witness_coordinates_changes_no_p_value():
    rng = np.random.default_rng(11)
    w, s = _gaussian_witness(rng)
    perm = w[:, rng.permutation(w.shape[1])]
    for test in (independence_test, distribution_test):
        a, b = test(w, s, LEVEL), test(perm, s, LEVEL)
        assert a.p_value == pytest.approx(b.p_value, rel=1e-9), test.__name__


def test_null_models_no_noise_and_constant_batches():
    s = np.full(STEPS, SIGMA)
    zero = np.zeros((STEPS, 64))
    assert not independence_test(zero, s, LEVEL).measured_part
    assert not distribution_test(zero, s, LEVEL).measured_part
    rng = np.random.default_rng(12)
    w, _ = _gaussian_witness(rng)
    t = normalisation_test(w, s, np.full(STEPS, 20), LEVEL)
    assert not t.measured_part and not t.rejected  # shuffled batches: nothing to correlate


def test_the_whole_family_is_valid_over_200_seeds_and_names_no_part_more_often_than_its_share():
    rng = np.random.default_rng(13)
    n = 200
    res = [conformance_test(release_evidence(rng), _claim()) for _ in range(n)]
    # noise, influence, sampling, independence, distribution, normalisation: beta / 6 each
    assert all(r.tests["noise"].level == pytest.approx(0.05 / 6) for r in res)
    assert _at_most(sum(r.verdict == "violation" for r in res), n, 0.05)
    for part in ("sampling", "independence", "distribution", "normalisation"):
        assert _at_most(sum(part in r.rejected for r in res), n, 0.05 / 6), part


def test_influence_per_appearance_is_valid_over_300_seeds_and_catches_clipping_at_2c():
    # canary records: the auditor knows which releases each canary joined, so the influence part
    # measures one appearance (the clipping) against the noise of the releases it did not join
    rng = np.random.default_rng(16)
    n = 300
    for infl in (1.0, 0.5):  # clipped as claimed; clipped below the claim (more private)
        k = sum(
            conformance_test(release_evidence(rng, influence=infl), _claim())
            .tests["influence"]
            .rejected
            for _ in range(n)
        )
        assert _at_most(k, n, 0.05 / 6), (infl, k)
    res = [
        conformance_test(release_evidence(rng, influence=2.0), _claim(), delta=1e-5)
        for _ in range(10)
    ]
    assert all(r.failed == ["influence"] for r in res), [r.failed for r in res]
    # clipped at about 2 C with noise for C: the claim at half the noise or less holds instead
    half = _claim().epsilon(1e-5, noise_scale=0.5)
    assert all(half * 0.98 <= r.holds_epsilon < math.inf for r in res)
    off = conformance_test(release_evidence(rng, influence=4.0), _claim(), delta=1e-5)
    assert math.isinf(off.holds_epsilon)  # as large as the raw norm: no clipping at all


def test_evidence_without_witnesses_or_sampler_keeps_the_two_part_split():
    rng = np.random.default_rng(14)
    ev = release_evidence(rng)
    bare = ProbeEvidence(ev.projections, ev.included, ev.noise_squares, ev.noise_coordinates, True)
    res = conformance_test(bare, _claim())
    assert set(res.tests) == {"releases", "noise", "influence"}
    assert res.tests["noise"].level == pytest.approx(0.025)


def test_the_verdict_names_the_failed_part_and_the_epsilon_that_holds_instead():
    from accountants import dpsgd_epsilon
    from accountants.samplers import sampler_accounting

    rng = np.random.default_rng(2)
    shuffled = conformance_test(release_evidence(rng, sampler="shuffle"), _claim(), delta=1e-5)
    acc = sampler_accounting("shuffle", Q, SIGMA, STEPS, 1e-5)
    assert shuffled.failed == ["sampling: regularity"]
    assert shuffled.holds_epsilon == pytest.approx(acc.epsilon)
    assert f"{acc.epsilon_lower:.3f}" in shuffled.holds_note
    assert "sampling: regularity" in shuffled.message
    assert shuffled.holds_epsilon > shuffled.claimed_epsilon

    fast = conformance_test(release_evidence(rng, q_real=2 * Q), _claim(), delta=1e-5)
    assert any(f.startswith("sampling: rate") for f in fast.failed), fast.failed
    # the rate's upper limit is above the real 2x, so the epsilon that holds is above 2q's
    assert fast.holds_epsilon >= dpsgd_epsilon(2 * Q, SIGMA, STEPS, 1e-5, accountant="pld")
    reused = conformance_test(release_evidence(rng, reuse_every=STEPS), _claim(), delta=1e-5)
    assert math.isinf(reused.holds_epsilon) and "reused" in reused.holds_note
    runs = [conformance_test(release_evidence(rng), _claim(), delta=1e-5) for _ in range(5)]
    for r in runs:  # the claim stands where nothing failed, and only there
        assert (r.holds_epsilon is None) == (r.failed == [])
