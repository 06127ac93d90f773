"""White-box audit of a privkit method at its DP mechanisms: ``audit_mechanisms``.

The method trains once, as a user's run does, inside :func:`privkit.mechanisms.probes.probing`: every DP
mechanism of the probed clients takes canaries (:class:`attacks.whitebox.GradientCanaries`) that it
samples, clips and noises like its own records. After training, each probe set's claim is read
from the run's ledger, from the entries of its client whose label contains the mechanism's label
(:func:`attacks.conformance.claim_from_events`), and the probe set is audited against it
(:meth:`attacks.whitebox.GradientCanaries.audit`: conformance test and one-run bound). With k probe
sets each is audited at ``1 - beta / k`` (Bonferroni), so the method's verdict (``violation`` when
any probe set's is) holds at ``confidence``.

With ``mutation`` the same run is made with one of the bugs of :mod:`privkit.mechanisms.mutations`: that is how
the audit's power is measured (``benchmarks/audit_mutations.py``) and how every report's
noise-halved control is made. A ledger mutation that leaves a method's ledger unchanged (no
Poisson sampling to halve, single releases) is ``not-applicable`` for that method.

A method without a formal guarantee for its pipeline (``formal_dp`` false) is audited at the DP
mechanisms it does run (FedAUX's certainty scores): the record says so (``scope``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from privkit.errors import PrivkitError

SCHEMA_VERSION = 1

__all__ = ["SCHEMA_VERSION", "audit_mechanisms", "catchable_sentence", "probe_verdict"]


def _claim_for(ledger, client: int, label: str, sensitivity: float):
    from attacks.conformance import claim_from_events

    entries = [e for e in ledger.entries(client) if label in e.label]
    if not entries:
        raise PrivkitError(
            f"the ledger has no entry labelled {label!r} for client {client}: the "
            "mechanism's releases are not accounted for"
        )
    return claim_from_events([e.event for e in entries], sensitivity)


def audit_mechanisms(
    method: str,
    federation,
    trainer_config: dict | None = None,
    *,
    delta: float,
    seed: int = 0,
    mutation: Any = "correct",
    canaries: int = 1000,
    clients: tuple[int, ...] | None = (0,),
    confidence: float = 0.95,
    reproducible_noise: bool = True,
    progress: bool = False,
    engine: str = "inprocess",
    pld_grid: float | None = None,
) -> dict:
    """Train ``method`` once with probes at its DP mechanisms and audit each against its ledger.

    Parameters
    ----------
    method, federation, trainer_config : what to train (``trainer_config``: overrides of the
        method's defaults).
    delta : delta of the claims tested (the one-run bound's).
    seed : training seed; the canaries derive from it too.
    mutation : a :class:`privkit.mechanisms.mutations.Mutation` or its name (``noise x1/N`` resolved to the
        federation's client count).
    canaries : canaries per probe set (capped at the mechanism's dimension).
    clients : the clients whose mechanisms take probes (``None``: all).
    confidence : family-wise confidence over the probe sets.
    reproducible_noise : seed the DP noise (audits and controls are never releases).
    engine : where the method trains: ``inprocess`` or ``flower`` (its ClientApps take the probes:
        :mod:`privkit.flower.audit`).
    pld_grid : the PLD grid of the accounted epsilon (``None``: the ledger's own, 1e-4): a run's
        headline grid, so that its controls account as its headline does (a coarser grid is
        still an upper bound, and ten times cheaper).

    Returns
    -------
    The record of this audit (JSON-ready): ``status`` (``violation``, ``consistent`` or
    ``not-applicable``), ``message``, ``probes`` (one audit per probe set), the mutation, the
    method's accounted epsilon (worst client, mutated ledger) and the training's test accuracy.
    """
    from privkit.mechanisms import mutations
    from privkit.mechanisms.probes import ProbePlan, probing
    from privkit.methods import get_trainer

    if not 0 < confidence < 1:
        raise PrivkitError(f"confidence must be in (0, 1); found {confidence}")
    spec = get_trainer(method)
    # A method without a formal guarantee for its whole pipeline may still release some things
    # through a DP mechanism (FedAUX: its certainty scores; its models go out in the clear): those
    # mechanisms are audited against their own ledger entries all the same. A method with no DP
    # mechanism at all takes no probes and is refused below, once it has run.
    mut = mutations.for_federation(mutation, federation.num_clients)
    cfg = spec.config_cls.model_validate(
        {**(trainer_config or {}), "reproducible_noise": reproducible_noise}
    )
    plan = ProbePlan(canaries=canaries, clients=clients, seed=seed)
    with probing(plan) as session, mutations.mutated(mut):
        if engine == "inprocess":
            result = spec.fn(federation, cfg, seed, progress=progress)
        else:
            from privkit.flower_engine.engine import train

            result = train(method, federation, cfg, seed, progress=progress, engine=engine)
    ledger = mutations.mutate_ledger(result.ledger, mut)
    if pld_grid is not None:
        ledger.value_discretization_interval = pld_grid
    base = {
        "schema_version": SCHEMA_VERSION,
        "method": method,
        "mutation": mut.to_dict(),
        "seed": seed,
        "delta": delta,
        "confidence": confidence,
        "test_accuracy": float(result.test_accuracy),
        "accounted_epsilon": _worst_epsilon(ledger, delta),
        "pld_grid": ledger.value_discretization_interval,
        "formal_dp": spec.formal_dp,
    }
    if not session.probes:
        raise PrivkitError(
            f"method {method!r} ran no probed DP mechanism (clients {clients}): "
            + (
                "its mechanisms do not take audit probes"
                if spec.formal_dp
                else "it claims no formal guarantee and released nothing through a DP mechanism"
            )
        )
    if not spec.formal_dp:
        base["scope"] = (
            f"{method} claims no formal guarantee for the whole pipeline (accounted epsilon "
            f"{base['accounted_epsilon']:g}); the audit covers its DP mechanisms only: "
            + ", ".join(sorted({label for _, label in session.probes}))
        )
    if mut.touches_ledger and _same_ledger(ledger, result.ledger):
        return {
            **base,
            "status": "not-applicable",
            "probes": [],
            "message": f"{mut.name}: the method's ledger has nothing this bug changes (no Poisson "
            "sampling or repeated steps)",
        }
    return {**base, **probe_verdict(session, ledger, delta=delta, confidence=confidence)}


def probe_verdict(session, ledger, *, delta: float, confidence: float) -> dict:
    """Each probe set of ``session`` audited against the claim ``ledger`` records for its client's
    mechanism, at ``1 - beta / k`` each (Bonferroni over the k probe sets): ``status``, ``message``,
    ``probes``, the largest ``epsilon_lower_bound`` and ``measured_epsilon``."""
    share = 1 - (1 - confidence) / len(session.probes)
    probes = []
    for (client, label), can in sorted(session.probes.items()):
        claim = _claim_for(ledger, client, label, can.clip_norm)
        res = can.audit(delta=delta, confidence=share, claim=claim)
        probes.append(
            {
                "client": client,
                "mechanism": label,
                "canaries": can.summary(),
                "audit": res.to_dict(),
                "status": res.verdict,
                "epsilon_lower_bound": res.epsilon_lower_bound,
                "measured_epsilon": res.measured_epsilon,
                "claimed_epsilon": res.accounted_epsilon,
                "rejected": res.conformance.rejected,
                "failed": res.conformance.failed,
                "holds_epsilon": res.conformance.holds_epsilon,
                "holds_note": res.conformance.holds_note,
            }
        )
    bad = [p for p in probes if p["status"] == "violation"]
    status = "violation" if bad else "consistent"
    where = "; ".join(
        f"client {p['client']} {p['mechanism']}: {'; '.join(p['failed']) or 'one-run bound'}"
        + (f" ({p['holds_note']})" if p["holds_note"] else "")
        for p in bad
    )
    msg = (
        f"VIOLATION at the mechanism ({where})"
        if bad
        else f"every probed mechanism conforms to its ledger ({len(probes)} probe set(s))"
    ) + (f" at {100 * confidence:.4g}% confidence, Bonferroni over {len(probes)} probe set(s)")
    return {
        "status": status,
        "message": msg,
        "probes": probes,
        "epsilon_lower_bound": max(p["epsilon_lower_bound"] for p in probes),
        "measured_epsilon": max(
            (p["measured_epsilon"] for p in probes if p["measured_epsilon"] is not None),
            default=None,
        ),
    }


_LAST_EPSILON: dict[tuple[str, float, float], float] = {}


def _worst_epsilon(ledger, delta: float) -> float:
    """The worst client's epsilon (inf where no accountant handles an event). Accounting is a
    function of the ledger's content, delta and grid alone, and a mechanism control's second twin
    (noise halved: a bug the ledger does not record) usually holds the first twin's ledger, so the
    last answer is kept and reused for the same content (seconds of PLD per DP-SGD method)."""
    key = (
        json.dumps(ledger.to_dict(), sort_keys=True),
        float(delta),
        ledger.value_discretization_interval,
    )
    if key not in _LAST_EPSILON:
        try:
            value = float(ledger.epsilon(delta))
        except Exception:
            value = math.inf
        _LAST_EPSILON.clear()
        _LAST_EPSILON[key] = value
    return _LAST_EPSILON[key]


def _same_ledger(a, b) -> bool:
    from accountants import event_to_dict

    return all(
        [event_to_dict(e.event) for e in a.entries(c)]
        == [event_to_dict(e.event) for e in b.entries(c)]
        for c in b.clients
    )


def catchable_sentence(
    method: str, noise_ratio_limit: float | None, influence_ratio_limit: float | None
) -> str:
    """One sentence saying which bug sizes the method's mechanism audit catches, from the
    conformance test's confidence limits on its correct twin: noise below ``noise_ratio_limit``
    of the claim, an influence above ``influence_ratio_limit`` times the claim (sampling rate x
    sensitivity), and any release the ledger does not count."""
    parts = []
    if noise_ratio_limit is not None and math.isfinite(noise_ratio_limit):
        parts.append(f"noise below {noise_ratio_limit:.3g} of the claimed scale")
    if influence_ratio_limit is not None and math.isfinite(influence_ratio_limit):
        parts.append(
            f"a record influence (sampling rate x clip or sensitivity) above "
            f"{influence_ratio_limit:.3g} x the claim"
        )
    parts.append("any release the ledger does not count")
    return f"{method}: the mechanism audit catches " + ", ".join(parts) + "."
