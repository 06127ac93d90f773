"""The conformance test of a claimed Gaussian mechanism (attacks.conformance), tested as a statistic:
its false-violation rate over many seeds under the exact claim, under mechanisms more private than
claimed, on null models and with the probes' order permuted; its power on injected bugs of
realistic size (noise halved, clipping off, the sampling rate doubled, steps undercounted)."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from accountants import dpsgd_epsilon, dpsgd_event
from attacks.conformance import MechanismClaim, ProbeEvidence, claim_from_events, conformance_test
from attacks.validity import probe_evidence
from attacks.whitebox import GradientCanaries

DELTA = 1e-5


def _evidence(rng, **kw):
    return probe_evidence(rng, **kw)


def _claim(steps=40, q=0.1, sigma=1.2):
    return MechanismClaim.repeated(q, sigma, steps, 1.0)


def _rates(n, **kw):
    rng = np.random.default_rng(kw.pop("seed", 0))
    claim_kw = {k: kw.pop(k) for k in ("q", "sigma") if k in kw}
    claim_steps = kw.pop("claim_steps", kw.get("steps", 40))
    claim = _claim(claim_steps, **claim_kw)
    out = [conformance_test(_evidence(rng, **kw, **claim_kw), claim) for _ in range(n)]
    return out


def _upper(k, n, conf=0.999):
    return stats.beta.ppf(conf, k + 1, n - k)


@pytest.mark.parametrize("clean_known", [True, False])
def test_false_violations_at_the_nominal_rate_under_the_exact_claim(clean_known):
    n = 1000
    res = _rates(n, clean_known=clean_known)
    flagged = sum(r.verdict == "violation" for r in res)
    assert _upper(flagged, n) >= 0.05 * 0.8  # not degenerate: calibrated near its level
    assert flagged / n <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / n)
    # each statistical part rejects at its own level beta / 2 = 0.025 (binomial, two-sided)
    for part in ("noise", "influence"):
        k = sum(r.tests[part].rejected for r in res)
        assert stats.binomtest(k, n, 0.025).pvalue > 1e-3, (part, k)


def test_a_mechanism_more_private_than_claimed_is_flagged_at_most_at_the_nominal_rate():
    # each bug-free part sits at or beyond its boundary: the verdict's rate is at most beta
    n = 200
    for kw, part in (
        ({"noise": 1.5}, "noise"),
        ({"influence": 0.5}, "influence"),
        ({"q_real": 0.05}, "influence"),
        ({"claim_steps": 60}, "releases"),
    ):
        res = _rates(n, seed=1, **kw)
        assert sum(r.verdict == "violation" for r in res) / n <= 0.05 + 3 * math.sqrt(
            0.05 * 0.95 / n
        ), kw
        assert sum(part in r.rejected for r in res) <= 1, (
            kw
        )  # the more private part: (almost) never


def test_null_models_constant_releases_and_ignored_probes():
    rng = np.random.default_rng(3)
    # a mechanism that ignores its probes (records without influence): more private, not flagged
    flagged = sum(
        conformance_test(_evidence(rng, influence=0.0), _claim()).verdict == "violation"
        for _ in range(200)
    )
    assert flagged <= 10
    # constant releases (no noise at all) are the noise-removed mechanism: always flagged
    ev = _evidence(rng, noise=0.0)
    assert conformance_test(ev, _claim()).rejected == ["noise"]


def test_permuting_the_probes_changes_nothing():
    rng = np.random.default_rng(4)
    ev = _evidence(rng, noise=0.9)
    perm = rng.permutation(ev.m)
    shuffled = ProbeEvidence(
        ev.projections[:, perm],
        ev.included[perm],
        ev.noise_squares,
        ev.noise_coordinates,
        clean_known=True,
    )
    a, b = conformance_test(ev, _claim()), conformance_test(shuffled, _claim())
    for name in a.tests:
        assert a.tests[name].p_value == pytest.approx(b.tests[name].p_value, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(
    "bug, expected",
    [
        ({"noise": 0.5}, "noise"),  # noise halved
        ({"noise": 0.8}, "noise"),  # a smaller bug: 20% less noise
        ({"influence": 4.0}, "influence"),  # clipping off: a raw gradient of 4 clip norms
        ({"q_real": 0.2}, "influence"),  # the ledger's sampling rate half of the real one
        ({"claim_steps": 20}, "releases"),  # the ledger counts half of the steps
    ],
)
def test_injected_bugs_are_caught_in_at_least_nine_of_ten_seeds(bug, expected):
    res = _rates(10, seed=5, **bug)
    caught = [expected in r.rejected for r in res]
    assert sum(caught) >= 9, [r.message for r in res]


def test_detectable_noise_factor_is_flagged_about_half_the_time():
    rng = np.random.default_rng(6)
    d = conformance_test(_evidence(rng), _claim()).tests["noise"].detectable
    assert 0.9 < d < 1.0
    flagged = sum("noise" in r.rejected for r in _rates(400, seed=7, noise=d))
    assert 0.4 < flagged / 400 < 0.6


def test_the_sensitivity_part_is_exact():
    rng = np.random.default_rng(8)
    ev = _evidence(rng)
    ok = ProbeEvidence(
        ev.projections,
        ev.included,
        ev.noise_squares,
        ev.noise_coordinates,
        True,
        record_influence=np.array([0.3, 1.0 + 5e-7]),
        influence_tolerance=1e-6,
    )
    bad = ProbeEvidence(
        ev.projections,
        ev.included,
        ev.noise_squares,
        ev.noise_coordinates,
        True,
        record_influence=np.array([0.3, 1.01]),
        influence_tolerance=1e-6,
    )
    assert not conformance_test(ok, _claim()).tests["sensitivity"].rejected
    assert conformance_test(bad, _claim()).rejected == ["sensitivity"]


def test_claim_from_ledger_events_and_its_epsilon():
    events = [dpsgd_event(0.1, 1.2, 30), dpsgd_event(0.1, 1.5, 10)]
    claim = claim_from_events(events, 2.0)
    assert claim.steps == 40 and claim.sensitivity == 2.0
    np.testing.assert_array_equal(claim.noise_multipliers, [1.2] * 30 + [1.5] * 10)
    one = MechanismClaim.repeated(0.1, 1.2, 30, 1.0)
    assert one.epsilon(DELTA) == pytest.approx(
        dpsgd_epsilon(0.1, 1.2, 30, DELTA, accountant="pld"), rel=1e-3
    )
    import dp_accounting as dpa

    gauss = claim_from_events([dpa.GaussianDpEvent(3.0)], 1.0)
    assert gauss.sample_rates.tolist() == [1.0] and gauss.noise_multipliers.tolist() == [3.0]
    with pytest.raises(ValueError, match="found LaplaceDpEvent"):
        claim_from_events([dpa.LaplaceDpEvent(1.0)], 1.0)
    with pytest.raises(ValueError, match="noise_multipliers must be > 0"):
        MechanismClaim.repeated(0.1, 0.0, 3, 1.0)


def test_measured_epsilon_tracks_the_noise_that_ran():
    rng = np.random.default_rng(9)
    claim = _claim()
    right = conformance_test(_evidence(rng, free=3000), claim, delta=DELTA)
    half = conformance_test(_evidence(rng, free=3000, noise=0.5), claim, delta=DELTA)
    truth_half = MechanismClaim.repeated(0.1, 0.6, 40, 1.0).epsilon(DELTA)
    assert right.measured_epsilon <= right.claimed_epsilon + 1e-9
    assert right.measured_epsilon > 0.95 * right.claimed_epsilon  # a measurement, not a floor
    assert 0.9 * truth_half < half.measured_epsilon <= truth_half * 1.02


# ------------------------------------------------------------ through GradientCanaries, as a loop runs
def _mechanism_run(seed, *, sigma=1.2, sigma_real=None, q=0.1, steps=30, dim=600, m=150, clip=True):
    """A Poisson-subsampled Gaussian sum with the canaries at the mechanism (sampled, clipped)."""
    sigma_real = sigma if sigma_real is None else sigma_real
    can = GradientCanaries(
        dim, m, clip_norm=1.0, sample_rate=q, noise_multiplier=sigma, steps=steps, seed=seed
    )
    g = torch.Generator().manual_seed(10_000 + seed)
    for _ in range(steps):
        clean = torch.randn(dim, generator=g) * 3.0  # the other records' clipped sum
        sampled = (torch.rand(can.included_ids.size, generator=g) < q).float()
        factor = min(1.0, can.clip_norm / can.raw_norm) if clip else 1.0
        released = (
            clean
            + can.vector(sampled * factor * can.raw_norm)
            + sigma_real * torch.randn(dim, generator=g)
        )
        can.observe(released, clean=clean)
    return can


def test_white_box_mechanism_audit_false_violations_over_200_seeds():
    n = 200
    flagged = sum(_mechanism_run(s).audit(delta=DELTA).verdict == "violation" for s in range(n))
    assert flagged / n <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / n)


def test_white_box_mechanism_audit_catches_halved_noise_and_clipping_off():
    for kw, part in (({"sigma_real": 0.6}, "noise"), ({"clip": False}, "influence")):
        res = [_mechanism_run(s, **kw).audit(delta=DELTA) for s in range(10)]
        assert all(r.verdict == "violation" and part in r.conformance.rejected for r in res)


def test_claim_optimised_guesses_are_fixed_by_the_claim_and_valid_over_200_seeds():
    """The one-run part with guesses optimised for the claim (many canaries, one or two top-k
    guesses): chosen from the claim alone, and its false violations at the nominal rate."""
    from attacks.whitebox import claim_optimised_guesses

    claim = MechanismClaim.repeated(0.1, 1.0, 20, 1.0)
    g = claim_optimised_guesses(claim, 1500, delta=DELTA, beta=0.025)
    assert g == claim_optimised_guesses(claim, 1500, delta=DELTA, beta=0.025)
    assert all(kn == 0 and 1 <= kp <= 600 for kp, kn in g)
    n = 200
    res = [
        _mechanism_run(s, sigma=1.0, steps=20, dim=2500, m=1500).audit(delta=DELTA)
        for s in range(n)
    ]
    assert res[0].one_run.guess_grid == [tuple(x) for x in g] or res[0].one_run.guess_grid == g
    flagged = sum(r.one_run.verdict == "violation" for r in res)
    assert flagged / n <= 0.025 + 3 * math.sqrt(0.025 * 0.975 / n)
    assert sum(r.verdict == "violation" for r in res) / n <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / n)
    # and it moves with the evidence: half the noise doubles its median; noise removed is caught
    # by the one-run part alone (the model-free test needs no Gaussian assumption)
    half = [
        _mechanism_run(s, sigma=1.0, sigma_real=0.5, steps=20, dim=2500, m=1500).audit(delta=DELTA)
        for s in range(5)
    ]
    assert np.median([r.epsilon_lower_bound for r in half]) > 2 * np.median(
        [r.epsilon_lower_bound for r in res]
    )
    gone = [
        _mechanism_run(s, sigma=1.0, sigma_real=0.0, steps=20, dim=2500, m=1500).audit(delta=DELTA)
        for s in range(5)
    ]
    assert all(r.one_run.verdict == "violation" for r in gone)
