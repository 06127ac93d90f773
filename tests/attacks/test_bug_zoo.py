"""The fast form of benchmarks/bug_zoo.py: a few of the zoo's bugs over ten seeds each, checked and
audited as a user would (configuration check, white-box canary records), against their correct
twins."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bug_zoo", REPO / "benchmarks" / "bug_zoo.py")
zoo = importlib.util.module_from_spec(_spec)
sys.modules["bug_zoo"] = zoo  # its dataclasses look their module up
_spec.loader.exec_module(zoo)

SEEDS = 10
STEPS = 60
#: each part of the audit runs at 95%; the verdict is the union of the configuration check (no
#: finding for a correct twin: deterministic) and the white-box audit (nominal 5%)
NOMINAL = 0.05


def _largest_plausible(n: int, p: float = NOMINAL, alpha: float = 1e-3) -> int:
    """The largest count of false violations in ``n`` runs at rate ``p`` with probability
    above ``alpha`` (binomial upper tail)."""
    return int(stats.binom.ppf(1 - alpha, n, p))


@pytest.fixture(scope="module")
def results():
    names = [
        "shuffle-as-poisson",
        "opacus-shuffle",
        "noise-reseeded",
        "ledger-steps-per-epoch",
        "clip-norm-mismatch",
    ]
    return zoo.run_zoo(names, seeds=SEEDS, steps=STEPS)


@pytest.mark.parametrize(
    "name, part",
    [
        ("shuffle-as-poisson", "white-box sampling: regularity"),
        ("opacus-shuffle", "white-box sampling: regularity"),
        ("noise-reseeded", "white-box independence"),
        ("ledger-steps-per-epoch", "white-box releases"),
        ("clip-norm-mismatch", "white-box influence"),  # per appearance: the clipping alone
    ],
)
def test_bugs_beyond_one_and_a_half_times_their_claim_are_caught(results, name, part):
    bug = results[name]
    assert bug["must_catch"] and bug["ratio"] >= 1.5
    assert bug["caught"]["errors"] == []
    # the bar: caught in at least 9 of 10 seeds, by the part that names the bug
    assert bug["caught"]["violations"] >= 9
    assert sum(n for k, n in bug["caught_by"].items() if k.startswith(part)) >= 9


def test_shuffled_loaders_are_named_by_the_configuration_check(results):
    for name in ("shuffle-as-poisson", "opacus-shuffle"):
        assert results[name]["caught_by"]["config shuffle"] == SEEDS
    # the step count lives in the user's loop, out of the configuration check's reach
    assert results["ledger-steps-per-epoch"]["caught"]["config_violations"] == 0


def test_correct_twins_are_flagged_at_most_at_the_nominal_rate(results):
    bound = _largest_plausible(SEEDS)
    for name in ("shuffle-as-poisson", "opacus-shuffle"):  # the loop's twin and opacus'
        twin = results[name]["twin_false_violations"]
        assert twin["errors"] == [] and twin["config_violations"] == 0
        assert twin["violations"] <= bound, (name, results[name]["twin_flagged_by"])


def test_epsilons_come_from_privkits_accountants(results):
    from accountants.dpsgd import dpsgd_epsilon
    from accountants.samplers import sampler_accounting

    claim = dpsgd_epsilon(zoo.Q, zoo.SIGMA, STEPS, zoo.DELTA, accountant="pld")
    shuffle = sampler_accounting("shuffle", zoo.Q, zoo.SIGMA, STEPS, zoo.DELTA)
    bug = results["shuffle-as-poisson"]
    assert bug["claimed_epsilon"] == pytest.approx(claim)
    assert bug["true_epsilon"]["epsilon"] == pytest.approx(shuffle.epsilon)
    assert bug["true_epsilon"]["lower"] == pytest.approx(shuffle.epsilon_lower)
    assert bug["true_epsilon"]["lower"] > 1.5 * claim  # certified: at least 1.5x the claim
    # the ledger counting one step per epoch claims 3 steps of the 60 that ran
    ledger = results["ledger-steps-per-epoch"]
    assert ledger["claimed_epsilon"] == pytest.approx(
        dpsgd_epsilon(zoo.Q, zoo.SIGMA, 3, zoo.DELTA, accountant="pld")
    )
    assert ledger["true_epsilon"]["epsilon"] == pytest.approx(claim)
    assert math.isinf(results["noise-reseeded"]["true_epsilon"]["epsilon"])


def test_flower_configurations_are_checked_exactly():
    flower = [b.name for b in zoo.BUGS if b.pipeline == "Flower app"]
    out = zoo.run_zoo(flower, seeds=1)
    for name in flower:
        assert out[name]["caught"]["config_violations"] == 1
        assert out[name]["twin_false_violations"]["violations"] == 0
    # LocalDpMod(C 1, sensitivity 1, epsilon 0.5) under replace-one: the classic formula's std
    # sqrt(2 ln(1.25 / delta)) / 0.5 against an update that moves by 2C (dp_accounting's Gaussian)
    import dp_accounting as dpa

    std = math.sqrt(2 * math.log(1.25 / zoo.DELTA)) / 0.5
    sens = out["flower-localdp-sensitivity"]
    assert sens["claimed_epsilon"] == 0.5
    assert sens["true_epsilon"]["epsilon"] == pytest.approx(
        dpa.gaussian_mechanism.get_epsilon_gaussian(std / 2, zoo.DELTA), rel=1e-6
    )
    assert "config flower_sensitivity" in sens["caught_by"]
