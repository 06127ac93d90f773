"""Gaussian mechanism: pinned to dp-accounting and to the reference table (notes/accounting.md §3c)."""

import math

import pytest
from dp_accounting import gaussian_mechanism as gm

import accountants as acc

# notes/accounting.md §3c: classic sigma, analytic sigma (dp-accounting get_sigma_gaussian), delta=1e-5.
TABLE_3C = [
    (0.1, 48.4481, 30.7495661320),
    (0.5, 9.6896, 7.0318266756),
    (1.0, 4.8448, 3.7306316348),
    (2.0, 2.4224, 1.9938124456),
]


@pytest.mark.parametrize("eps,classic,analytic", TABLE_3C)
def test_reference_table(eps, classic, analytic):
    assert acc.classic_gaussian_sigma(eps, 1e-5) == pytest.approx(classic, abs=1e-4)
    # privkit rounds the analytic sigma toward more noise, by a relative 1e-8 at most
    assert analytic - 1e-10 <= acc.analytic_gaussian_sigma(eps, 1e-5) <= analytic * (1 + 1e-8)


@pytest.mark.parametrize("eps", [0.05, 0.3, 1.0, 4.0])
@pytest.mark.parametrize("delta", [1e-9, 1e-5, 1e-2])
def test_analytic_matches_dp_accounting(eps, delta):
    assert acc.analytic_gaussian_sigma(eps, delta, 3.0) == pytest.approx(
        3.0 * gm.get_sigma_gaussian(eps, delta), rel=2e-8
    )
    sigma = acc.analytic_gaussian_sigma(eps, delta)
    assert acc.gaussian_epsilon(sigma, delta) == pytest.approx(eps, rel=1e-8)


def test_classic_closed_form_and_inverse():
    sigma = acc.classic_gaussian_sigma(0.4, 1e-6, sensitivity=0.2)
    assert sigma == pytest.approx(0.2 * math.sqrt(2 * math.log(1.25e6)) / 0.4, rel=1e-14)
    assert acc.gaussian_epsilon(sigma, 1e-6, 0.2, method="classic") == pytest.approx(0.4, rel=1e-14)


def test_calibrate_reports_both_and_warns_at_large_epsilon():
    cal = acc.calibrate_gaussian(0.5, 1e-5)
    assert cal.method == "classic" and cal.sigma == cal.classic_sigma
    assert cal.ratio == pytest.approx(9.6896 / 7.0318266756, rel=1e-4)
    assert cal.warnings == ()
    big = acc.calibrate_gaussian(2.0, 1e-5)
    assert any("epsilon < 1" in w for w in big.warnings)
    # notes §3c: the true delta at the classic sigma for epsilon=2 is 1.3e-7 <= 1e-5, so it holds.
    assert any("holds" in w for w in big.warnings)
    assert acc.analytic_gaussian_delta(big.classic_sigma, 2.0) == pytest.approx(1.3e-7, rel=0.05)
    analytic = acc.calibrate_gaussian(2.0, 1e-5, method="analytic")
    assert analytic.sigma == analytic.analytic_sigma and analytic.warnings == ()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: acc.classic_gaussian_sigma(0.5, 1.5), "delta must be in \\(0, 1\\); found 1.5"),
        (lambda: acc.analytic_gaussian_sigma(-1, 1e-5), "epsilon"),
        (lambda: acc.gaussian_epsilon(-2.0, 1e-5), "sigma"),
        (lambda: acc.gaussian_epsilon(2.0, 1e-5, method="exact"), "method"),
        (lambda: acc.calibrate_gaussian(1.0, 0.0), "delta"),
        (lambda: acc.classic_gaussian_sigma(1.0, 1e-5, sensitivity=0), "sensitivity"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_calibration_roots_are_computed_once_per_value():
    """The two Brent roots are pure in their floats: asked again for the same value they return
    the first answer (the same float) without another search, and a new value is searched."""
    from accountants.gaussian import safe_gaussian_epsilon, safe_noise_multiplier

    for root, args in (
        (safe_noise_multiplier, (7.25, 3e-6)),
        (safe_gaussian_epsilon, (1.37, 3e-6)),
    ):
        root.cache_clear()
        first = root(*args)
        assert first == root.__wrapped__(*args)  # the uncached search's answer
        again = root(*args)
        assert again == first and root.cache_info().hits == 1
        root(args[0] * 1.5, args[1])
        assert root.cache_info().misses == 2
