"""L2-regularised logistic heads on frozen features, solved exactly, and their DP release.

FedAUX's scoring heads (Eq. 4-5) and FedAUXfdp's class heads (Eq. 2) are output-perturbation
mechanisms: the exact minimiser of a strongly convex ERM plus Gaussian noise. The sensitivity
theorems (FedAUX Thm 1 / App. J, FedAUXfdp Thm 1) hold for the *exact* argmin of

    J(w) = (1/n) sum_j loss(w; x_j, y_j) + (lam / 2) ||w||^2,      ||x_j|| <= 1,

with the bias a constant coordinate of ``x`` (so it is penalised and inside the norm bound).
scikit-learn's ``LogisticRegression`` solves another problem (``C`` scales with n, intercept not
penalised, single-class data refused), so this module writes ``J`` out and minimises it with
scipy's L-BFGS on an analytic gradient to a gradient norm of ~1e-10, over all ``C`` global classes
(a client holding one class still fits a C-class head; choosing C from a client's own labels would
itself depend on the private data).

Features enter through :func:`head_features`, a per-example (data-independent) map onto the unit
ball: ``phi(h) = [h / ||h||, 1] / sqrt(2)``, passed through
:func:`accountants.project_to_unit_ball` so rounding never leaves ``||phi|| <= 1``. Replacing one
record changes only that record's row, which is what the replace-one sensitivity bound needs; the
papers' Eq. 4 (divide by the maximum norm over the private data) does not have this property.

Audits. Every DP release goes through the Gaussian output-perturbation primitive
(:func:`privkit.mechanisms.output_perturbation.gaussian_output_perturbation`), where a mechanism
audit's mutations and canaries act; under the audit's probes, :func:`probe_record_influence`
measures the sensitivity bound where it is assumed, by refitting the head with auditor-made
records. The mutation ``clipping off`` skips the normalisation in :func:`head_features` (and the
unit-ball check that enforces it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import scipy.optimize

from privkit.errors import PrivkitError
from privkit.mechanisms import mutations

SensitivityBound = Literal["paper", "cfree"]
Calibration = Literal["classic", "analytic"]

_SQRT2 = math.sqrt(2.0)


# ----------------------------------------------------------------------------- features
def head_features(h: np.ndarray, center: np.ndarray | None = None) -> np.ndarray:
    """Per-example map of feature vectors onto the unit ball: ``[u, 1] / sqrt(2)``, ``u = v/||v||``.

    Parameters
    ----------
    h : numpy.ndarray
        Features ``(n, p)`` from the frozen extractor h0.
    center : numpy.ndarray, optional
        ``v = h - center``. A fixed vector computed from public data only (privkit uses the mean of
        h0 over the auxiliary data), so the map stays independent of the private data; centring
        spreads ReLU features (all in the positive orthant) over the sphere, which a norm-bounded,
        regularised head needs.

    Returns
    -------
    numpy.ndarray
        ``(n, p + 1)`` float64, every row of norm <= 1; the last coordinate is the bias feature.
        A zero vector ``v`` maps to ``[0, 1] / sqrt(2)``. Under the audit mutation ``clipping off``
        (:mod:`privkit.mechanisms.mutations`) the normalisation is skipped: ``[v, 1] / sqrt(2)``, rows keep
        their norm, and the sensitivity bound's assumption no longer holds.
    """
    from accountants import project_to_unit_ball

    h = np.asarray(h, dtype=np.float64)
    if h.ndim != 2:
        raise PrivkitError(f"features must be a 2-D array (n, p); found shape {h.shape}")
    if center is not None:
        h = h - np.asarray(center, dtype=np.float64)[None, :]
    if not mutations.active().clipping:
        # the bug a mechanism audit must catch: the per-example normalisation the bound assumes is
        # skipped (as an implementation that forgot it would), the noise still calibrated to it
        return np.concatenate([h, np.ones((len(h), 1))], axis=1) / _SQRT2
    norms = np.linalg.norm(h, axis=1, keepdims=True)
    unit = np.divide(h, norms, out=np.zeros_like(h), where=norms > 0)
    phi = np.concatenate([unit, np.ones((len(h), 1))], axis=1) / _SQRT2
    return project_to_unit_ball(phi)


def head_to_linear(W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights and bias of an ``nn.Linear`` on ``u = v/||v||`` computing ``W @ head_features(h)``.

    ``W`` is ``(C, p + 1)`` with the bias feature last; returns ``(W[:, :p], W[:, p])`` scaled by
    ``1/sqrt(2)`` (the feature map's factor).
    """
    W = np.atleast_2d(np.asarray(W, dtype=np.float64))
    return W[:, :-1] / _SQRT2, W[:, -1] / _SQRT2


