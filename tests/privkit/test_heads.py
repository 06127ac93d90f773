"""Exact logistic heads: optimality, agreement with scikit-learn on the same objective, measured
sensitivity against the bounds (FedAUX Thm 1, FedAUXfdp Thm 1, privkit's C-free bound), noise
calibration and ledger events against the accountants' formulas."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from accountants import (
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    gaussian_epsilon,
    logreg_binary_sensitivity,
    logreg_multinomial_sensitivity,
    logreg_multinomial_sensitivity_cfree,
)
from privkit.errors import PrivkitError
from privkit.models import build_model
from privkit.trainers.heads import (
    MINIMISER_SLACK,
    HeadFit,
    binary_objective,
    check_minimiser,
    fit_binary_head,
    fit_multinomial_head,
    head_features,
    head_probabilities,
    head_sensitivity,
    head_to_linear,
    multinomial_objective,
    release_head,
)


def unit_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    return head_features(rng.normal(size=(n, d)))


def test_feature_map_is_per_example_and_in_the_unit_ball():
    rng = np.random.default_rng(0)
    h = rng.normal(size=(50, 7)) * 100
    center = rng.normal(size=7)
    phi = head_features(h, center)
    assert phi.shape == (50, 8)
    assert np.all(np.linalg.norm(phi, axis=1) <= 1 + 1e-12)
    np.testing.assert_allclose(phi[:, -1], 1 / math.sqrt(2))
    # one row depends only on its own example: changing row 0 leaves the others untouched
    h2 = h.copy()
    h2[0] = -1e6
    np.testing.assert_array_equal(head_features(h2, center)[1:], phi[1:])


def test_binary_head_first_order_optimality_and_sklearn_agreement():
    rng = np.random.default_rng(1)
    Xp, Xn = unit_rows(rng, 40, 6) + 0.1, unit_rows(rng, 60, 6)
    Xp = Xp / np.maximum(1, np.linalg.norm(Xp, axis=1, keepdims=True))
    lam = 0.05
    fit = fit_binary_head(Xp, Xn, lam)
    X = np.vstack([Xp, Xn])
    t = np.r_[np.ones(40), -np.ones(60)]
    _, grad = binary_objective(fit.weights, X, t, lam)
    assert np.linalg.norm(grad) < 1e-8 and fit.grad_norm < 1e-8
    # the same objective in scikit-learn's parametrisation: C = 1/(lam n), no free intercept
    sk = LogisticRegression(C=1 / (lam * len(t)), fit_intercept=False, tol=1e-12, max_iter=10000)
    sk.fit(X, (t > 0).astype(int))
    np.testing.assert_allclose(fit.weights, sk.coef_[0], atol=1e-6)


def test_multinomial_head_first_order_optimality_and_sklearn_agreement():
    rng = np.random.default_rng(2)
    X = unit_rows(rng, 120, 5)
    y = rng.integers(0, 4, 120)
    lam = 0.02
    fit = fit_multinomial_head(X, y, 4, lam)
    _, grad = multinomial_objective(fit.weights.ravel(), X, y, 4, lam)
    assert np.linalg.norm(grad) < 1e-8
    sk = LogisticRegression(C=1 / (lam * len(y)), fit_intercept=False, tol=1e-12, max_iter=10000)
    sk.fit(X, y)
    np.testing.assert_allclose(fit.weights, sk.coef_, atol=1e-6)


def test_single_class_client_fits_a_full_c_class_head():
    rng = np.random.default_rng(3)
    X = unit_rows(rng, 30, 5)
    y = np.full(30, 7)
    fit = fit_multinomial_head(X, y, 10, 0.01)
    assert fit.weights.shape == (10, 6)
    assert fit.grad_norm < 1e-8
    assert np.all(head_probabilities(fit.weights, X).argmax(1) == 7)
    # by symmetry the nine absent classes get identical weights
    others = np.delete(fit.weights, 7, axis=0)
    np.testing.assert_allclose(others, np.broadcast_to(others[0], others.shape), atol=1e-8)


def _worst_move_binary(rng, trials: int, n_pos: int, n_neg: int, d: int, lam: float) -> float:
    worst = 0.0
    for _ in range(trials):
        Xp, Xn = unit_rows(rng, n_pos, d), unit_rows(rng, n_neg, d)
        w = fit_binary_head(Xp, Xn, lam).weights
        Xp2 = Xp.copy()
        # adversarial-ish replacement: the opposite direction (same bias coordinate)
        Xp2[0, :-1] = -Xp[0, :-1]
        w2 = fit_binary_head(Xp2, Xn, lam).weights
        worst = max(worst, float(np.linalg.norm(w - w2)))
    return worst


def test_binary_sensitivity_never_exceeds_fedaux_bound():
    rng = np.random.default_rng(4)
    lam, n_pos, n_neg = 1.0, 3, 2
    bound = logreg_binary_sensitivity(n_pos + n_neg, lam)
    assert bound == pytest.approx(2 / (lam * (n_pos + n_neg)))  # FedAUX Thm 1 closed form
    worst = _worst_move_binary(rng, 40, n_pos, n_neg, 4, lam)
    assert worst <= bound * (1 + 1e-6)
    assert worst > 0.2 * bound  # the test can see a bound that is too small


def _worst_move_multinomial(rng, trials: int, n: int, d: int, C: int, lam: float) -> float:
    worst = 0.0
    for _ in range(trials):
        X = unit_rows(rng, n, d)
        y = rng.integers(0, C, n)
        W = fit_multinomial_head(X, y, C, lam).weights
        X2, y2 = X.copy(), y.copy()
        X2[0, :-1] = -X[0, :-1]
        y2[0] = (y[0] + 1 + rng.integers(0, C - 1)) % C
        W2 = fit_multinomial_head(X2, y2, C, lam).weights
        worst = max(worst, float(np.linalg.norm(W - W2)))
    return worst


@pytest.mark.parametrize("C", [2, 10])
def test_multinomial_sensitivity_below_cfree_and_paper_bounds(C):
    rng = np.random.default_rng(5 + C)
    lam, n = 1.0, 2
    cfree = logreg_multinomial_sensitivity_cfree(n, lam)
    paper = logreg_multinomial_sensitivity(n, lam, C)
    assert cfree == pytest.approx(2 * math.sqrt(2) / (lam * n))
    assert paper == pytest.approx(2 * math.sqrt(C) / (lam * n))
    worst = _worst_move_multinomial(rng, 40, n, 4, C, lam)
    assert worst <= cfree * (1 + 1e-6) <= paper * (1 + 1e-6)
    assert worst > 0.2 * cfree


def test_release_noise_and_event_match_accountants():
    rng = np.random.default_rng(6)
    X = unit_rows(rng, 200, 30)
    y = rng.integers(0, 10, 200)
    fit = fit_multinomial_head(X, y, 10, 0.01)
    for method, formula in (
        ("classic", classic_gaussian_sigma),
        ("analytic", analytic_gaussian_sigma),
    ):
        for bound, sens in (
            ("paper", 2 * math.sqrt(10) / (0.01 * 200)),
            ("cfree", 2 * math.sqrt(2) / (0.01 * 200)),
        ):
            rel = release_head(
                fit,
                kind="multinomial",
                lam=0.01,
                epsilon=0.5,
                delta=1e-5,
                calibration=method,
                rng=np.random.default_rng(0),
                num_classes=10,
                bound=bound,
            )
            sens = sens * (1 + MINIMISER_SLACK)  # room for the solver's (checked) inexactness
            assert rel.sensitivity == pytest.approx(sens, rel=1e-12)
            assert rel.sigma == pytest.approx(formula(0.5, 1e-5, sens))
            # FedAUXfdp Alg. 1: sigma^2 = 8 C ln(1.25/delta) / (eps lam n)^2
            if method == "classic" and bound == "paper":
                assert rel.sigma**2 == pytest.approx(
                    8 * 10 * math.log(1.25e5) / (0.5 * 0.01 * 200) ** 2, rel=3e-5
                )
            assert isinstance(rel.event, dpa.GaussianDpEvent)
            assert rel.event.noise_multiplier == pytest.approx(rel.sigma / sens)
            noise = (rel.weights - fit.weights).ravel()
            assert noise.std() == pytest.approx(rel.sigma, rel=0.06)  # 310 draws
            assert rel.info["sensitivity_paper"] > rel.info["sensitivity_cfree"]


def test_released_torch_model_computes_the_fitted_head():
    rng = np.random.default_rng(7)
    model = build_model("mlp", (1, 4, 4), 3, feature_dim=8, normalize=True)
    x = torch.rand(20, 1, 4, 4)
    with torch.no_grad():
        h = model.features[:-1](x).numpy().astype(np.float64)
    center = h.mean(0) + 0.01
    W = rng.normal(size=(3, 9))
    weight, bias = head_to_linear(W)
    with torch.no_grad():
        model.features[-1].center.copy_(torch.as_tensor(center))
        model.head.weight.copy_(torch.as_tensor(weight))
        model.head.bias.copy_(torch.as_tensor(bias))
        logits = model(x).double().numpy()
    np.testing.assert_allclose(logits, head_features(h, center) @ W.T, atol=1e-5)


def test_classic_request_at_large_epsilon_uses_the_analytic_gaussian():
    """FedAvg+P at the quick budget (12, 2e-5): the classic sigma gives epsilon 13.16 > 12 (issue 15);
    privkit calibrates analytically there, so the ledger's exact epsilon is the claimed one."""
    rng = np.random.default_rng(8)
    fit = fit_multinomial_head(unit_rows(rng, 160, 20), rng.integers(0, 10, 160), 10, 0.1)
    rel = release_head(
        fit,
        kind="multinomial",
        lam=0.1,
        epsilon=12.0,
        delta=2e-5,
        calibration="classic",
        rng=np.random.default_rng(0),
        num_classes=10,
    )
    assert rel.calibration == "analytic" and rel.info["calibration_used"] == "analytic"
    assert any("outside its proof" in w for w in rel.info["warnings"])
    exact = gaussian_epsilon(
        rel.event.noise_multiplier, 2e-5
    )  # dp-accounting's exact Gaussian epsilon
    assert 11.99 < exact <= 12.0
    classic_z = classic_gaussian_sigma(12.0, 2e-5)  # what the classic formula would have used
    assert gaussian_epsilon(classic_z, 2e-5) > 13.0
    small = release_head(
        fit,
        kind="multinomial",
        lam=0.1,
        epsilon=0.5,
        delta=2e-5,
        calibration="classic",
        rng=np.random.default_rng(0),
        num_classes=10,
    )
    assert small.calibration == "classic"  # inside the classic theorem's range: as the paper


