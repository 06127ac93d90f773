"""Subsampled Gaussian: pinned to dp-accounting, opacus and notes/accounting.md §3a, §3d."""

import math

import dp_accounting as dpa
import numpy as np
import pytest

import accountants as acc

Q, SIGMA, DELTA = 256 / 60000, 1.1, 1e-5
STEPS = math.ceil(60 / Q)  # 14063


def test_mnist_rdp_matches_reference_and_opacus():
    eps = acc.dpsgd_epsilon(Q, SIGMA, STEPS, DELTA, accountant="rdp")
    assert eps == pytest.approx(2.5966555295, rel=1e-6)  # dp-accounting RDP, notes §3a
    from opacus.accountants import RDPAccountant

    op = RDPAccountant()
    op.history = [(SIGMA, Q, STEPS)]
    assert eps == pytest.approx(op.get_epsilon(delta=DELTA), rel=1e-6)


def test_mnist_pld_inside_certified_bracket():
    eps = acc.dpsgd_epsilon(Q, SIGMA, STEPS, DELTA, accountant="pld")
    assert 2.3805 <= eps <= 2.3820  # notes §4: certified [2.38055, 2.38169]


def test_prv_cross_check_agrees_with_pld():
    eps_prv = acc.dpsgd_epsilon(0.01, 1.0, 1000, DELTA, accountant="prv")
    eps_pld = acc.dpsgd_epsilon(0.01, 1.0, 1000, DELTA, accountant="pld")
    assert eps_prv == pytest.approx(1.83837, rel=1e-4)  # opacus prv, notes §3b
    assert eps_pld == pytest.approx(eps_prv, rel=0.01)


def test_event_structure_and_poisson_pld_vs_dp_accounting():
    ev = acc.dpsgd_event(0.01, 1.0, 100)
    assert ev == dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0)), 100
    )
    ref = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    ref.compose(ev)
    # privkit's certified value: dp-accounting's plus the allowance for its FFT's rounding
    assert acc.dpsgd_epsilon(0.01, 1.0, 100, DELTA, accountant="pld") == pytest.approx(
        ref.get_epsilon(DELTA), rel=1e-6
    )


def test_without_replacement_rdp_replace_one():
    # notes §3d: 10 of 100, sigma relative to the clip norm => effective 2.5 => 4.0248764300 (dpa, autodp).
    res = acc.dpsgd_accounting(
        0.1, 5.0, 100, DELTA, sampling="without-replacement", accountant="rdp"
    )
    assert res.epsilon == pytest.approx(4.0248764300, rel=1e-8)
    assert res.neighbouring == "replace_one"
    assert any("replace-one" in w for w in res.warnings)
    ev = acc.dpsgd_event(0.1, 5.0, 1, sampling="without-replacement", dataset_size=100)
    assert ev == dpa.SampledWithoutReplacementDpEvent(100, 10, dpa.GaussianDpEvent(2.5))
    with pytest.raises(ValueError, match="rdp"):
        acc.dpsgd_epsilon(0.1, 5.0, 100, DELTA, sampling="without-replacement", accountant="pld")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(sample_rate=1.5), "sample_rate"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(steps=0), "steps must be an integer >= 1; found 0"),
        (dict(delta=1.0), "delta"),
        (dict(sampling="shuffle"), "sampling"),
        (dict(accountant="gdp"), "accountant"),
    ],
)
def test_errors(kwargs, match):
    args = dict(sample_rate=0.01, noise_multiplier=1.0, steps=10, delta=DELTA)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        acc.dpsgd_epsilon(**args)


def test_prv_bracket_certifies_the_pld_value():
    # notes/accounting.md §3a: prv-accountant at eps_error 0.01 gives (2.3715483, 2.3816923, 2.3918365)
    low, est, up = acc.prv_bracket(256 / 60000, 1.1, 14063, 1e-5)
    assert (low, est, up) == pytest.approx((2.3715483, 2.3816923, 2.3918365), rel=2e-6)
    pld = acc.dpsgd_epsilon(256 / 60000, 1.1, 14063, 1e-5, accountant="pld")
    assert low <= pld <= up  # the pessimistic PLD sits inside PRV's certified interval


def test_prv_refuses_grids_that_do_not_fit():
    with pytest.raises(ValueError, match="steps=41327"):
        acc.dpsgd_accounting(0.41, 1.0, 41327, 1e-5, accountant="prv")


def _random_poisson_cases(n, seed):
    rng = np.random.default_rng(seed)
    return [
        (
            float(10 ** rng.uniform(-3, -1)),
            float(10 ** rng.uniform(-0.2, 0.6)),
            int(10 ** rng.uniform(1, 3.3)),
            float(10 ** rng.uniform(-9, -4)),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("q,sigma,steps,delta", _random_poisson_cases(6, seed=21))
def test_random_cases_agree_with_dp_accounting_and_opacus(q, sigma, steps, delta):
    """privkit's PLD (vectorised) equals dp-accounting's and sits inside opacus's certified PRV
    interval; privkit's RDP equals dp-accounting's and opacus's RDP (same conversion) to 1e-6."""
    from opacus.accountants import RDPAccountant

    event = acc.dpsgd_event(q, sigma, steps)
    ref = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    ref.compose(event)
    pld = acc.dpsgd_epsilon(q, sigma, steps, delta, accountant="pld")
    # certified: the same pmfs recomposed with an FFT error allowance (dp-accounting's plain value
    # moves by its rounding, up to about 1e-7 here, either way)
    assert pld == pytest.approx(ref.get_epsilon(delta), rel=1e-6)
    bracket = acc.pld_bracket(event, delta)
    assert bracket.lower <= pld == bracket.upper
    low, _, up = acc.prv_bracket(q, sigma, steps, delta)
    assert low <= pld <= up + 1e-9
    ours = acc.dpsgd_epsilon(q, sigma, steps, delta, accountant="rdp")
    ref_rdp = dpa.rdp.RdpAccountant()
    ref_rdp.compose(event)
    assert ours == ref_rdp.get_epsilon(delta)
    op = RDPAccountant()
    op.history = [(sigma, q, steps)]
    assert ours == pytest.approx(
        op.get_epsilon(delta=delta), rel=1e-4
    )  # opacus: 151 orders, same conversion
