"""Noise calibration: never overshoots the target; no more noise than opacus' PRV calibration."""

import dp_accounting as dpa
import numpy as np
import pytest

import accountants as acc


def _pld_eps(q, sigma, steps, delta, vdi):
    a = dpa.pld.PLDAccountant(value_discretization_interval=vdi)
    a.compose(acc.dpsgd_event(q, sigma, steps))
    return a.get_epsilon(delta)


def test_reference_case_pld():
    cal = acc.calibrate_noise_multiplier(8.0, 1e-5, 0.004, 10_000)
    # Re-checked by dp-accounting directly at the same grid and at a finer one.
    assert _pld_eps(0.004, cal.noise_multiplier, 10_000, 1e-5, 1e-3) <= 8.0
    assert _pld_eps(0.004, cal.noise_multiplier, 10_000, 1e-5, 1e-4) <= 8.0
    assert cal.epsilon <= 8.0 and cal.epsilon > 7.99  # tight: within 0.1%
    # notes §3e: opacus get_noise_multiplier(accountant="prv") returns 0.610657; RDP calibration 0.6328.
    assert cal.noise_multiplier <= 0.610657
    assert (
        cal.noise_multiplier
        < acc.calibrate_noise_multiplier(
            8.0, 1e-5, 0.004, 10_000, accountant="rdp"
        ).noise_multiplier
    )


def test_rdp_calibration_matches_dp_accounting_calibrate():
    cal = acc.calibrate_noise_multiplier(2.0, 1e-5, 0.01, 500, accountant="rdp")

    def make(sigma):
        return acc.dpsgd_event(0.01, sigma, 500)

    ref = dpa.mechanism_calibration.calibrate_dp_mechanism(
        dpa.rdp.RdpAccountant,
        make,
        2.0,
        1e-5,
        dpa.mechanism_calibration.LowerEndpointAndGuess(0.1, 1.0),
        tol=1e-6,
    )
    assert cal.noise_multiplier == pytest.approx(ref, rel=2e-4)
    assert acc.dpsgd_epsilon(0.01, cal.noise_multiplier, 500, 1e-5, accountant="rdp") <= 2.0


def test_without_replacement_requires_rdp():
    cal = acc.calibrate_noise_multiplier(
        3.0, 1e-5, 0.1, 50, sampling="without-replacement", accountant="rdp"
    )
    assert cal.neighbouring == "replace_one"
    assert (
        acc.dpsgd_epsilon(0.1, cal.noise_multiplier, 50, 1e-5, sampling="without-replacement")
        <= 3.0
    )
    with pytest.raises(ValueError, match="rdp"):
        acc.calibrate_noise_multiplier(3.0, 1e-5, 0.1, 50, sampling="without-replacement")


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(epsilon=-1), "epsilon"), (dict(steps=0), "steps"), (dict(delta=2.0), "delta")],
)
def test_errors(kwargs, match):
    args = dict(epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        acc.calibrate_noise_multiplier(**args)


def _random_targets(n, seed):
    rng = np.random.default_rng(seed)
    return [
        (
            float(np.exp(rng.uniform(np.log(0.3), np.log(10)))),
            float(10 ** rng.uniform(-8, -3)),
            float(10 ** rng.uniform(-3, -0.5)),
            int(10 ** rng.uniform(0, 3.3)),
            ("pld", "rdp")[i % 2],
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("eps,delta,q,steps,kind", _random_targets(8, seed=11))
def test_calibration_never_overshoots_in_either_direction(eps, delta, q, steps, kind):
    """The returned sigma meets the target in dp-accounting's own arithmetic, both ways round:
    epsilon(delta) <= target and delta(target) <= delta (the two are not exact inverses)."""
    cal = acc.calibrate_noise_multiplier(eps, delta, q, steps, accountant=kind)
    ref = (
        dpa.rdp.RdpAccountant()
        if kind == "rdp"
        else dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    )
    ref.compose(acc.dpsgd_event(q, cal.noise_multiplier, steps))
    assert ref.get_epsilon(delta) <= eps
    assert ref.get_delta(eps) <= delta
    if kind == "rdp":
        assert cal.epsilon == ref.get_epsilon(delta)
    else:  # privkit's certified PLD value: dp-accounting's plus its FFT error allowance
        assert cal.epsilon <= eps
        assert cal.epsilon == pytest.approx(ref.get_epsilon(delta), rel=1e-6)


def test_analytic_gaussian_rounds_toward_more_noise_on_random_cases():
    rng = np.random.default_rng(5)
    for _ in range(500):
        eps, delta = (
            float(np.exp(rng.uniform(np.log(0.01), np.log(50)))),
            float(10 ** rng.uniform(-15, -1)),
        )
        sens = float(10 ** rng.uniform(-4, 3))
        sigma = acc.analytic_gaussian_sigma(eps, delta, sens)
        assert acc.analytic_gaussian_delta(sigma, eps, sens) <= delta  # dp-accounting's exact delta
        assert acc.gaussian_epsilon(sigma, delta, sens) <= eps * (1 + 1e-7)
        z = acc.gaussian_epsilon(1.0, delta)  # epsilon side: its delta is within the target too
        assert acc.analytic_gaussian_delta(1.0, z) <= delta
