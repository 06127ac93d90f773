"""The mechanism controls in the report: each formal-DP method's ``mechanism-controls/<method>.json``
read into a :class:`reports.MechanismControls`, the summary row's verdict resting on the strongest
valid audit of the method, and the threat-model sentence of the mechanism audit.

Which audit a row's verdict rests on: the black-box membership audit of a method tests its released
model against its accounted epsilon, and at the demo's scale its ceiling lies below that epsilon
(``inconclusive``: no outcome could contradict the claim). The white-box mechanism audit of the
method's correct twin tests the claim where it is made, at each DP mechanism, and always has a
definite answer. So the row's verdict is the mechanism audit's (``consistent`` or ``violation``)
when there is one, except that a black-box ``violation`` stands (it is valid evidence whatever the
mechanism audit says: e.g. a release no ledger entry accounts for). The black-box verdict is kept
in the method's audit section either way.

A Flower run's audit (:func:`privkit.flower.write_audit`) is no black-box membership audit: canary
clients (a client-level claim) or canary records (a record-level one) are injected white-box, and
its ``audit.json`` names which (``audit_kind``); the row's verdict rests on it under that name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from privkit.files import read_json as _read_json
from privkit.pipeline.mechanism_controls import record_path

CANARY_BASES = ("canary-clients", "canary-records", "canaries")
"""The ``audit_kind`` of a Flower run's white-box canary audit (:func:`privkit.flower.write_audit`)."""


def read_mechanism_controls(root: Path, key: str, status: dict, mdir: Path):
    """Method ``key``'s mechanism controls (its record and its ``status.json`` entry), if any."""
    from reports import MechanismControls

    st = (status.get("mechanism_controls") or {}).get(key) or {}
    if st.get("state") == "skipped":
        return MechanismControls(
            state="skipped", message=st.get("error") or "mechanism controls disabled"
        )
    if st.get("state") == "failed":
        return MechanismControls(
            state="failed",
            error=st.get("error"),
            message=(
                f"The mechanism controls failed ({st.get('error')}): the verdict rests on the black-box audit."
            ),
        )
    path = record_path(root, key)
    # with a status entry, only a completed step's record; without one, whatever exists
    if not path.is_file() or (st and st.get("state") != "done"):
        return None
    rec = _read_json(path)
    settings = {k: rec.get(k) for k in ("delta", "confidence", "canaries")}
    settings["clients"] = list(rec.get("clients") or [])
    if rec.get("state") == "unprobed":
        return MechanismControls(
            state="unprobed",
            message=rec.get("message", ""),
            reason=unprobed_reason(mdir),
            **settings,
        )
    return MechanismControls(
        state="done",
        message=rec.get("message", ""),
        catchable=rec.get("catchable"),
        twins=[_twin(t) for t in rec.get("twins", [])],
        **settings,
    )


def _twin(rec: dict):
    """A twin's audit record, without the per-canary ROC curves (they stay in the record)."""
    from reports import MechanismTwin

    mutation = rec.get("mutation") or {}
    return MechanismTwin(
        twin=rec["twin"],
        description=mutation.get("description", ""),
        expected=rec["expected"],
        status=rec["status"],
        message=rec.get("message", ""),
        as_expected=rec["as_expected"],
        accounted_epsilon=rec.get("accounted_epsilon"),
        measured_epsilon=rec.get("measured_epsilon"),
        epsilon_lower_bound=rec.get("epsilon_lower_bound"),
        test_accuracy=rec.get("test_accuracy"),
        probes=[_probe(p) for p in rec.get("probes", [])],
    )


def _probe(p: dict):
    from reports import MechanismProbe

    audit = p.get("audit") or {}
    conf = audit.get("conformance") or {}
    keep = ("name", "rejected", "measured", "confidence_limit", "claimed", "detectable", "detail")
    return MechanismProbe(
        client=p["client"],
        mechanism=p["mechanism"],
        status=p["status"],
        rejected=list(p.get("rejected", [])),
        failed=list(p.get("failed", [])),
        holds_epsilon=p.get("holds_epsilon"),
        holds_note=p.get("holds_note", ""),
        tests={n: {k: t.get(k) for k in keep} for n, t in (conf.get("tests") or {}).items()},  # type: ignore[misc]  # pydantic validates the dicts
        epsilon_lower_bound=p.get("epsilon_lower_bound"),
        epsilon_ceiling=audit.get("epsilon_ceiling"),
        measured_epsilon=p.get("measured_epsilon"),
        claimed_epsilon=p.get("claimed_epsilon"),
        canaries=(p.get("canaries") or {}).get("canaries"),
        releases=conf.get("steps_observed"),
    )


