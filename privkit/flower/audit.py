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
:class:`privkit.trainers.dp_sgd_step.DpSgdStep`, or its Gaussian head releases), the white-box audit
puts canaries into that mechanism (:mod:`privkit.probes`) and tests what they observe against the
ledger (:func:`privkit.audit.mechanism_audit.audit_mechanisms`, :func:`audit_app_mechanisms`). The
ClientApps run in Ray actors, other processes: the ServerApp's grid is wrapped
(:class:`AuditedGrid`) so that every message carries the audit's probe session and mutation, and
the client mod :func:`audit_mod` runs the ClientApp inside them and sends back the canaries that
observed a release. The mod unpickles what the message carries: it is for simulations the auditor
runs, never for a node that takes messages from a server it does not trust.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from attacks.recipe import Recipe, predict_logits
from privkit import mutations, probes
from privkit.errors import PrivkitError

AUDIT = "privkit.audit"  # ConfigRecord: the audit's mutation and probe session (and the probes sent back)

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


# ----------------------------------------------------------------------------- the client mod
def audit_mod(msg, context, call_next):
    """Flower client mod: run the ClientApp inside the audit's mutation and probe session carried by
    ``msg`` (nothing changes for a message without them) and attach the canaries that observed a
    release to the reply. Add it to a ClientApp that runs privkit DP mechanisms to audit them:
    ``ClientApp(mods=[audit_mod])``."""
    if not msg.has_content() or AUDIT not in msg.content:
        return call_next(msg, context)
    from flwr.app import ConfigRecord

    record = msg.content[AUDIT]
    mutation = pickle.loads(record["mutation"])
    session = pickle.loads(record["probes"]) if "probes" in record else None
    before = {k: c.steps for k, c in session.probes.items()} if session is not None else {}
    probing = (
        probes.probing(session.plan, session) if session is not None else contextlib.nullcontext()
    )
    with mutations.mutated(mutation), probing:
        reply = call_next(msg, context)
    if session is not None and reply.has_content():
        seen = {k: c for k, c in session.probes.items() if before.get(k) != c.steps}
        if seen:
            reply.content[AUDIT] = ConfigRecord({"probes": pickle.dumps(seen)})
    return reply


# ----------------------------------------------------------------------------- the server's grid
@lru_cache(maxsize=1)
def _audited_class():
    """:class:`AuditedGrid` as a subclass of Flower's ``Grid`` (Flower imported on first use)."""
    from flwr.serverapp import Grid

    return type("AuditedFlowerGrid", (AuditedGrid, Grid), {})


def audited_grid(grid):
    """``grid`` itself outside an audit; inside one (a :func:`privkit.probes.probing` block or a
    :func:`privkit.mutations.mutated` one), an :class:`AuditedGrid` around it."""
    mutation, session = mutations.active(), probes.current()
    if mutation == mutations.CORRECT and session is None:
        return grid
    return AuditedGrid.around(grid, mutation, session)


class AuditedGrid:
    """A Flower Grid that adds the audit's mutation and probe session to every message it sends
    and takes back the canaries that the replies carry (:func:`audit_mod`). Built by :meth:`around`
    (a subclass of Flower's ``Grid``, made when Flower is imported)."""

    @classmethod
    def around(cls, grid, mutation, session):
        out = _audited_class()()
        out.inner, out.mutation, out.session = grid, mutation, session
        return out

    # Grid's interface, delegated
    def set_run(self, run) -> None:
        self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable):
        return self.inner.push_messages([self._attach(m) for m in messages])

    def pull_messages(self, message_ids: Iterable[str]):
        return [self._collect(r) for r in self.inner.pull_messages(message_ids)]

    def send_and_receive(self, messages: Iterable, *, timeout: float | None = None):
        replies = self.inner.send_and_receive([self._attach(m) for m in messages], timeout=timeout)
        return [self._collect(r) for r in replies]

    def _attach(self, msg):
        from flwr.app import ConfigRecord

        rec = {"mutation": pickle.dumps(self.mutation)}
        if self.session is not None:
            rec["probes"] = pickle.dumps(self.session)
        msg.content[AUDIT] = ConfigRecord(rec)
        return msg

    def _collect(self, reply):
        if reply.has_content() and AUDIT in reply.content:
            if self.session is not None:
                self.session.probes.update(pickle.loads(reply.content[AUDIT]["probes"]))
            del reply.content[AUDIT]
        return reply


# ----------------------------------------------------------------------------- a user's app as a recipe
@dataclass
class FlowerApp:
    """A Flower app set up on given records, as :func:`audit_app` runs it.

    Attributes
    ----------
    server_app, client_app : the app (a ClientApp running privkit DP mechanisms takes
        :func:`audit_mod` among its mods so that its mechanisms can be probed).
    num_supernodes : the simulation's nodes (one per client).
    model : called once the simulation has run: the released model (a torch module returning
        logits, a scikit-learn classifier or a callable returning probabilities).
    ledger : called once the simulation has run: the run's :class:`accountants.Ledger` (``None``:
        the app keeps none; a mechanism audit needs one).
    """

    server_app: Any
    client_app: Any
    num_supernodes: int
    model: Callable[[], Any]
    ledger: Callable[[], Any] | None = None


@dataclass
class AppRun:
    """One simulation of a :class:`FlowerApp`: its released model and ledger."""

    model: Any
    ledger: Any = None


class FlowerAppRecipe(Recipe):
    """``app_fn(x, y, seed) -> FlowerApp`` as an audit recipe: each training is one Flower simulation.

    Runs on the serial executor (Ray is Flower's; the audit's executor stays in this process)."""

    def __init__(self, app_fn: Callable[..., FlowerApp], *, name: str | None = None):
        if not callable(app_fn):
            raise TypeError(
                f"app_fn must be callable app_fn(x, y, seed) -> FlowerApp; found {app_fn!r}"
            )
        super().__init__(
            self,
            name=name or f"Flower app {getattr(app_fn, '__qualname__', type(app_fn).__name__)}",
        )
        self.app_fn = app_fn

    def __call__(self, x: np.ndarray, y: np.ndarray, seed: int) -> AppRun:
        from privkit.flower.engine import simulate

        app = self.app_fn(x, y, int(seed))
        if not isinstance(app, FlowerApp):
            raise TypeError(
                f"app_fn must return a privkit.flower.FlowerApp; found {type(app).__name__}"
            )
        simulate(app.server_app, app.client_app, app.num_supernodes)
        return AppRun(app.model(), app.ledger() if app.ledger is not None else None)

    def logits(self, model: AppRun, x: np.ndarray, n_classes: int | None = None) -> np.ndarray:
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
    **options,
):
    """Membership audit of a Flower app (:func:`attacks.audit_recipe` over :class:`FlowerAppRecipe`):
    the target run on the records its fair coins include, ``shadows`` reference runs of the same app.
    ``accounted_epsilon``: the app's claim at ``delta`` when trained on about half of the pool."""
    from attacks import audit_recipe

    return audit_recipe(
        FlowerAppRecipe(app_fn),
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
) -> dict:
    """White-box audit of the privkit DP mechanisms a Flower app's ClientApps run: one simulation on
    ``(x, y)`` with canaries in the probed clients' mechanisms, each probe set tested against the
    app's ledger (:func:`privkit.audit.mechanism_audit.probe_verdict`). ``mutation`` runs the app
    with one of :mod:`privkit.mutations`' bugs (how the audit's power is checked)."""
    from privkit.audit.mechanism_audit import probe_verdict
    from privkit.flower.engine import simulate

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
        simulate(app.server_app, app.client_app, app.num_supernodes)
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
