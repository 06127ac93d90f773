"""Audits of Flower apps: membership audits as a training recipe, and mechanism canaries in ClientApps.

**As a recipe.** An audit trains the app on records of the auditor's choosing: each record of the
pool joins the target run's clients' data by a fair coin, and reference runs of the same app train
on random halves of the pool (:func:`attacks.audit_recipe`). A user's app enters as a factory
``app_fn(x, y, seed) -> FlowerApp``: it splits the records it is given among its clients as the
real app would and returns the ServerApp, the ClientApp, the number of nodes and how to read the
released model (and ledger) once the simulation has run. :func:`audit_app` runs each training as
one Flower simulation. privkit's own methods on Flower are audited by ``privkit audit`` on a run
trained with ``--engine flower`` (:class:`privkit.audit.recipes.FederationRecipe` with
``engine="flower"``: the target and all reference runs in one simulation).

**Mechanism canaries.** Where a ClientApp runs a privkit DP mechanism (privkit's DP-SGD step,
:class:`privkit.mechanisms.dp_sgd_step.DpSgdStep`, or its Gaussian head releases), the white-box audit
puts canaries into that mechanism (:mod:`privkit.mechanisms.probes`) and tests what they observe against the
ledger (:func:`privkit.audit.mechanism_audit.audit_mechanisms` with ``engine="flower"``,
:func:`audit_app_mechanisms`). The canaries and the mutation reach the ClientApps, which run in Ray
actors, through :mod:`privkit.flower_engine.audit_transport` (the ClientApp takes its mod, :func:`audit_mod`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attacks.recipe import Recipe, predict_logits
from privkit.errors import PrivkitError
from privkit.flower_engine.apps import FlowerApp
from privkit.flower_engine.audit_transport import AUDIT, AuditedGrid, audit_mod, audited_grid
from privkit.mechanisms import mutations, probes

__all__ = [
    "AUDIT",
    "AppRun",
    "AuditedGrid",
    "FlowerApp",
    "FlowerAppRecipe",
    "audit_app",
    "audit_app_mechanisms",
    "audit_mod",
    "audited_grid",
]


# ----------------------------------------------------------------------------- a user's app as a recipe
@dataclass
class AppRun:
    """One simulation of a :class:`FlowerApp`: its released model and ledger."""

    model: Any
    ledger: Any = None


class FlowerAppRecipe(Recipe):
    """``app_fn(x, y, seed) -> FlowerApp`` as an audit recipe: each training is one Flower simulation.

    Runs on the serial executor (Ray is Flower's; the audit's executor stays in this process).
    ``driver``: ``ray`` (Flower's simulation engine) or ``inprocess`` (:func:`privkit.flower.run_inprocess`).

    Parameters
    ----------
    app_fn : callable
        ``app_fn(x, y, seed) -> FlowerApp``: the app set up on the given records.
    name : str, optional
        The recipe's name in reports (default: from ``app_fn``'s name).
    driver : str
        ``ray`` (Flower's simulation engine) or ``inprocess``.
    """

    def __init__(
        self, app_fn: Callable[..., FlowerApp], *, name: str | None = None, driver: str = "ray"
    ):
        if not callable(app_fn):
            raise TypeError(
                f"app_fn must be callable app_fn(x, y, seed) -> FlowerApp; found {app_fn!r}"
            )
        super().__init__(
            self,
            name=name or f"Flower app {getattr(app_fn, '__qualname__', type(app_fn).__name__)}",
        )
        self.app_fn = app_fn
        self.driver = driver

    def __call__(self, x: np.ndarray, y: np.ndarray, seed: int) -> AppRun:
        from privkit.flower_engine.engine import simulate

        app = self.app_fn(x, y, int(seed))
        if not isinstance(app, FlowerApp):
            raise TypeError(
                f"app_fn must return a privkit.flower.FlowerApp; found {type(app).__name__}"
            )
        simulate(app.server_app, app.client_app, app.num_supernodes, driver=self.driver)
        return AppRun(app.model(), app.ledger() if app.ledger is not None else None)

    def logits(self, model: AppRun, x: np.ndarray, n_classes: int | None = None) -> np.ndarray:
        """(N, C) logits of the model a run released.

        Parameters
        ----------
        model : AppRun
            What one simulation returned (its released model and ledger).
        x : numpy.ndarray
            The inputs, N of them.
        n_classes : int, optional
            Number of classes, where the model's output does not say (e.g. a classifier that saw
            some classes only).
        """
        return predict_logits(model.model, x, n_classes)

    def details(self, model: AppRun) -> dict:
        return {"ledger": model.ledger} if model.ledger is not None else {}


def audit_app(
    app_fn: Callable[..., FlowerApp],
    x,
    y,
    *,
    delta: float,
    accounted_epsilon: float | None = None,
    shadows: int = 4,
    seed: int = 0,
    confidence: float = 0.95,
    progress: bool = False,
    driver: str = "ray",
    **options,
):
    """Membership audit of a Flower app (:func:`attacks.audit_recipe` over :class:`FlowerAppRecipe`):
    the target run on the records its fair coins include, ``shadows`` reference runs of the same app.
    ``accounted_epsilon``: the app's claim at ``delta`` when trained on about half of the pool.
    ``driver``: ``ray`` (Flower's simulation engine, one simulation per run) or ``inprocess``.

    Parameters
    ----------
    app_fn : callable
        ``app_fn(x, y, seed) -> FlowerApp``: the app set up on the records the auditor chooses.
    x : array-like
        The pool's inputs (indexable by an integer array).
    y : array-like
        The pool's integer labels.
    delta : float
        Delta of the claim.
    accounted_epsilon : float, optional
        The epsilon the app claims at ``delta`` (None: no claim; the verdict is ``no-claim``).
    shadows : int
        Reference runs of the app (even, >= 2, or 0: the threshold attack alone).
    seed : int
        The audit seed (coins, reference halves, the seeds handed to ``app_fn``).
    confidence : float
        Confidence of the verdict's bound for the whole family of attacks.
    progress : bool
        Show progress bars.
    driver : str
        ``ray`` or ``inprocess``.
    **options : Any
        Further keyword arguments of :func:`attacks.audit_recipe` (``attacks``, ``guesses``, ...).

    Returns
    -------
    attacks.RecipeAudit
    """
    from attacks import audit_recipe

    return audit_recipe(
        FlowerAppRecipe(app_fn, driver=driver),
        x,
        y,
        accounted_epsilon=accounted_epsilon,
        delta=delta,
        shadows=shadows,
        confidence=confidence,
        seed=seed,
        progress=progress,
        **options,
    )


def audit_app_mechanisms(
    app_fn: Callable[..., FlowerApp],
    x,
    y,
    *,
    delta: float,
    seed: int = 0,
    mutation: Any = "correct",
    canaries: int = 1000,
    clients: tuple[int, ...] | None = (0,),
    confidence: float = 0.95,
    driver: str = "ray",
) -> dict:
    """White-box audit of the privkit DP mechanisms a Flower app's ClientApps run: one simulation on
    ``(x, y)`` with canaries in the probed clients' mechanisms, each probe set tested against the
    app's ledger (:func:`privkit.audit.mechanism_audit.probe_verdict`). ``mutation`` runs the app
    with one of :mod:`privkit.mechanisms.mutations`' bugs (how the audit's power is checked).

    Parameters
    ----------
    app_fn : callable
        ``app_fn(x, y, seed) -> FlowerApp`` returning an app with a ledger.
    x : array-like
        The records the app trains on (inputs).
    y : array-like
        Their integer labels.
    delta : float
        Delta of the epsilons the ledger accounts.
    seed : int
        The audit seed (the canaries) and the seed handed to ``app_fn``.
    mutation : str or privkit.mechanisms.mutations.Mutation
        ``"correct"`` or one of :mod:`privkit.mechanisms.mutations`' bugs to run the app with.
    canaries : int
        Canaries per (client, mechanism) probe set (capped at the mechanism's dimension).
    clients : tuple of int or None
        The clients whose mechanisms are probed (``None``: every client).
    confidence : float
        Confidence of each probe set's bound.
    driver : str
        ``ray`` or ``inprocess``.

    Returns
    -------
    dict
        The mutation, seed, delta, confidence and :func:`~privkit.audit.mechanism_audit.probe_verdict`'s
        record.
    """
    from privkit.audit.mechanism_audit import probe_verdict
    from privkit.flower_engine.engine import simulate

    app = app_fn(x, y, int(seed))
    if not isinstance(app, FlowerApp) or app.ledger is None:
        raise PrivkitError(
            "app_fn must return a privkit.flower.FlowerApp with a ledger for a mechanism "
            f"audit; found {type(app).__name__}"
            + ("" if not isinstance(app, FlowerApp) else " without a ledger")
        )
    mut = mutations.for_federation(mutation, app.num_supernodes)
    plan = probes.ProbePlan(canaries=canaries, clients=clients, seed=seed)
    with probes.probing(plan) as session, mutations.mutated(mut):
        simulate(app.server_app, app.client_app, app.num_supernodes, driver=driver)
    if not session.probes:
        raise PrivkitError(
            f"the app ran no probed privkit DP mechanism (clients {clients}): its ClientApp "
            "must take privkit.flower.audit_mod and run a privkit mechanism"
        )
    ledger = mutations.mutate_ledger(app.ledger(), mut)
    return {
        "mutation": mut.to_dict(),
        "seed": seed,
        "delta": delta,
        "confidence": confidence,
        **probe_verdict(session, ledger, delta=delta, confidence=confidence),
    }
