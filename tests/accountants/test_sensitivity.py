"""Logistic-regression sensitivities (FedAUXfdp Thm 1, Chaudhuri et al.) and unit-ball projection."""

import math

import numpy as np
import pytest

import accountants as acc


def test_closed_forms():
    assert acc.logreg_binary_sensitivity(500, 0.01) == pytest.approx(2 / (0.01 * 500))
    assert acc.logreg_multinomial_sensitivity(500, 0.01, 10) == pytest.approx(2 * math.sqrt(10) / 5)
    assert acc.logreg_multinomial_sensitivity_cfree(500, 0.01) == pytest.approx(
        2 * math.sqrt(2) / 5
    )
    # FedAUXfdp remark: C=2 multinomial == sqrt(2) x binary; the C-free bound equals Thm 1 at C=2.
    assert acc.logreg_multinomial_sensitivity_cfree(7, 0.5) == pytest.approx(
        acc.logreg_multinomial_sensitivity(7, 0.5, 2)
    )


def test_cfree_gradient_bound_holds_empirically():
    """||grad of softmax-CE wrt beta||^2 <= 2 ||x||^2 for random logits, labels and unit-ball x."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        c = int(rng.integers(2, 50))
        logits = rng.normal(scale=rng.uniform(0.1, 20), size=c)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        y = int(rng.integers(c))
        x = acc.project_to_unit_ball(rng.normal(size=8) * rng.uniform(0.1, 3))
        coef = p.copy()
        coef[y] -= 1.0
        grad = np.outer(coef, x)
        assert np.sum(grad**2) <= 2 * np.sum(x**2) + 1e-12


def test_project_to_unit_ball():
    X = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    P = acc.project_to_unit_ball(X)
    np.testing.assert_allclose(P, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])
    # Data-independent: a row's image does not depend on the other rows.
    np.testing.assert_allclose(acc.project_to_unit_ball(X[1:])[0], P[1])
    with pytest.raises(ValueError, match="finite"):
        acc.project_to_unit_ball(np.array([[np.nan, 1.0]]))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: acc.logreg_binary_sensitivity(0, 0.1), "n must be an integer >= 1; found 0"),
        (lambda: acc.logreg_binary_sensitivity(10, -0.1), "lambda"),
        (lambda: acc.logreg_multinomial_sensitivity(10, 0.1, 1), "classes"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
