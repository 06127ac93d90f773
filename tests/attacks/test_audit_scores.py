"""attacks.audit_scores: family-wise bound, ceiling, detectable epsilon, verdict rules, JSON."""

import json
import math

import numpy as np
import pytest
from scipy import stats

from attacks import audit_scores
from attacks import one_run as O
from attacks.audit_scores import detectable_epsilon


def _coins(m, seed=0):
    return np.random.default_rng(seed).random(m) < 0.5


# ------------------------------------------------------------------------------- the bound used
def test_family_bound_is_the_one_run_bound_at_bonferroni_level():
    member = _coins(1000)
    rng = np.random.default_rng(1)
    fam = {
        "exact": member.astype(float),
        "noisy": member + rng.normal(size=1000),
        "null": rng.normal(size=1000),
    }
    res = audit_scores(fam, member, accounted_epsilon=1.0, delta=1e-5, inclusion="random")
    assert res.family == ["exact", "noisy", "null"] and res.to_dict()["family_size"] == 3
    for a in res.attacks.values():
        assert (a.k_pos, a.k_neg, a.guesses) == (100, 100, 200)
        # own bound at 95 %, family bound at 1 - 0.05 / 3, both Steinke et al.'s bound
        assert a.epsilon_lower_bound == O.epsilon_lower_bound(
            1000, 200, a.correct, delta=1e-5, beta=0.05
        )
        assert a.family_epsilon_lower_bound == O.epsilon_lower_bound(
            1000, 200, a.correct, delta=1e-5, beta=0.05 / 3
        )
        assert a.confidence == 0.95 and a.family_confidence == pytest.approx(1 - 0.05 / 3)
    assert res.attacks["exact"].correct == 200  # the membership bit itself: every guess right
    assert res.attack == "exact"
    assert res.epsilon_lower_bound == res.attacks["exact"].family_epsilon_lower_bound
    assert res.epsilon_lower_bound < res.attacks["exact"].epsilon_lower_bound  # Bonferroni costs
    # the ceiling is the bound of r correct guesses out of r at the family level
    assert res.epsilon_ceiling == O.epsilon_lower_bound(1000, 200, 200, delta=1e-5, beta=0.05 / 3)


def test_ceiling_matches_notes_numbers():
    # notes §4: 1000 guesses, all correct, beta 0.05, delta 0 -> 5.81; 100 -> 3.49
    member = _coins(5000)
    res = audit_scores(
        member.astype(float), member, accounted_epsilon=1.0, delta=0.0, inclusion="random"
    )
    assert res.attacks["scores"].guesses == 1000
    assert res.epsilon_ceiling == pytest.approx(5.81, abs=0.006)
    res = audit_scores(member[:500].astype(float), member[:500], delta=0.0, inclusion="random")
    assert res.epsilon_ceiling == pytest.approx(3.49, abs=0.006)


def test_guess_grid_and_primary_attack():
    member = _coins(1000)
    s = member.astype(float)
    grid = [(0.05, 0.05), (0.1, 0.0), (100, 100)]
    res = audit_scores({"a": s, "b": -s}, member, delta=0.0, guesses=grid, inclusion="random")
    assert res.to_dict()["family_size"] == 6 and "3 (k+, k-) pairs" in res.correction
    assert res.epsilon_ceiling == O.epsilon_lower_bound(1000, 200, 200, delta=0.0, beta=0.05 / 6)
    assert res.attacks["a"].epsilon_lower_bound == O.epsilon_lower_bound(
        1000, 200, 200, delta=0.0, beta=0.05 / 3
    )
    assert res.attacks["b"].correct == 0  # an attack pointing the wrong way gets nothing right
    prim = audit_scores({"a": s, "b": -s}, member, delta=0.0, primary="b", inclusion="random")
    assert prim.family == ["b"] and prim.epsilon_lower_bound == 0.0 and prim.attack == "b"
    assert not prim.attacks["a"].in_verdict and prim.attacks["a"].family_epsilon_lower_bound is None
    assert (
        prim.attacks["a"].epsilon_lower_bound > 3
    )  # shown, at its own confidence, not in the verdict
    assert any("primary attack 'b'" in n for n in prim.notes)


def test_attacks_on_different_records():
    a, b = _coins(1000, 1), _coins(400, 2)
    res = audit_scores(
        {"points": a.astype(float), "canaries": b.astype(float)},
        {"points": a, "canaries": b},
        delta=1e-5,
        inclusion="random",
    )
    assert res.m == {"points": 1000, "canaries": 400}
    assert res.epsilon_ceiling == O.epsilon_lower_bound(1000, 200, 200, delta=1e-5, beta=0.025)