def unprobed_reason(mdir: Path) -> str:
    """Why a formal-DP method has no mechanism audit, from the mechanisms its ledger records."""
    path = mdir / "ledger.json"
    try:
        ledger = _read_json(path) if path.is_file() else None
    except ValueError:
        ledger = None
    if ledger is None:
        return "none of its DP mechanisms took audit probes"
    entries = [e for es in (ledger.get("clients") or {}).values() for e in es]
    gaussian = sorted({e["label"] for e in entries if "Gaussian" in _event_types(e.get("event"))})
    if gaussian:
        return f"its Gaussian mechanism(s) ({', '.join(gaussian)}) do not take audit probes yet (privkit.mechanisms.probes)"
    kinds = sorted({t for e in entries for t in _event_types(e.get("event")).split()})
    return (
        f"its ledger records no Gaussian mechanism ({', '.join(kinds) or 'no events'}): its guarantee "
        "does not rest on calibrated noise, so there is no noise scale, sampling rate or clip for "
        "the mechanism audit to test"
    )


def _event_types(event: Any) -> str:
    """The class names in an event's JSON tree (``event_to_dict``), space-separated."""
    if isinstance(event, dict):
        own = str(event.get("type", "")).rpartition(":")[2]
        return " ".join(x for x in [own, *(_event_types(v) for v in event.values())] if x)
    if isinstance(event, list):
        return " ".join(x for x in (_event_types(v) for v in event) if x)
    return ""


def rest_verdict(m) -> None:
    """Set method ``m``'s verdict on its strongest valid audit (module docstring); warn when the
    noise-halved twin was not caught or the mechanism controls failed."""
    from reports import ReportWarning

    mc = m.mechanism_controls
    black_box = m.audit.verdict if m.audit else None
    if m.formal_dp and black_box is not None and m.verdict is not None:
        # a Flower run's audit (privkit.flower.write_audit) is white-box, by canary clients or
        # canary records: its audit.json says which (one written before it did: "canaries");
        # every other audit is the black-box one. Without a claim to check the verdict is the
        # rule's (no-claim)
        kind = m.audit.extra.get("audit_kind") or ("canaries" if m.method == "flower" else None)
        m.verdict_basis = kind if kind in CANARY_BASES else "black-box"
    if mc is None:
        return
    if mc.state == "failed":
        m.warnings.append(ReportWarning(code="other", source="audit", message=mc.message))
    if mc.lacks_power:
        half = mc.noise_halved
        m.warnings.append(
            ReportWarning(
                code="reduced_audit",
                source="audit",
                message=(
                    f"the mechanism audit lacked power: the {half.twin} twin ({half.description}) came out "
                    f"{half.status}, not violation ({half.message})"
                ),
            )
        )
    correct = mc.correct
    if not m.formal_dp or correct is None or correct.status not in ("violation", "consistent"):
        return  # no claim to check, or no definite mechanism verdict: the verdict stays
    if black_box is not None and black_box.status == "violation":
        return  # a valid black-box violation stands
    m.verdict = _mechanism_verdict(mc, correct, black_box)
    m.verdict_basis = "mechanism"


def _mechanism_verdict(mc, correct, black_box):
    from reports import Verdict

    beside = f" The black-box audit's verdict: {black_box.status}." if black_box is not None else ""
    return Verdict(
        status=correct.status,
        message=f"mechanism audit of the correct twin (white-box): {correct.message}.{beside}",
        epsilon_lower_bound=correct.epsilon_lower_bound,
        accounted_epsilon=correct.accounted_epsilon,
        confidence=mc.confidence,
        correction="Bonferroni over the probe sets",
        attack="mechanism audit",
        measured_epsilon=correct.measured_epsilon,
    )


def mechanism_threat_text(methods: list) -> str | None:
    """The mechanism audits' assumptions for the threat-model box (``None`` without any)."""
    done = [
        m.mechanism_controls
        for m in methods
        if m.mechanism_controls is not None and m.mechanism_controls.state == "done"
    ]
    if not done:
        return None
    mc = done[0]  # one run, one [audit.mechanism_controls] section: the same settings for all
    clients = ", ".join(str(c) for c in mc.clients)
    conf = f"{100 * mc.confidence:.4g}%" if mc.confidence is not None else "the stated"
    return (
        "white-box, at each formal-DP method's DP mechanisms, on two twins of the method (as accounted, "
        "and with half its noise) trained with reproducible noise (controls, never releases). The "
        "auditor knows every other record's contribution and each intermediate model: the adversary "
        f"differential privacy is defined against. {mc.canaries} canaries per probe set (one probe set "
        f"per DP mechanism of client(s) {clients}) enter the mechanism as records and are sampled, "
        "clipped and noised like them; each probe set is tested against its ledger entries "
        "(number of releases, noise scale, influence = sampling rate x clip or sensitivity) and gives "
        "a model-free one-run lower bound (the f-DP analysis of the one-run experiment against the bare (epsilon, delta) claim, Mahloujifar, Melis & Chaudhuri 2024; guesses fixed in advance from the claim), the two at half the error rate each. "
        f"A method's verdict holds at {conf} confidence, Bonferroni over its probe sets."
    )