def test_inexact_minimiser_is_refused():
    rng = np.random.default_rng(9)
    fit = fit_multinomial_head(unit_rows(rng, 100, 10), rng.integers(0, 3, 100), 3, 0.1)
    sens = head_sensitivity("multinomial", 100, 0.1, 3)
    assert check_minimiser(fit, 0.1, sens) == MINIMISER_SLACK  # L-BFGS: far below the threshold
    sloppy = HeadFit(
        fit.weights, fit.objective, MINIMISER_SLACK * 0.1 * sens, fit.iterations, fit.n
    )
    with pytest.raises(PrivkitError, match="not exact enough"):
        release_head(
            sloppy,
            kind="multinomial",
            lam=0.1,
            epsilon=1.0,
            delta=1e-5,
            calibration="analytic",
            rng=np.random.default_rng(0),
            num_classes=3,
        )
    # the bound it protects: replace one record, re-solve, the exact minimisers move <= sens
    X, y = unit_rows(rng, 100, 10), rng.integers(0, 3, 100)
    X2, y2 = X.copy(), y.copy()
    X2[0], y2[0] = unit_rows(rng, 1, 10)[0], (y[0] + 1) % 3
    move = np.linalg.norm(
        fit_multinomial_head(X, y, 3, 0.1).weights - fit_multinomial_head(X2, y2, 3, 0.1).weights
    )
    assert move <= sens


def test_lbfgs_runs_on_one_blas_thread_and_restores_the_pools():
    """The head fits' L-BFGS runs with one BLAS/OpenMP thread (tiny problems: a threaded BLAS
    under contention was ~100x slower) through the process's pools found once, and leaves their
    sizes as they were."""
    import threadpoolctl

    from privkit.trainers import heads

    before = [p["num_threads"] for p in threadpoolctl.threadpool_info()]
    seen: list[int] = []

    def fun(w):
        seen.append(max(p["num_threads"] for p in threadpoolctl.threadpool_info()))
        return float(w @ w), 2 * w

    x, _ = heads._lbfgs(fun, np.ones(3), 1e-10, 50)
    assert seen and max(seen) == 1
    assert np.allclose(x, 0.0)
    assert [p["num_threads"] for p in threadpoolctl.threadpool_info()] == before
    assert heads._threadpools() is heads._threadpools()  # found once