# ------------------------------------------------------------------------------- detectable epsilon
def _flag_probability(m, r, eps, delta, beta, target):
    """Exact P[bound(V) > target], V ~ Bin(r, e^eps / (1 + e^eps)): by enumeration of V."""
    q = 1 / (1 + math.exp(-eps))
    flagged = [
        v for v in range(r + 1) if O.epsilon_lower_bound(m, r, v, delta=delta, beta=beta) > target
    ]
    return float(stats.binom.pmf(flagged, r, q).sum())


@pytest.mark.parametrize(
    "m,r,delta,beta,target",
    [(200, 40, 0.0, 0.05, 0.0), (200, 40, 1e-5, 0.0125, 1.0), (1000, 60, 1e-5, 0.05, 0.5)],
)
def test_detectable_epsilon_is_where_the_flag_probability_crosses_one_half(
    m, r, delta, beta, target
):
    d = detectable_epsilon(m, r, delta=delta, beta=beta, target=target)
    assert 0 < d < 20
    assert _flag_probability(m, r, d + 1e-6, delta, beta, target) >= 0.5
    # just below it the median gives no flag; the flag probability there is below 1/2 as well
    assert _flag_probability(m, r, d - 1e-3, delta, beta, target) < 0.5


def test_detectable_epsilon_closed_form_when_every_guess_must_be_right():
    # target just below the ceiling: only v = r flags, so P[flag] = q^r and q = (1/2)^(1/r)
    m, r = 100, 20
    ceil = O.epsilon_lower_bound(m, r, r, delta=0.0, beta=0.05)
    below = O.epsilon_lower_bound(m, r, r - 1, delta=0.0, beta=0.05)
    q = 0.5 ** (1 / r)
    assert detectable_epsilon(
        m, r, delta=0.0, beta=0.05, target=(ceil + below) / 2
    ) == pytest.approx(math.log(q / (1 - q)))
    assert detectable_epsilon(m, r, delta=0.0, beta=0.05, target=ceil) == math.inf


# ------------------------------------------------------------------------------- verdict rules
def test_verdict_rules():
    member = _coins(1000)
    exact, null = member.astype(float), np.zeros(1000)
    kw = dict(delta=1e-5, inclusion="random")
    for claim in (None, math.inf, math.nan):
        res = audit_scores(exact, member, accounted_epsilon=claim, **kw)
        assert res.verdict == "no-claim"
        assert res.detectable_epsilon == detectable_epsilon(
            1000, 200, delta=1e-5, beta=0.05, target=0.0
        )
    assert "no DP claim" in audit_scores(exact, member, **kw).message
    assert (
        "no finite guarantee"
        in audit_scores(exact, member, accounted_epsilon=math.inf, **kw).message
    )
    bad = audit_scores(exact, member, accounted_epsilon=1.0, **kw)
    assert (
        bad.verdict == "violation" and bad.epsilon_lower_bound > 1.0 and "VIOLATION" in bad.message
    )
    ok = audit_scores(null, member, accounted_epsilon=1.0, **kw)
    assert (
        ok.verdict == "consistent"
        and ok.epsilon_ceiling > 1.0
        and "detectable epsilon" in ok.message
    )
    assert ok.detectable_epsilon == detectable_epsilon(1000, 200, delta=1e-5, beta=0.05, target=1.0)
    assert 1.0 < ok.detectable_epsilon < ok.epsilon_ceiling + 1
    # a claim above the ceiling cannot be contradicted by any outcome, even a perfect attack
    hi = audit_scores(exact, member, accounted_epsilon=13.7, **kw)
    assert hi.verdict == "inconclusive" and hi.detectable_epsilon == math.inf
    assert f"this audit can detect at most epsilon {hi.epsilon_ceiling:.3f}" in hi.message
    # the bound equal to the claim is no violation (strictly above is)
    edge = audit_scores(exact, member, accounted_epsilon=bad.epsilon_lower_bound, **kw)
    assert edge.verdict == "consistent" or edge.verdict == "inconclusive"


