"""NFDP subsampling: FedMD-NFDP Theorems 1-2 and the exact profile against brute-force enumeration."""

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

import accountants as acc


def test_theorem_closed_forms():
    assert acc.nfdp_epsilon_delta(100, 10, False) == pytest.approx((math.log(101 / 91), 0.1))
    eps, delta = acc.nfdp_epsilon_delta(100, 10, True)
    assert eps == pytest.approx(10 * math.log(101 / 100))
    assert delta == pytest.approx(1 - (99 / 100) ** 10)
    # Lemma 1 of the paper: with replacement is more private than without.
    for n, k in [(10, 1), (50, 7), (1000, 300)]:
        w, wo = acc.nfdp_epsilon_delta(n, k, True), acc.nfdp_epsilon_delta(n, k, False)
        assert w[0] <= wo[0] + 1e-15 and w[1] <= wo[1] + 1e-15


def _outputs(data, k, replacement):
    """Exact output distribution (as Fractions) of the subsample release over canonical outputs."""
    if replacement:
        draws = list(itertools.product(data, repeat=k))
        counts = Counter(tuple(sorted(d)) for d in draws)  # the released multiset
        return {o: Fraction(c, len(draws)) for o, c in counts.items()}
    subsets = list(itertools.combinations(sorted(data), k))
    return {s: Fraction(1, len(subsets)) for s in subsets}


def _hockey(p, q, eps):
    e = math.exp(eps)
    return sum(max(0.0, float(p.get(o, 0)) - e * float(q.get(o, 0))) for o in set(p) | set(q))


@pytest.mark.parametrize("replacement", [False, True])
@pytest.mark.parametrize("n,k", [(2, 1), (3, 1), (3, 2), (4, 2), (4, 3), (5, 2)])
def test_profile_matches_brute_force(n, k, replacement):
    eps_grid = [0.0, 0.05, 0.3, 1.0, 3.0]
    data = list(range(n))
    base = _outputs(data, k, replacement)
    add = _outputs(data + [n], k, replacement)  # D + {u}
    pairs = [(base, add), (add, base)]  # add direction, both orders
    if replacement or k <= n - 1:
        remove = _outputs(data[:-1], k, replacement)  # D - {u}
        pairs += [(base, remove), (remove, base)]
    brute = [max(_hockey(p, q, e) for p, q in pairs) for e in eps_grid]
    if not replacement and k == n:
        brute = [1.0] * len(eps_grid)  # D - {u} cannot produce a k-subset: certain distinction
    np.testing.assert_allclose(acc.nfdp_profile(n, k, replacement, eps_grid), brute, atol=1e-12)
    # ... and the profile is flat at the theorem's delta.
    np.testing.assert_allclose(brute, acc.nfdp_epsilon_delta(n, k, replacement)[1], atol=1e-12)


def test_directions_separately():
    """Each of the four hockey-stick terms of the module docstring, against enumeration."""
    n, k = 5, 2
    base, add, rem = (_outputs(list(range(m)), k, False) for m in (n, n + 1, n - 1))
    eps = 0.2
    assert _hockey(add, base, eps) == pytest.approx(k / (n + 1))
    assert _hockey(base, add, eps) == pytest.approx(
        max(0, 1 - math.exp(eps) * (n + 1 - k) / (n + 1))
    )
    assert _hockey(base, rem, eps) == pytest.approx(k / n)
    assert _hockey(rem, base, eps) == pytest.approx(max(0, 1 - math.exp(eps) * (n - k) / n))


def test_warnings_flag_delta_above_one_over_n():
    warns = acc.nfdp_warnings(1000, 1, True)
    assert any(">= 1/n" in w for w in warns)
    assert acc.record_exposure_warning(1e-5, 1000) is None
    assert acc.record_exposure_warning(1e-3, 1000) is not None


@pytest.mark.parametrize(
    "args,match",
    [
        ((10, 11, False), "k must be <= n"),
        ((0, 1, True), "n must be"),
        ((5, 0, False), "k must be"),
    ],
)
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        acc.nfdp_epsilon_delta(*args)
