"""privkit's own privacy events, and JSON (de)serialisation of every event a ledger may hold.

Events are ``dp_accounting`` DpEvents (``GaussianDpEvent``, ``PoissonSampledDpEvent``,
``SelfComposedDpEvent``, ...) plus three immutable privkit events for releases that library has no
event for.  The privkit events subclass ``dp_accounting.DpEvent`` so they may appear at the top
of a ``ComposedDpEvent``/``SelfComposedDpEvent`` tree; dp-accounting's own accountants do not
know them, so privkit's :class:`~accountants.ledger.Ledger` handles them itself.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Any

import attr
import dp_accounting as dpa

from accountants._validate import check_nonnegative, check_open_unit
from accountants.nfdp import nfdp_delta, nfdp_epsilon_delta

__all__ = [
    "EpsilonDeltaEvent",
    "NfdpSubsampleEvent",
    "NonPrivateEvent",
    "describe_event",
    "event_from_dict",
    "event_to_dict",
]


@attr.s(frozen=True, slots=True, auto_attribs=True)
class NfdpSubsampleEvent(dpa.DpEvent):
    """Release of a uniform subsample of size ``k`` of a client's ``n`` records (FedMD-NFDP).

    Accounted as ``(0, delta)``-DP with the exact delta of :func:`accountants.nfdp.nfdp_profile`
    (``k/n`` without, ``1 - ((n-1)/n)^k`` with replacement) under add/remove-one neighbours.
    """

    n: int
    k: int
    replacement: bool

    def __attrs_post_init__(self) -> None:
        nfdp_epsilon_delta(self.n, self.k, self.replacement)  # validates n, k

    @property
    def theorem(self) -> tuple[float, float]:
        """(epsilon, delta) of FedMD-NFDP Theorem 1 or 2."""
        return nfdp_epsilon_delta(self.n, self.k, self.replacement)

    @property
    def epsilon_delta(self) -> tuple[float, float]:
        """The exact guarantee privkit accounts: ``(0, delta)`` (the profile is flat)."""
        return 0.0, nfdp_delta(self.n, self.k, self.replacement)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class EpsilonDeltaEvent(dpa.DpEvent):
    """A mechanism known only through its (epsilon, delta)-DP guarantee."""

    epsilon: float
    delta: float

    def __attrs_post_init__(self) -> None:
        check_nonnegative(self.epsilon, "epsilon")
        if self.delta != 0:
            check_open_unit(self.delta, "delta")

    @property
    def epsilon_delta(self) -> tuple[float, float]:
        """The guarantee as a pair."""
        return float(self.epsilon), float(self.delta)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class NonPrivateEvent(dpa.DpEvent):
    """A release with no DP guarantee (e.g. FedAUX client models sent in the clear).

    Every accountant reports ``epsilon = inf`` (and ``delta = 1``) for a ledger containing it.
    """

    reason: str

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(f"reason must be a non-empty string; found {self.reason!r}")


PRIVKIT_EVENTS = (NfdpSubsampleEvent, EpsilonDeltaEvent, NonPrivateEvent)
# Only events from these modules may be rebuilt from JSON (no arbitrary imports from a file).
_ALLOWED_MODULE_PREFIXES = ("dp_accounting", "accountants")


def _encode_value(value: Any) -> Any:
    if isinstance(value, dpa.DpEvent):
        return event_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_encode_value(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """JSON-ready dict of an event: ``{"type": "module:Class", "fields": {...}}`` (recursive).

    Uses the attrs fields that ``DpEvent.to_named_tuple`` also relies on; floats are kept as
    Python floats, which JSON round-trips exactly.
    """
    if not isinstance(event, dpa.DpEvent) or not attr.has(type(event)):
        raise ValueError(f"event must be a dp_accounting DpEvent; found {event!r}")
    cls = type(event)
    fields = {f.name: _encode_value(getattr(event, f.name)) for f in attr.fields(cls)}
    return {"type": f"{cls.__module__}:{cls.__name__}", "fields": fields}


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"type", "fields"}:
        return event_from_dict(value)
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    return value


def event_from_dict(data: dict[str, Any]) -> dpa.DpEvent:
    """Inverse of :func:`event_to_dict`."""
    try:
        module_name, class_name = data["type"].split(":")
        fields = data["fields"]
    except (KeyError, AttributeError, ValueError, TypeError) as exc:
        raise ValueError(
            f"event must look like {{'type': 'module:Class', 'fields': {{...}}}}; found {data!r}"
        ) from exc
    if not module_name.startswith(_ALLOWED_MODULE_PREFIXES):
        raise ValueError(
            f"event type must come from dp_accounting or accountants; found {module_name!r}"
        )
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, dpa.DpEvent)):
        raise ValueError(f"unknown event type {data['type']!r}")
    if not isinstance(fields, dict):
        raise ValueError(f"event {data['type']} fields must be an object; found {fields!r}")
    kwargs = {}
    for f in attr.fields(cls):
        if f.name not in fields:
            raise ValueError(f"event {data['type']} is missing field {f.name!r}")
        value = _decode_value(fields[f.name])
        _check_field(class_name, f.name, value)
        # dp-accounting types sequences of sub-events as lists; keep that.
        kwargs[f.name] = value
    unknown = sorted(set(fields) - {f.name for f in attr.fields(cls)})
    if unknown:
        raise ValueError(f"event {data['type']} has unknown fields {unknown}")
    return cls(**kwargs)


# Numeric fields of dp-accounting's events and the values that make sense for them: dp-accounting
# itself checks few of them, and a NaN or an out-of-range value would surface later as an
# unrelated error (or a wrong number) far from the ledger entry that holds it.
_PROBABILITIES = {"sampling_probability", "sampling_probs"}
_NONNEGATIVE = {
    "noise_multiplier",
    "standard_deviation",
    "noise_parameter",
    "parameter",
    "rho",
    "xi",
    "sensitivity",
    "sensitivities",
    "mean",
    "shape",
    "epsilon",
    "delta",
}
_COUNTS = {
    "count": 1,
    "num_buckets": 1,
    "source_dataset_size": 0,
    "sample_size": 0,
    "dataset_size": 0,
    "truncated_batch_size": 0,
    "step_counts": 0,
    "n": 1,
    "k": 1,
}


def _check_field(event: str, name: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``event.name`` and the value when it is not a sensible number."""
    if isinstance(value, dpa.DpEvent) or name in ("events", "reason", "replacement"):
        return
    values = value if isinstance(value, list) else [value]
    where = f"{event}.{name}"
    for v in values:
        if isinstance(v, dpa.DpEvent):
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{where} must be a number; found {v!r}")
        x = float(v)
        if math.isnan(x):
            raise ValueError(f"{where} must be a number; found nan")
        if name in _PROBABILITIES and not 0.0 <= x <= 1.0:
            raise ValueError(f"{where} must be in [0, 1]; found {v!r}")
        if name in _NONNEGATIVE and x < 0:
            raise ValueError(f"{where} must be >= 0; found {v!r}")
        if name in _COUNTS and (not x.is_integer() or x < _COUNTS[name]):
            raise ValueError(f"{where} must be an integer >= {_COUNTS[name]}; found {v!r}")


def describe_event(event: dpa.DpEvent) -> str:
    """Short one-line description of an event for error messages."""
    text = repr(event)
    return text if len(text) <= 200 else text[:197] + "..."