def test_to_dict_is_strict_json_with_what_a_reader_needs():
    member = _coins(300)
    res = audit_scores(
        {"a": member.astype(float), "b": np.zeros(300)},
        member,
        accounted_epsilon=50.0,
        delta=1e-5,
        seed=3,
    )
    d = json.loads(json.dumps(res.to_dict(), allow_nan=False))
    for key in (
        "status",
        "message",
        "epsilon_lower_bound",
        "epsilon_ceiling",
        "detectable_epsilon",
        "accounted_epsilon",
        "delta",
        "confidence",
        "correction",
        "m",
        "family_size",
        "attacks",
        "notes",
        "curve",
        "inclusion",
        "seed",
    ):
        assert key in d
    assert d["status"] == "inconclusive" and d["detectable_epsilon"] == "Infinity"
    assert (d["m"], d["confidence"], d["delta"], d["seed"]) == (300, 0.95, 1e-5, 3)
    assert d["correction"] == "Bonferroni over 2 attack(s)"
    a = d["attacks"]["a"]
    assert (
        a["auc"] == 1.0 and a["tpr_at_fpr"]["0.001"] == 1.0 and a["correct"] == a["guesses"] == 60
    )
    assert a["confidence"] == 0.95 and a["family_confidence"] == 0.975
    # user-chosen members and non-members: the result says random inclusion was not verified
    assert res.inclusion == "unverified" and any("not verified" in n for n in d["notes"])


def test_inclusion_random_checks_the_coin_counts():
    member = np.r_[np.ones(900, bool), np.zeros(100, bool)]
    res = audit_scores(np.zeros(1000), member, delta=0.0, inclusion="random")
    assert any("900 members of 1000" in n for n in res.notes)
    assert not audit_scores(np.zeros(1000), _coins(1000), delta=0.0, inclusion="random").notes


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(curve="laplace"), "curve must be one of generic, gaussian, .*; found 'laplace'"),
        (dict(curve="gaussian", delta=0.0), r"delta must be in \(0, 1\); found 0.0"),
        (dict(delta=1.5), r"delta must be in \[0, 1\); found 1.5"),
        (dict(confidence=1.0), r"confidence must be in \(0, 1\); found 1.0"),
        (dict(accounted_epsilon=-1), "accounted_epsilon must be >= 0"),
        (dict(primary="nope"), "primary must name one of the attacks"),
        (dict(guesses=0.7), "guesses must be a fraction"),
        (dict(guesses=[(600, 600)]), "k_pos \\+ k_neg must be <="),
        (dict(inclusion="maybe"), "inclusion must be one of random, unverified .*; found 'maybe'"),
        (dict(seed=-1), "seed must be a non-negative integer"),
    ],
)
def test_bad_input_names_the_parameter(kwargs, match):
    args = dict(delta=1e-5, **kwargs) if "delta" not in kwargs else kwargs
    with pytest.raises(ValueError, match=match):
        audit_scores(np.zeros(1000), _coins(1000), **args)


def test_bad_arrays():
    with pytest.raises(ValueError, match="same length"):
        audit_scores(np.zeros(10), _coins(9), delta=0.0)
    with pytest.raises(ValueError, match="both members and non-members"):
        audit_scores(np.zeros(10), np.ones(10, bool), delta=0.0)
    with pytest.raises(ValueError, match="must be 1-D"):
        audit_scores(np.zeros((10, 2)), _coins(10), delta=0.0)
    with pytest.raises(ValueError, match="membership for every attack"):
        audit_scores({"a": np.zeros(10)}, {"b": _coins(10)}, delta=0.0)
    with pytest.raises(ValueError, match="non-empty dict"):
        audit_scores({}, _coins(10), delta=0.0)


def test_importing_attacks_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, attacks; attacks.audit_scores; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_inclusion_per_attack_and_verdict_from_three_numbers():
    from attacks.audit_scores import decide

    member = _coins(500)
    res = audit_scores(
        {"points": np.zeros(500), "canaries": member.astype(float)},
        member,
        delta=0.0,
        accounted_epsilon=1.0,
        inclusion={"points": "unverified", "canaries": "random"},
    )
    assert any("not verified for these records (points)" in n for n in res.notes)
    # the verdict is a function of (bound, ceiling, accounted) only: re-derivable from report.json
    d = res.to_dict(with_attacks=False)
    assert "attacks" not in d
    assert (
        decide(d["epsilon_lower_bound"], d["epsilon_ceiling"], d["accounted_epsilon"])
        == d["status"]
    )
    assert [
        decide(2, 5, 1),
        decide(0.5, 5, 1),
        decide(0.5, 0.9, 1),
        decide(9, 9, None),
        decide(1, 2, float("inf")),
    ] == ["violation", "consistent", "inconclusive", "no-claim", "no-claim"]
    with pytest.raises(ValueError, match="inclusion must name every attack"):
        audit_scores({"a": np.zeros(10)}, _coins(10), delta=0.0, inclusion={"b": "random"})