# ----------------------------------------------------------------------------- objectives
def binary_objective(
    w: np.ndarray, X: np.ndarray, t: np.ndarray, lam: float
) -> tuple[float, np.ndarray]:
    """``J(w) = (1/n) sum log(1 + exp(-t_j <w, x_j>)) + lam/2 ||w||^2`` and its gradient.

    ``t`` holds the labels in {-1, +1} (FedAUX Eq. 5 with the loss sign corrected, as in App. J).
    """
    z = t * (X @ w)
    n = len(t)
    loss = np.logaddexp(0.0, -z).sum() / n
    # d/dz log(1+e^{-z}) = -sigmoid(-z)
    coef = -t * _sigmoid(-z)
    grad = X.T @ coef / n + lam * w
    return float(loss + 0.5 * lam * w @ w), grad


def multinomial_objective(
    w_flat: np.ndarray, X: np.ndarray, y: np.ndarray, num_classes: int, lam: float
) -> tuple[float, np.ndarray]:
    """``J(W) = (1/n) sum -log softmax(W x_j)_{y_j} + lam/2 ||W||_F^2`` and its gradient (flat).

    ``W`` has shape ``(C, d)`` (FedAUXfdp Eq. 2, beta stacked by class).
    """
    n, d = X.shape
    W = w_flat.reshape(num_classes, d)
    logits = X @ W.T
    logz = _logsumexp(logits)
    loss = (logz - logits[np.arange(n), y]).sum() / n
    P = np.exp(logits - logz[:, None])
    P[np.arange(n), y] -= 1.0
    grad = P.T @ X / n + lam * W
    return float(loss + 0.5 * lam * np.sum(W * W)), grad.ravel()


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))


def _logsumexp(a: np.ndarray) -> np.ndarray:
    m = a.max(axis=1)
    return m + np.log(np.exp(a - m[:, None]).sum(axis=1))


# ----------------------------------------------------------------------------- solvers
@dataclass
class HeadFit:
    """An exact (to ``grad_norm``) minimiser of a logistic head objective.

    Attributes
    ----------
    weights : ``(d,)`` for a binary head, ``(C, d)`` for a multinomial head (bias feature last).
    objective : J at ``weights``.
    grad_norm : ||grad J(weights)||_2 (first-order optimality: 0 at the exact argmin).
    iterations : L-BFGS iterations used.
    n : number of examples the ERM was solved on (the sensitivity's n).
    """

    weights: np.ndarray
    objective: float
    grad_norm: float
    iterations: int
    n: int


def _check_inputs(X: np.ndarray, lam: float) -> np.ndarray:
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or len(X) == 0:
        raise PrivkitError(f"features must be a non-empty 2-D array; found shape {X.shape}")
    if not lam > 0:
        raise PrivkitError(f"lambda must be > 0; found {lam}")
    norms = np.linalg.norm(X, axis=1)
    # the unit-ball check enforces the bound's assumption: off with it under ``clipping off``
    if mutations.active().clipping and norms.max() > 1.0 + 1e-12:
        raise PrivkitError(
            "features must lie in the unit ball (use head_features); found a row of "
            f"norm {norms.max():.6g}"
        )
    return X


