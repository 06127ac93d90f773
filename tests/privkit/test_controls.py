"""Audit controls: the broken twins of privkit's DP-SGD are caught, the correct twin is not, and the
twins copy the dpsgd trainer's accounting exactly (on scikit-learn's 8x8 digits, for speed)."""

import os

import pytest

from accountants import dpsgd_epsilon
from privkit.audit.controls import claimed_epsilon, method_recipe, run_controls
from privkit.data import FederationConfig, build_federation
from privkit.trainers import get_trainer, train

SMALL = os.environ.get("PRIVKIT_SLOW") == "small"
DELTA = 1e-5


@pytest.fixture(scope="module")
def fed():
    return build_federation(
        FederationConfig(
            dataset="digits", public_dataset=None, public_size=0.1, clients=4, partition="iid"
        )
    )


def _config(**kw):
    # claim 0.5: the non-private twin's black-box bound clears it on 8x8 digits (measured 0.85-1.34)
    # (PLD calibration: the claim is then exactly 0.5; dpsgd's quick config calibrates with RDP)
    return {
        **get_trainer("dpsgd").quick_config(),
        "target_epsilon": 0.5,
        "batch_size": 64,
        "calibration_accountant": "pld",
        **kw,
    }


def test_twins_copy_the_dpsgd_trainers_accounting(fed):
    cfg = _config(epochs=2)
    recipe, sigma, _delta = method_recipe(fed, cfg)
    result = train("dpsgd", fed, cfg, seed=0)
    assert sigma == pytest.approx(result.claims["noise_multiplier"], rel=1e-12)
    assert recipe.sample_rate == pytest.approx(result.claims["sample_rate"], rel=1e-12)
    assert recipe.steps == result.claims["steps"]
    # the claim is the method's ledger at the report's delta (privkit's 'best' accountant)
    assert claimed_epsilon(recipe, sigma, DELTA) == pytest.approx(
        result.ledger.epsilon(DELTA), rel=1e-9
    )
    assert (
        claimed_epsilon(recipe, sigma, DELTA)
        <= dpsgd_epsilon(recipe.sample_rate, sigma, recipe.steps, DELTA, accountant="rdp") + 1e-9
    )


@pytest.mark.parametrize("seed", range(2 if SMALL else 3))
def test_broken_twins_are_caught_and_the_correct_twin_is_not(fed, seed):
    rec = run_controls(
        fed,
        _config(),
        delta=DELTA,
        seed=seed,
        black_box_epochs=30,
        white_box_canaries=500,
        black_box_canaries=500,
    )
    got = {(c["name"], c["audit_mode"]): c for c in rec["controls"]}
    assert set(got) == {
        ("correct", "white-box"),
        ("correct", "black-box"),
        ("noise removed", "white-box"),
        ("clipping and noise removed", "black-box"),
    }
    for (name, mode), c in got.items():
        assert c["verdict"]["accounted_epsilon"] == pytest.approx(rec["claimed_epsilon"])
        if name == "correct":
            assert c["verdict"]["status"] != "violation", c["verdict"]["message"]
            assert c["passed"] and not c["caught"]
        else:
            assert c["verdict"]["status"] == "violation", (name, mode, c["verdict"]["message"])
            assert c["passed"] and c["caught"]
        assert c["verdict"]["inclusion"] == "random"
    assert rec["power"] and not rec["false_alarm"]
    assert rec["claimed_epsilon"] == pytest.approx(0.5, abs=1e-3)
    # white-box without noise: every top guess right, the bound at its ceiling
    wb = got[("noise removed", "white-box")]["verdict"]
    assert wb["epsilon_lower_bound"] == pytest.approx(wb["epsilon_ceiling"])
    assert rec["message"].startswith("Every positive control was caught")


def test_a_control_that_is_not_caught_says_the_audit_lacked_power(fed):
    # 20 canaries: the one-run ceiling is below the claim, no outcome can be a violation
    rec = run_controls(
        fed,
        _config(target_epsilon=4.0, epochs=1),
        delta=DELTA,
        seed=0,
        black_box_epochs=1,
        white_box_canaries=20,
        black_box_canaries=20,
    )
    assert not rec["power"]
    assert rec["message"].startswith("This audit lacked the power to see a violation")
    assert all(c["verdict"]["status"] == "inconclusive" for c in rec["controls"])
