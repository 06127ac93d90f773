"""Client side of a Flower app's ledger: what ran on the client travels to the server in the reply.

A ClientApp reports the DP mechanisms it applies itself (privkit's DP-SGD step, Flower's LocalDpMod)
in one ``ConfigRecord`` of its reply, :data:`RECORD_KEY`; :class:`privkit.flower.Accounted` on the
server takes it out before the strategy aggregates and writes it to the ledger under the client's
node id.  Mechanisms applied on the server (the central-DP wrappers) need nothing on the client.

* :data:`ledger_mod`: a mod (put it first in ``ClientApp(mods=[...])``) that sends what the train
  function recorded with :func:`record` or :func:`record_dpsgd` during the call.
* :func:`recorded`: wraps a Flower mod that applies DP on the client (``LocalDpMod``) so that its
  parameters travel with every reply it noised.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

from accountants import event_to_dict

__all__ = ["RECORD_KEY", "ledger_mod", "record", "record_dpsgd", "recorded"]

RECORD_KEY = "privkit-ledger"
_ENTRIES = "entries"
_recording: contextvars.ContextVar[list[dict] | None] = contextvars.ContextVar(
    "privkit_flower_entries", default=None
)


def record(event: Any, label: str, neighbouring: str = "add_remove") -> None:
    """Record that ``event`` (a dp-accounting or privkit DpEvent) touched this client's data in the
    current round.  Must run inside a ClientApp whose mods start with :data:`ledger_mod`.

    ``neighbouring`` is the relation the event's parameters assume: ``add_remove`` for record-level
    DP-SGD with Poisson sampling (one record added or removed).

    Parameters
    ----------
    event : DpEvent
        A dp-accounting or privkit DpEvent: the mechanism that touched the data.
    label : str
        Which step of the method it is (non-empty), e.g. ``"dp-sgd round 7"``.
    neighbouring : str
        The neighbouring relation the event's parameters assume (``add_remove`` or
        ``replace_one``).
    """
    if not isinstance(label, str) or not label:
        raise ValueError(f"label must be a non-empty string; found {label!r}")
    _active("record()").append(
        {
            "kind": "event",
            "event": event_to_dict(event),
            "label": label,
            "neighbouring": neighbouring,
        }
    )


def _active(caller: str) -> list[dict]:
    """The entries of the train call in progress (raises outside a ClientApp with ledger_mod)."""
    entries = _recording.get()
    if entries is None:
        raise ValueError(
            f"{caller} must run inside a ClientApp whose mods start with privkit.flower.ledger_mod; "
            "found no active ledger_mod"
        )
    return entries


def record_dpsgd(step: Any, steps: int, label: str = "dp-sgd") -> None:
    """Record ``steps`` steps of privkit's :class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep` (Poisson
    sampling at ``step.sample_rate``, noise multiplier ``step.noise_multiplier``; record-level,
    add/remove-one), as privkit's own DP-SGD trainers account them.

    Parameters
    ----------
    step : privkit.mechanisms.dp_sgd_step.DpSgdStep
        The DP-SGD step that ran (its sample rate and noise multiplier).
    steps : int
        How many times it ran this round.
    label : str
        The ledger label.
    """
    from accountants import dpsgd_event

    record(dpsgd_event(step.sample_rate, step.noise_multiplier, steps), label, "add_remove")


def _attach(reply: Any, entries: list[dict]) -> None:
    """Append ``entries`` to the reply's privkit record (created if absent)."""
    from flwr.app import ConfigRecord

    if not entries or reply.has_error():
        return
    content = reply.content
    previous = json.loads(content[RECORD_KEY][_ENTRIES]) if RECORD_KEY in content else []
    content[RECORD_KEY] = ConfigRecord({_ENTRIES: json.dumps(previous + entries)})


def _is_train(msg: Any) -> bool:
    from flwr.app import MessageType

    return msg.metadata.message_type.split(".")[0] == MessageType.TRAIN


def ledger_mod(msg: Any, ctxt: Any, call_next: Any) -> Any:
    """Flower mod: collect what the app records with :func:`record` during a train call and send it
    with the reply.  Put it first in ``mods`` (a mod that rebuilds the reply, as LocalDpMod does,
    drops records it does not know).

    Parameters
    ----------
    msg : flwr.app.Message
        The message the node received.
    ctxt : flwr.app.Context
        The node's context.
    call_next : callable
        The rest of the ClientApp (the next mod, or the app itself): ``call_next(msg, ctxt)``.

    Returns
    -------
    flwr.app.Message
        The reply, with the recorded entries attached (a train call's).
    """
    if not _is_train(msg):
        return call_next(msg, ctxt)
    token = _recording.set([])
    try:
        reply = call_next(msg, ctxt)
        entries = _recording.get() or []
    finally:
        _recording.reset(token)
    _attach(reply, entries)
    return reply


def _local_dp_entry(mod: Any) -> dict:
    return {
        "kind": "local_dp",
        "label": "LocalDpMod",
        "clipping_norm": float(mod.clipping_norm),
        "sensitivity": float(mod.sensitivity),
        "epsilon": float(mod.epsilon),
        "delta": float(mod.delta),
    }


def recorded(mod: Any) -> Any:
    """A mod that applies Flower's ``LocalDpMod`` ``mod`` and reports its parameters with each reply
    it noised; the server turns them into the mechanism's event (:func:`~privkit.flower.mechanisms.local_dp_event`)."""
    from flwr.clientapp.mod import LocalDpMod

    if not isinstance(mod, LocalDpMod):
        raise TypeError(f"mod must be a flwr LocalDpMod; found {type(mod).__name__}")

    def recorded_mod(msg: Any, ctxt: Any, call_next: Any) -> Any:
        reply = mod(msg, ctxt, call_next)
        if _is_train(msg):
            _attach(reply, [_local_dp_entry(mod)])
        return reply

    recorded_mod.__name__ = f"recorded_{type(mod).__name__}"
    recorded_mod.dp_mod = mod  # type: ignore[attr-defined]  # for privkit.flower.check_flower_dp
    return recorded_mod


def entries_of(reply: Any) -> list[dict]:
    """Take the privkit record out of ``reply`` (server side); [] when the client sent none."""
    if reply.has_error() or RECORD_KEY not in reply.content:
        return []
    entries = json.loads(reply.content[RECORD_KEY][_ENTRIES])
    del reply.content[RECORD_KEY]
    return entries