@functools.cache
def _threadpools():
    """The process's thread pools (BLAS, OpenMP), found once: finding them scans every loaded
    library (about 1-4 ms, where a head's fit takes a few ms; an audit fits hundreds)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _lbfgs(fun, x0: np.ndarray, tol: float, max_iter: int) -> tuple[np.ndarray, int]:
    # ftol=0: stop on the gradient (or a line search that can make no further progress), never on
    # a small decrease of J, so the solution is the argmin to working precision.
    # One BLAS thread: these problems are tiny, and a threaded BLAS under CPU contention made
    # each L-BFGS iteration ~100x slower (measured).
    with _threadpools().limit(limits=1):
        res = scipy.optimize.minimize(
            fun,
            x0,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": max_iter, "gtol": tol, "ftol": 0.0, "maxcor": 30, "maxls": 50},
        )
    return res.x, int(res.nit)


def fit_binary_head(
    X_pos: np.ndarray, X_neg: np.ndarray, lam: float, *, tol: float = 1e-12, max_iter: int = 5000
) -> HeadFit:
    """Exact L2-regularised binary logistic regression separating ``X_pos`` (t=+1) from ``X_neg``.

    FedAUX's scoring head (Eq. 4-5): positives are the client's data ``D_i``, negatives the public
    ``D^-``; ``n = |D_i| + |D^-|``. Rows must lie in the unit ball (:func:`head_features`).

    Parameters
    ----------
    X_pos, X_neg : numpy.ndarray
        ``(n_pos, d)`` and ``(n_neg, d)`` features; either may be empty but not both.
    lam : float
        Regularisation strength (> 0).
    tol : float
        L-BFGS gradient tolerance (max-abs component).
    """
    parts = [np.asarray(a, dtype=np.float64) for a in (X_pos, X_neg)]
    if any(p.ndim != 2 for p in parts) or parts[0].shape[1] != parts[1].shape[1]:
        raise PrivkitError(
            "X_pos and X_neg must be 2-D with the same number of columns; found "
            f"shapes {parts[0].shape} and {parts[1].shape}"
        )
    X = _check_inputs(np.concatenate(parts), lam)
    t = np.concatenate([np.ones(len(parts[0])), -np.ones(len(parts[1]))])
    w, nit = _lbfgs(lambda v: binary_objective(v, X, t, lam), np.zeros(X.shape[1]), tol, max_iter)
    J, g = binary_objective(w, X, t, lam)
    return HeadFit(w, J, float(np.linalg.norm(g)), nit, len(t))


def fit_multinomial_head(
    X: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    lam: float,
    *,
    tol: float = 1e-12,
    max_iter: int = 5000,
) -> HeadFit:
    """Exact L2-regularised multinomial logistic regression over all ``num_classes`` classes.

    FedAUXfdp's class head (Eq. 2, Algorithm 1). Works for a client holding a single class (the
    other classes' weights are pushed down, not dropped). Rows of ``X`` must lie in the unit ball.

    Sensitivity (replace one record, fixed ``n``): at most ``2 sqrt(C) / (lam n)`` (FedAUXfdp
    Thm 1) and at most ``2 sqrt(2) / (lam n)`` for every C (privkit's bound).

    Proof of the C-free bound. Write ``l(W; x, y) = -log softmax(W x)_y`` with ``p = softmax(W x)``.
    Block k of its gradient is ``(p_k - [k = y]) x``, so

        ||grad l||^2 = ||x||^2 [ (1 - p_y)^2 + sum_{k != y} p_k^2 ]
                     <= ||x||^2 [ (1 - p_y)^2 + (sum_{k != y} p_k)^2 ]     (p_k >= 0)
                     =  2 ||x||^2 (1 - p_y)^2 <= 2 ||x||^2 <= 2,

    using ``sum_{k != y} p_k = 1 - p_y`` and ``||x|| <= 1``. Let D, D' differ in record N and
    ``d(W) = J(W, D') - J(W, D) = (l(W; x'_N) - l(W; x_N)) / n``; then
    ``||grad d|| <= 2 sqrt(2) / n``. J(., D) is lam-strongly convex (convex loss plus
    ``lam/2 ||W||^2``), so for the minimisers W1 (of D) and W2 (of D'), using
    ``grad J(W1, D) = 0 = grad J(W2, D) + grad d(W2)``:

        lam ||W1 - W2||^2 <= (grad J(W1, D) - grad J(W2, D)) . (W1 - W2)
                          =  grad d(W2) . (W1 - W2) <= ||grad d(W2)|| ||W1 - W2||,

    hence ``||W1 - W2|| <= ||grad d(W2)|| / lam <= 2 sqrt(2) / (lam n)``. The same steps with the
    per-block bound ``sqrt(C) ||x||`` give Theorem 1's ``2 sqrt(C) / (lam n)``; the C-free bound
    is smaller for every C >= 3 and equal at C = 2. (Tested empirically in
    ``tests/privkit/test_heads.py``: replace one record, re-solve, measure the move.)
    """
    X = _check_inputs(X, lam)
    y = np.asarray(y, dtype=np.int64)
    if len(y) != len(X):
        raise PrivkitError(f"labels must match features; found {len(y)} labels for {len(X)} rows")
    if num_classes < 2 or y.min() < 0 or y.max() >= num_classes:
        raise PrivkitError(
            f"labels must lie in [0, {num_classes}); found range [{y.min()}, {y.max()}]"
        )
    d = X.shape[1]
    w, nit = _lbfgs(
        lambda v: multinomial_objective(v, X, y, num_classes, lam),
        np.zeros(num_classes * d),
        tol,
        max_iter,
    )
    J, g = multinomial_objective(w, X, y, num_classes, lam)
    return HeadFit(w.reshape(num_classes, d), J, float(np.linalg.norm(g)), nit, len(y))


# ----------------------------------------------------------------------------- DP release
def head_sensitivity(
    kind: Literal["binary", "multinomial"],
    n: int,
    lam: float,
    num_classes: int = 2,
    bound: SensitivityBound = "paper",
) -> float:
    """L2 sensitivity (replace one record) of the exact head, from :mod:`accountants`.

    ``binary``: ``2/(lam n)`` (FedAUX Thm 1); ``multinomial``: ``2 sqrt(C)/(lam n)`` (``paper``,
    FedAUXfdp Thm 1) or ``2 sqrt(2)/(lam n)`` (``cfree``, see :func:`fit_multinomial_head`).
    """
    from accountants import (
        logreg_binary_sensitivity,
        logreg_multinomial_sensitivity,
        logreg_multinomial_sensitivity_cfree,
    )

    if kind == "binary":
        return logreg_binary_sensitivity(n, lam)
    if kind != "multinomial":
        raise PrivkitError(f"head kind must be binary or multinomial; found {kind!r}")
    if bound == "paper":
        return logreg_multinomial_sensitivity(n, lam, num_classes)
    if bound == "cfree":
        return logreg_multinomial_sensitivity_cfree(n, lam)
    raise PrivkitError(f"sensitivity_bound must be paper or cfree; found {bound!r}")


@dataclass
class HeadRelease:
    """A head released through the Gaussian mechanism (or in the clear when ``epsilon`` is None).

    ``weights`` is what leaves the client; ``event`` is what goes in its ledger.
    """

    weights: np.ndarray
    clean: np.ndarray
    sensitivity: float
    sigma: float
    epsilon: float | None
    delta: float | None
    calibration: str
    event: object
    info: dict = field(default_factory=dict)


def release_head(
    fit: HeadFit,
    *,
    kind: Literal["binary", "multinomial"],
    lam: float,
    epsilon: float | None,
    delta: float,
    calibration: Calibration,
    rng: np.random.Generator,
    num_classes: int = 2,
    bound: SensitivityBound = "paper",
    client: int | None = None,
    label: str | None = None,
    data: HeadData | None = None,
) -> HeadRelease:
    """Add Gaussian noise calibrated to (epsilon, delta) and the head's sensitivity.

    ``sigma`` comes from :func:`accountants.calibrate_gaussian` (``classic`` as the papers, or
    ``analytic``); the ledger event is ``GaussianDpEvent(sigma / sensitivity)``. With
    ``epsilon=None`` the head is released without noise and the event is a ``NonPrivateEvent``.
    ``info`` holds both multinomial bounds (paper and C-free) and both sigmas for reports.

    The noise is added by :func:`privkit.mechanisms.output_perturbation.gaussian_output_perturbation`
    for ``client``'s release labelled ``label`` (its ledger label), where an audit's mutations and
    probes act. ``data`` (the records ``fit`` was solved on) lets an audit measure probe records'
    exact influence on ``fit`` (:func:`probe_record_influence`); it is read only under probes.
    """

    from accountants import NonPrivateEvent, calibrate_gaussian
    from privkit.mechanisms.output_perturbation import gaussian_output_perturbation

    sens = head_sensitivity(kind, fit.n, lam, num_classes, bound)
    info: dict = {"n": fit.n, "lambda": lam, "grad_norm": fit.grad_norm}
    if kind == "multinomial":
        info["sensitivity_paper"] = head_sensitivity(kind, fit.n, lam, num_classes, "paper")
        info["sensitivity_cfree"] = head_sensitivity(kind, fit.n, lam, num_classes, "cfree")
    if epsilon is None:
        event = NonPrivateEvent(f"{kind} logistic head released without noise")
        return HeadRelease(
            fit.weights.copy(), fit.weights, sens, 0.0, None, None, "none", event, info
        )
    sens = sens * (1.0 + check_minimiser(fit, lam, sens))
    # The classic formula is a theorem only for epsilon < 1: at epsilon >= 1 the analytic Gaussian
    # (Balle & Wang 2018) is used, so the (epsilon, delta) the method claims is the one it has.
    method = calibration if epsilon < 1 else "analytic"
    cal = calibrate_gaussian(epsilon, delta, sens, method=method)
    influence = None
    if data is not None:  # called by the primitive under an audit's probes only

        def influence(canaries) -> tuple[np.ndarray, float]:
            return probe_record_influence(
                fit,
                data,
                kind=kind,
                lam=lam,
                sensitivity=sens,
                num_classes=num_classes,
                seed=canaries.seed,
            )

    receipts: list = []
    noisy = gaussian_output_perturbation(
        fit.weights,
        sigma=cal.sigma,
        sensitivity=sens,
        rng=rng,
        client=client,
        label=label,
        record_influence=influence,
        receipts=receipts,
    )
    warns = list(cal.warnings)
    if method != calibration:
        warns.append(
            f"classic Gaussian calibration requested at epsilon={epsilon:g} >= 1, outside its proof: "
            "the analytic Gaussian mechanism was used instead"
        )
    info.update(
        classic_sigma=cal.classic_sigma,
        analytic_sigma=cal.analytic_sigma,
        warnings=warns,
        calibration_used=method,
        minimiser_slack=MINIMISER_SLACK,
    )
    if kind == "multinomial":
        for b in ("paper", "cfree"):
            info[f"sigma_{b}"] = calibrate_gaussian(
                epsilon, delta, info[f"sensitivity_{b}"] * (1.0 + MINIMISER_SLACK), method=method
            ).sigma
    (receipt,) = receipts  # the release that ran: the ledger's event
    event = receipt.event
    return HeadRelease(noisy, fit.weights, sens, cal.sigma, epsilon, delta, method, event, info)


# Output perturbation needs the exact minimiser. L-BFGS returns w with ||grad J(w)|| = g, and
# lam-strong convexity puts the exact minimiser within g / lam of it; for neighbouring datasets
# the released points are then within sens + 2 g_max / lam of each other when both gradients are
# at most g_max. privkit fixes g_max = MINIMISER_SLACK * lam * sens / 2 in advance (a data-
# independent threshold), calibrates the noise to sens (1 + MINIMISER_SLACK), and stops with an
# error when a solve misses the threshold (observed gradients are ~1e-7 of it). The error itself
# is outside the DP analysis: it has never fired and would say the solver, not the data, failed.
MINIMISER_SLACK = 1e-5


def check_minimiser(fit: HeadFit, lam: float, sensitivity: float) -> float:
    """Return :data:`MINIMISER_SLACK` if ``fit`` is exact enough for ``sensitivity``, else raise."""
    g_max = MINIMISER_SLACK * lam * sensitivity / 2.0
    if not fit.grad_norm <= g_max:
        raise PrivkitError(
            f"head minimiser not exact enough for output perturbation: ||grad J|| = {fit.grad_norm:.3g} > "
            f"{g_max:.3g} (= {MINIMISER_SLACK:g} lam sens / 2) after {fit.iterations} L-BFGS iterations; "
            "raise max_iter or the regularisation lambda"
        )
    return MINIMISER_SLACK


# ----------------------------------------------------------------------------- audit probe records
#: probe records per audited head release (each costs one refit of the head)
PROBE_RECORDS = 8
#: a probe record's centred feature norm, in multiples of the largest among the head's private
#: records: far outside the data, so that with the normalisation off its loss gradient is ~100x
#: what the bound assumes. Its influence then saturates near the move that flips its margin
#: (about the head's weight norm); on privkit's digits heads that is 1.2-6x the sensitivity, where
#: 4x the data's norm left the binary heads below it (measured)
PROBE_RECORD_SCALE = 100.0


@dataclass(frozen=True)
class HeadData:
    """The records a head was solved on, kept so that an audit can refit it (probe records).

    Attributes
    ----------
    X : ``(n_private, d)`` the private records' mapped features, as the head was fitted on them
        (binary: the positives).
    h : ``(n_private, p)`` the same records' raw features (before :func:`head_features`).
    center : the feature map's centre (``None``: none).
    labels : multinomial: the private records' labels.
    negatives : binary: the mapped public negatives (never replaced: not private).
    """

    X: np.ndarray
    h: np.ndarray
    center: np.ndarray | None = None
    labels: np.ndarray | None = None
    negatives: np.ndarray | None = None


def _record_gradients(kind: str, W: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each record's loss gradient at the head ``W`` (``(C, d)``; binary: ``(1, d)``, labels
    ``t = y`` in {-1, +1}), flattened: ``(n, C d)``."""
    if kind == "binary":
        return (-y * _sigmoid(-y * (X @ W[0])))[:, None] * X
    P = head_probabilities(W, X)
    P[np.arange(len(X)), y] -= 1.0
    return np.einsum("nc,nd->ncd", P, X).reshape(len(X), -1)


def probe_record_influence(
    fit: HeadFit,
    data: HeadData,
    *,
    kind: Literal["binary", "multinomial"],
    lam: float,
    sensitivity: float,
    num_classes: int = 2,
    seed: int = 0,
    count: int = PROBE_RECORDS,
) -> tuple[np.ndarray, float]:
    """Exact influence of ``count`` probe records on the head ``fit``, for the sensitivity test.

    Each probe is an auditor-made record far outside the data: raw features ``center + R u``,
    ``R`` = :data:`PROBE_RECORD_SCALE` x the largest centred norm among the private records, mapped
    by :func:`head_features` like every record (under the ``clipping off`` mutation, then, left
    unnormalised). ``u`` is the direction in which the probe's label scores worst under ``fit``
    (binary: the client's records are the positives, ``u = -w``; multinomial, label ``c``:
    ``u = -(W_c - mean_k W_k)``), tilted by a random direction for every probe after the first.

    With the normalisation on, every probe lands on the unit sphere like any record and the
    theorem bounds its influence. With it off (``clipping off``) the influence is no longer bounded
    by ``sensitivity`` but a logistic loss stops pushing once the probe is classified, so the move
    saturates near the one that flips the probe's margin, about ``||W||``: the test sees the bug
    where the head's weights exceed its sensitivity, as they must for a head whose signal is to
    survive noise of scale ``sigma >= sensitivity`` (a head of pure noise shows nothing).

    Neighbouring relation. The ledger records these heads as ``replace_one``: the claimed
    sensitivity (``2/(lam n)``, ``2 sqrt(C)/(lam n)``, ``2 sqrt(2)/(lam n)``) bounds the move of the
    minimiser between two datasets of the *same* size ``n`` that differ in one record. So the probe
    *replaces* a private record (the one whose loss gradient at ``fit`` differs most from the
    probe's: the swap a first-order step says moves the minimiser most) and the head is re-solved
    with the same solver; adding the probe instead would change ``n`` and reweight every other
    record (a different relation, with a different bound). The negatives of a binary head are
    public and never replaced.

    Tolerance. L-BFGS returns points with gradient norms ``g`` (the head's) and ``g'`` (the
    probe's refit); ``lam``-strong convexity puts each exact minimiser within ``g / lam`` of them
    (the argument behind :data:`MINIMISER_SLACK`), so the exact influence lies within
    ``(g + g') / lam`` of the measured one. The returned relative tolerance is the largest
    ``(g + g') / (lam sensitivity)``: a measured influence above ``sensitivity (1 + tolerance)``
    is an exact influence above ``sensitivity``, and the correct mechanism (whose exact influence
    the theorem bounds by ``sensitivity``) is never flagged.

    Returns
    -------
    (norms, tolerance) : the ``count`` L2 influences (units of the weights) and the relative
        tolerance, for :meth:`attacks.whitebox.GradientCanaries.record_influence`.
    """
    from privkit.seeding import make_rng

    if count < 1:
        raise PrivkitError(f"count must be >= 1; found {count}")
    W = np.atleast_2d(np.asarray(fit.weights, dtype=np.float64))
    h = np.asarray(data.h, dtype=np.float64)
    p = h.shape[1]
    centred = h if data.center is None else h - np.asarray(data.center, dtype=np.float64)[None, :]
    R = PROBE_RECORD_SCALE * max(float(np.linalg.norm(centred, axis=1).max()), 1e-12)
    rng = make_rng(seed, "probe-records")
    binary = kind == "binary"
    y = np.ones(len(data.X), dtype=np.int64) if binary else np.asarray(data.labels, dtype=np.int64)
    probe_labels = (
        np.ones(count, dtype=np.int64) if binary else np.resize(rng.permutation(num_classes), count)
    )
    grads = _record_gradients(kind, W, data.X, y)
    norms, tolerance = np.zeros(count), 0.0
    for k, c in enumerate(probe_labels):
        a = -W[0, :p] if binary else -(W[c, :p] - W[:, :p].mean(0))
        a = a / np.linalg.norm(a) if np.linalg.norm(a) > 0 else rng.standard_normal(p)
        if k:  # other directions than the worst-scoring one are tested too
            g = rng.standard_normal(p)
            a = a / np.linalg.norm(a) + 0.5 * g / np.linalg.norm(g)
        u = a / np.linalg.norm(a)
        x_p = head_features(
            (R * u)[None, :] + (0.0 if data.center is None else data.center[None, :]),  # type: ignore[index]
            data.center,
        )[0]
        g_p = _record_gradients(kind, W, x_p[None, :], np.array([c]))[0]
        j = int(np.argmax(np.linalg.norm(grads - g_p[None, :], axis=1)))
        X2, y2 = data.X.copy(), y.copy()
        X2[j], y2[j] = x_p, c
        if binary:
            refit = fit_binary_head(X2, data.negatives, lam)  # type: ignore[arg-type]  # binary: negatives
        else:
            refit = fit_multinomial_head(X2, y2, num_classes, lam)
        norms[k] = float(np.linalg.norm(refit.weights - fit.weights))
        tolerance = max(tolerance, (fit.grad_norm + refit.grad_norm) / (lam * sensitivity))
    return norms, tolerance


def certainty_scores(w: np.ndarray, X: np.ndarray, xi: float = 1e-8) -> np.ndarray:
    """FedAUX Eq. 6: ``s(x) = sigmoid(<w, x>) + xi`` for feature rows ``X`` (post-processing)."""
    return _sigmoid(np.asarray(X, np.float64) @ np.asarray(w, np.float64)) + xi


def head_probabilities(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    """``softmax(W x)`` per row: a class head's soft labels (FedAUXfdp's g_i)."""
    logits = np.asarray(X, np.float64) @ np.asarray(W, np.float64).T
    return np.exp(logits - _logsumexp(logits)[:, None])


__all__ = [
    "MINIMISER_SLACK",
    "PROBE_RECORDS",
    "PROBE_RECORD_SCALE",
    "HeadData",
    "HeadFit",
    "HeadRelease",
    "binary_objective",
    "certainty_scores",
    "check_minimiser",
    "fit_binary_head",
    "fit_multinomial_head",
    "head_features",
    "head_probabilities",
    "head_sensitivity",
    "head_to_linear",
    "multinomial_objective",
    "probe_record_influence",
    "release_head",
]
