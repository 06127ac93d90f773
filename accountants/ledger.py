"""Per-client privacy ledger: which mechanisms touched whose data, and what that costs.

A trainer appends, for each client, every privacy event that touched that client's data, with a
label naming the step ("scores", "class-head", "round 7: dp-sgd") and optionally the round.
Accountants then answer "epsilon at delta" / "delta at epsilon" per client or for the worst client.

Accountants and what they apply to
----------------------------------
Every entry is split into a *tight* part (dp-accounting DpEvents) and a *fixed* part (privkit's
:class:`~accountants.events.EpsilonDeltaEvent` and :class:`~accountants.events.NfdpSubsampleEvent`,
known only through an (epsilon, delta) pair; NFDP as its exact ``(0, delta)``).  With ``D_f`` the
sum of the fixed deltas and ``delta`` the target, the free budget is ``delta - D_f`` (epsilon is
``inf`` when it is negative).

- ``rdp`` / ``pld``: the tight parts of all entries are composed by dp-accounting's RDP or PLD
  accountant, which gets the whole free delta; the fixed parts add by basic composition.  Applies
  when every DpEvent is supported by that accountant (PLD does not support sampling without
  replacement; RDP does not support e.g. Poisson under replace-one).  PLD is pessimistic
  (an upper bound) with ``value_discretization_interval`` = :data:`~accountants.dpsgd.PLD_VDI`.
- ``basic``: each entry's tight part is one mechanism, accounted on its own (minimum of RDP and
  PLD, where supported) at an equal share of the free delta; all entries add by basic composition.
  Applies to every ledger whose DpEvents RDP or PLD can each handle.
- ``advanced``: as ``basic`` but combined by heterogeneous advanced composition (KOV 2015) with half
  of the free delta as its slack and the other half shared by the tight parts.  Useful for many
  small entries.
- ``best``: the minimum over those of the four that apply; each is a sound upper bound.

A :class:`~accountants.events.NonPrivateEvent` (or dp-accounting's ``NonPrivateDpEvent``) makes
every accountant report ``epsilon = inf`` (``delta = 1``).  An event no accountant can handle
raises :class:`UnsupportedEventError` (a ``ValueError``) naming the event and its label; nothing
is skipped.  Entries of one client must share one neighbouring relation (guarantees under
add/remove-one and replace-one are not composed with each other).
"""

from __future__ import annotations

import json
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dp_accounting as dpa

import atomicfiles
from accountants._validate import check_choice, check_nonnegative, check_open_unit, check_positive
from accountants.bracket import LOWER_VDI, METHOD, OptimisticPldAccountant, check_ordered
from accountants.composition import advanced_composition, basic_composition
from accountants.dpsgd import NEIGHBOURINGS, PLD_VDI, neighbouring_relation, new_accountant
from accountants.events import (
    PRIVKIT_EVENTS,
    EpsilonDeltaEvent,
    NfdpSubsampleEvent,
    NonPrivateEvent,
    describe_event,
    event_from_dict,
    event_to_dict,
)
from accountants.fast import PldGridError

__all__ = [
    "ACCOUNTANTS",
    "NOT_FOR_RELEASE",
    "SCHEMA_VERSION",
    "Accounting",
    "Ledger",
    "LedgerEntry",
    "UnsupportedEventError",
]

SCHEMA_VERSION = 1
"""Version of the ``ledger.json`` format written by :meth:`Ledger.save`."""
CURVE_VDI = 1e-3
NOT_FOR_RELEASE = "reproducible noise: not for release"
"""The label of a ledger (and a run) whose DP noise was derived from the run seed."""
ACCOUNTANTS = ("basic", "advanced", "rdp", "pld")
"""The accountants a :class:`Ledger` walks (``"best"`` is the minimum over the applicable ones)."""
_ALL_CHOICES = ACCOUNTANTS + ("best",)
LOWER = "pld-lower"  # internal accountant kind: the optimistic PLD of accountants.bracket
# why an accountant's epsilon has no bracket: it is an upper bound by construction, not a tight
# estimate with a discretisation error around the exact value
NOT_TIGHT = "not-tight"


class UnsupportedEventError(ValueError):
    """An accountant cannot handle an event of the ledger (message names the event and label)."""


class _GridTooLarge(UnsupportedEventError):
    """The PLD of an event would need a grid past :data:`~accountants.fast.MAX_PLD_POINTS`."""


@dataclass(frozen=True)
class LedgerEntry:
    """One privacy event that touched a client's data."""

    label: str
    event: dpa.DpEvent
    round: int | None = None
    neighbouring: str = "add_remove"


@dataclass(frozen=True)
class Accounting:
    """An epsilon (or delta) with the delta split it rests on.

    ``fixed_epsilon``/``fixed_delta`` are the basic-composition sums of the (epsilon, delta)-only
    events; ``tight_delta`` is the delta given to the DpEvents (``None`` when there are none).
    """

    epsilon: float
    delta: float
    accountant: str
    client: str | None
    neighbouring: str | None
    fixed_epsilon: float
    fixed_delta: float
    tight_delta: float | None
    note: str = ""


# ----------------------------------------------------------------------------- event splitting


@dataclass
class _Split:
    """A client's entries split into what each accountant needs."""

    fixed: list[tuple[float, float, str]] = field(default_factory=list)  # (eps, delta, label)
    units: list[tuple[dpa.DpEvent, str]] = field(default_factory=list)  # tight part per entry
    nonprivate: list[str] = field(default_factory=list)
    neighbouring: str | None = None

    @property
    def fixed_epsilon(self) -> float:
        return math.fsum(e for e, _, _ in self.fixed)

    @property
    def fixed_delta(self) -> float:
        return math.fsum(d for _, d, _ in self.fixed)


def _contains_privkit(event: dpa.DpEvent) -> bool:
    if isinstance(event, PRIVKIT_EVENTS):
        return True
    if isinstance(event, dpa.ComposedDpEvent):
        return any(_contains_privkit(e) for e in event.events)
    if isinstance(event, dpa.SelfComposedDpEvent):
        return _contains_privkit(event.event)
    return False


def _nested_privkit(event: Any) -> dpa.DpEvent | None:
    """A privkit event hidden below a non-composition node (which no accountant can handle)."""
    import attr

    if isinstance(event, PRIVKIT_EVENTS):
        return event
    if isinstance(event, dpa.DpEvent) and attr.has(type(event)):
        for f in attr.fields(type(event)):
            value = getattr(event, f.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if isinstance(v, dpa.DpEvent):
                    found = _nested_privkit(v)
                    if found is not None:
                        return found
    return None


def _flatten(event: dpa.DpEvent, count: int, label: str, split: _Split, tight: list) -> None:
    if isinstance(event, NonPrivateEvent):
        split.nonprivate.append(f"{label}: {event.reason}")
    elif isinstance(event, (EpsilonDeltaEvent, NfdpSubsampleEvent)):
        eps, delta = event.epsilon_delta
        split.fixed.extend([(eps, delta, label)] * count)
    elif isinstance(event, dpa.ComposedDpEvent) and _contains_privkit(event):
        for e in event.events:
            _flatten(e, count, label, split, tight)
    elif isinstance(event, dpa.SelfComposedDpEvent) and _contains_privkit(event):
        _flatten(event.event, count * event.count, label, split, tight)
    else:
        hidden = _nested_privkit(event)
        if hidden is not None:
            raise UnsupportedEventError(
                f"event {describe_event(hidden)} (label {label!r}) is nested inside "
                f"{type(event).__name__}; privkit events may only appear under "
                "ComposedDpEvent/SelfComposedDpEvent"
            )
        tight.append(dpa.SelfComposedDpEvent(event, count) if count > 1 else event)


def _split(entries: Sequence[LedgerEntry], client: str | None) -> _Split:
    split = _Split()
    relations = {e.neighbouring for e in entries}
    if len(relations) > 1:
        raise ValueError(
            f"client {client!r} mixes neighbouring relations {sorted(relations)}; privkit does not "
            "compose guarantees across neighbouring relations"
        )
    split.neighbouring = next(iter(relations)) if relations else None
    for entry in entries:
        tight: list[dpa.DpEvent] = []
        _flatten(entry.event, 1, entry.label, split, tight)
        if tight:
            unit = tight[0] if len(tight) == 1 else dpa.ComposedDpEvent(tight)
            split.units.append((unit, entry.label))
    return split


# ----------------------------------------------------------------------------- tight accounting

_CACHE: OrderedDict[tuple, dpa.PrivacyAccountant] = OrderedDict()
_CACHE_SIZE = 256
#: each cached accountant's answers (:func:`_ask`), dropped with the accountant
_ANSWERS: weakref.WeakKeyDictionary[dpa.PrivacyAccountant, dict[tuple, float]] = (
    weakref.WeakKeyDictionary()
)


def _ask(acc: dpa.PrivacyAccountant, method: str, *args: Any) -> float:
    """``acc.<method>(*args)`` as a float (``raw_epsilon`` where the accountant has none:
    ``get_epsilon``), remembered with the accountant for these (hashable) arguments. A composition
    from :func:`_composed` is shared by every client whose entries are the same events, and each
    of them asks it the same questions: DP-SGD's 20 clients, whose ledgers are one event each,
    asked a certified PLD epsilon 20 times (1.0 s of a ``privkit train``'s summary), and a DP
    head's 19 equal clients the optimistic PLD's lower end 19 times (7 s of its account stage).
    Never call it on an accountant that is composed further afterwards (:func:`_composed`'s are
    not)."""
    answers = _ANSWERS.setdefault(acc, {})
    key = (method, *args)
    if key not in answers:
        answers[key] = float(getattr(acc, method, acc.get_epsilon)(*args))
    return answers[key]


def _group(events: Iterable[dpa.DpEvent]) -> list[dpa.DpEvent]:
    """Identical events -> one SelfComposedDpEvent each (composition is order-free; PLD self-composes fast)."""
    counts: dict[str, list] = {}
    for ev in events:
        key = repr(ev)
        if key in counts:
            counts[key][1] += 1
        else:
            counts[key] = [ev, 1]
    return [ev if n == 1 else dpa.SelfComposedDpEvent(ev, n) for ev, n in counts.values()]


def _pure_gaussian(event: dpa.DpEvent) -> bool:
    """True for Gaussian events without subsampling (Gaussian, composed or self-composed)."""
    if isinstance(event, dpa.GaussianDpEvent):
        return True
    if isinstance(event, dpa.SelfComposedDpEvent):
        return _pure_gaussian(event.event)
    if isinstance(event, dpa.ComposedDpEvent):
        return all(_pure_gaussian(e) for e in event.events)
    return False


def _effective_relation(relation: str, events: Iterable[dpa.DpEvent]) -> str:
    """The relation to hand to dp-accounting.

    privkit reads a Gaussian's ``noise_multiplier`` as std / sensitivity *under the entry's own
    neighbouring relation*.  For unsampled Gaussians the relation then changes nothing, but
    dp-accounting's PLD reads replace-one as a doubled sensitivity (its RDP does not), so such
    events are accounted with dp-accounting's add/remove computation, which is exact for them.
    """
    if relation == "replace_one" and all(_pure_gaussian(e) for e in events):
        return "add_remove"
    return relation


def _new_accountant(kind: str, relation: str, vdi: float) -> dpa.PrivacyAccountant:
    if kind == LOWER:  # the optimistic PLD: a certified lower bound on the exact epsilon
        return OptimisticPldAccountant(neighbouring_relation(relation), min(vdi, LOWER_VDI))
    return new_accountant(kind, relation, vdi)


def _check_supported(
    acc: dpa.PrivacyAccountant, kind: str, units: Sequence[tuple[dpa.DpEvent, str]], relation: str
) -> None:
    for ev, label in units:
        if not acc.supports(ev):
            raise UnsupportedEventError(
                f"accountant {kind!r} cannot handle event {describe_event(ev)} (label {label!r}, "
                f"neighbouring {relation})"
            )


def _composed(
    kind: str, units: Sequence[tuple[dpa.DpEvent, str]], relation: str, vdi: float
) -> dpa.PrivacyAccountant:
    """A (cached) dp-accounting accountant with all ``units`` composed."""
    grouped = _group(ev for ev, _ in units)
    relation = _effective_relation(relation, grouped)
    key = (kind, relation, vdi, tuple(repr(e) for e in grouped))
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    acc = _new_accountant(kind, relation, vdi)
    _check_supported(acc, kind, units, relation)
    for ev in grouped:
        _compose_or_say(acc, kind, ev, units)
    _CACHE[key] = acc
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return acc


def _compose_or_say(
    acc: dpa.PrivacyAccountant,
    kind: str,
    event: dpa.DpEvent,
    units: Sequence[tuple[dpa.DpEvent, str]],
) -> None:
    """``acc.compose(event)``; a PLD grid past its limit makes the accountant not applicable (the
    others, RDP first, still answer), with the labels of the entries it came from."""
    try:
        acc.compose(event)
    except PldGridError as exc:
        labels = sorted({label for _, label in units})
        raise _GridTooLarge(
            f"accountant {kind!r} cannot account {describe_event(event)} (labels {labels}): {exc}"
        ) from None


#: basic and advanced composition query each entry alone; past this many entries they ask RDP
#: only (a sound per-entry bound in milliseconds), where the certified PLD costs about a second per
#: entry and the tight accountants' composition answers tighter anyway
PLD_UNITS = 4


def _unit_query(
    unit: tuple[dpa.DpEvent, str],
    relation: str,
    vdi: float,
    query: tuple[str, float],
    kinds: tuple[str, ...] = ("rdp", "pld"),
) -> float:
    """Min over ``kinds`` (RDP and PLD, where supported) of ``query`` on one mechanism:
    ``(method, argument)`` of its accountant, asked by :func:`_ask`."""
    values = []
    for kind in kinds:
        try:
            acc = _composed(kind, [unit], relation, vdi)
        except UnsupportedEventError:
            continue
        try:
            values.append(_ask(acc, *query))
        except PldGridError:  # no certified PLD value here: RDP's stands
            continue
    if not values:
        ev, label = unit
        raise UnsupportedEventError(
            f"no accountant (rdp, pld) can handle event {describe_event(ev)} (label {label!r}, "
            f"neighbouring {relation})"
        )
    return min(values)


def _unit_kinds(units: int) -> tuple[str, ...]:
    return ("rdp", "pld") if units <= PLD_UNITS else ("rdp",)


# ----------------------------------------------------------------------------- accountants


def _eps_with(
    split: _Split, delta: float, tight_eps: Callable[[float], float]
) -> tuple[float, float | None]:
    """Fixed part by basic composition + the tight part at the whole free delta."""
    if split.nonprivate:
        return math.inf, None
    free, m = delta - split.fixed_delta, len(split.units)
    if free < 0 or (free == 0 and m > 0):
        return math.inf, None
    if m == 0:
        return split.fixed_epsilon, None
    return split.fixed_epsilon + tight_eps(free), free


def _eps_for(
    split: _Split, delta: float, kind: str, vdi: float, estimate: bool = False
) -> tuple[float, float | None, str]:
    """(epsilon, tight delta, note) for one client's split.  ``estimate`` (basic and advanced
    only) takes each entry's plain PLD epsilon, not the certified one: milliseconds instead of a
    second per entry, and not an upper bound; :meth:`Ledger._account_one` uses it only to skip a
    composition that cannot be the smallest."""
    rel = split.neighbouring or "add_remove"
    if split.nonprivate:
        return math.inf, None, "non-private release: " + "; ".join(split.nonprivate)
    fixed_eps, free = split.fixed_epsilon, delta - split.fixed_delta
    m = len(split.units)
    if free < 0 or (free == 0 and m > 0):
        return (
            math.inf,
            None,
            f"the (epsilon, delta)-only events alone use delta={split.fixed_delta:.6g} > target",
        )
    if m == 0 and kind != "advanced":
        return fixed_eps, None, "basic composition of (epsilon, delta)-only events"
    if kind in ("rdp", "pld"):
        acc = _composed(kind, split.units, rel, vdi)
        try:
            eps, tight_delta = _eps_with(split, delta, lambda d: _ask(acc, "get_epsilon", d))
        except PldGridError as exc:  # no certified PLD epsilon: the accountant does not apply
            labels = sorted({label for _, label in split.units})
            raise _GridTooLarge(f"accountant {kind!r} (labels {labels}): {exc}") from None
        return eps, tight_delta, f"{kind} on DpEvents + basic on the rest"

    def at(d: float) -> tuple[str, float]:
        return ("raw_epsilon" if estimate else "get_epsilon", d)

    if kind == "basic":
        share = free / m
        eps = fixed_eps + math.fsum(
            _unit_query(u, rel, vdi, at(share), _unit_kinds(m)) for u in split.units
        )
        return eps, free, f"basic composition; each of {m} DpEvent entries at delta={share:.6g}"
    # advanced
    params = [(e, d) for e, d, _ in split.fixed]
    if free == 0:
        return basic_composition(params)[0], None, "basic composition (no delta left for slack)"
    slack = free / 2 if m else free
    share = free / (2 * m) if m else 0.0
    for u in split.units:
        params.append((_unit_query(u, rel, vdi, at(share), _unit_kinds(m)), share))
    eps, _ = advanced_composition(params, slack)
    return (
        eps,
        (free - slack) if m else None,
        f"advanced composition (KOV), slack delta={slack:.6g}",
    )


def _split_info(split: _Split, delta: float) -> dict[str, Any]:
    """One client's ``delta_split`` row (:meth:`Ledger.summary`)."""
    return {
        "fixed_epsilon": split.fixed_epsilon,
        "fixed_delta": split.fixed_delta,
        "free_delta": delta - split.fixed_delta,
        "dp_event_entries": len(split.units),
        "non_private": list(split.nonprivate),
    }


def _lower_end(split: _Split, delta: float, vdi: float) -> float:
    """Certified lower bound on the exact epsilon of one client's composition at ``delta`` (see
    :meth:`Ledger.pld_bracket`)."""
    if split.nonprivate:
        return math.inf
    low = _composed(LOWER, split.units, split.neighbouring or "add_remove", vdi)
    return _ask(low, "epsilon_with_fixed", delta, tuple((e, d) for e, d, _ in split.fixed))


def _delta_for(split: _Split, epsilon: float, kind: str, vdi: float) -> float:
    rel = split.neighbouring or "add_remove"
    if split.nonprivate:
        return 1.0
    free_eps = epsilon - split.fixed_epsilon
    m = len(split.units)
    if free_eps < 0:
        return 1.0
    if m == 0:
        return min(1.0, split.fixed_delta)
    if kind in ("rdp", "pld"):
        acc = _composed(kind, split.units, rel, vdi)
        return min(1.0, split.fixed_delta + _ask(acc, "get_delta", free_eps))
    if kind == "basic":
        share = free_eps / m
        tight = math.fsum(
            _unit_query(u, rel, vdi, ("get_delta", share), _unit_kinds(len(split.units)))
            for u in split.units
        )
        return min(1.0, split.fixed_delta + tight)
    return _delta_by_search(lambda d: _eps_for(split, d, "advanced", vdi)[0], epsilon)


def _delta_by_search(eps_of_delta: Callable[[float], float], epsilon: float) -> float:
    """Smallest delta (to 1e-3 relative, from above) with ``eps_of_delta(delta) <= epsilon``."""
    hi = 1.0 - 1e-12
    if eps_of_delta(hi) > epsilon:
        return 1.0
    lo = 1e-300
    if eps_of_delta(lo) <= epsilon:
        return lo
    llo, lhi = math.log(lo), math.log(hi)
    while lhi - llo > 1e-3:
        mid = 0.5 * (llo + lhi)
        if eps_of_delta(math.exp(mid)) <= epsilon:
            lhi = mid
        else:
            llo = mid
    return math.exp(lhi)


_NOISE_FIELDS = ("noise_multiplier", "standard_deviation")


def _check_noise(event: dpa.DpEvent, label: str) -> None:
    """A noise scale must be a finite number: NaN or inf (a clipping norm of 0 divided into the
    noise, say) would otherwise surface later as an unrelated float error, far from the entry."""
    import attr

    if not attr.has(type(event)):
        return
    for f in attr.fields(type(event)):
        value = getattr(event, f.name)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, dpa.DpEvent):
                _check_noise(v, label)
            elif f.name in _NOISE_FIELDS and isinstance(v, float) and not math.isfinite(v):
                raise ValueError(
                    f"{type(event).__name__}.{f.name} must be a finite number; found {v!r} "
                    f"(label {label!r})"
                )


# ----------------------------------------------------------------------------- the ledger


class Ledger:
    """Client id -> labelled privacy events; answers epsilon/delta per client and worst client.

    Parameters
    ----------
    value_discretization_interval : float
        PLD grid for point queries (:meth:`epsilon`, :meth:`delta`, :meth:`summary`); 1e-4 by
        default (about 0.3 s per distinct subsampled event; the PLD result is an upper bound).
    curve_value_discretization_interval : float
        PLD grid for :meth:`epsilon_over_rounds`, which composes round by round; 1e-3 by
        default (10x faster, still a pessimistic upper bound, about 0.1-0.4% looser on DP-SGD).
    """

    def __init__(
        self,
        value_discretization_interval: float = PLD_VDI,
        curve_value_discretization_interval: float = CURVE_VDI,
    ) -> None:
        self._entries: dict[str, list[LedgerEntry]] = {}
        self.value_discretization_interval = check_positive(
            value_discretization_interval, "value_discretization_interval"
        )
        self.curve_value_discretization_interval = check_positive(
            curve_value_discretization_interval, "curve_value_discretization_interval"
        )
        self._curves: dict[tuple, list[float]] = {}
        # True when the trainer drew its DP noise from a seeded (reproducible) generator: anyone who
        # holds the seed can regenerate the noise, so the guarantees do not hold for a release.
        self.reproducible_noise = False
        # A guarantee covering adaptively chosen parameters (e.g. a Rényi filter's to_dict()): the
        # composition of the recorded events alone assumes their parameters were fixed in advance.
        self.adaptive: dict[str, Any] | None = None

    # -- building -------------------------------------------------------------------------
    def add(
        self,
        client: str | int,
        event: dpa.DpEvent,
        label: str,
        round: int | None = None,
        neighbouring: str = "add_remove",
    ) -> LedgerEntry:
        """Record that ``event`` touched ``client``'s data.

        Parameters
        ----------
        client : str or int
            Client id (ints are converted to str).
        event : dp_accounting.DpEvent
            A dp-accounting event or a privkit event.
        label : str
            Which step of the method this is, e.g. "scores", "round 3: dp-sgd".
        round : int, optional
            Communication round (for :meth:`epsilon_over_rounds`).
        neighbouring : {"add_remove", "replace_one"}
            The neighbouring relation the event's parameters assume (e.g. the logistic-regression
            sensitivities are for replace-one).
        """
        if isinstance(client, bool) or not isinstance(client, (str, int)):
            raise ValueError(f"client must be a str or int id; found {client!r}")
        if not isinstance(event, dpa.DpEvent):
            raise ValueError(
                f"event must be a dp_accounting DpEvent or privkit event; found {event!r}"
            )
        if not isinstance(label, str) or not label:
            raise ValueError(f"label must be a non-empty string; found {label!r}")
        if round is not None and (
            isinstance(round, bool) or not isinstance(round, int) or round < 0
        ):
            raise ValueError(f"round must be a non-negative int or None; found {round!r}")
        check_choice(neighbouring, "neighbouring", NEIGHBOURINGS)
        _check_noise(event, label)
        entry = LedgerEntry(label=label, event=event, round=round, neighbouring=neighbouring)
        self._entries.setdefault(str(client), []).append(entry)
        return entry

    @property
    def clients(self) -> list[str]:
        """Client ids, in order of first appearance."""
        return list(self._entries)

    def entries(self, client: str | int) -> list[LedgerEntry]:
        """The entries recorded for ``client``."""
        return list(self._entries[self._client(client)])

    def labels(self) -> list[str]:
        """All labels used, in order of first appearance."""
        seen: dict[str, None] = {}
        for entries in self._entries.values():
            for e in entries:
                seen.setdefault(e.label, None)
        return list(seen)

    def _client(self, client: str | int) -> str:
        key = str(client)
        if key not in self._entries:
            raise ValueError(f"client must be one of {self.clients}; found {client!r}")
        return key

    def _selected(
        self, client: str | int | None, labels: Iterable[str] | None
    ) -> dict[str, list[LedgerEntry]]:
        if not self._entries:
            raise ValueError("the ledger is empty: no events were recorded")
        keys = [self._client(client)] if client is not None else self.clients
        wanted = None if labels is None else set([labels] if isinstance(labels, str) else labels)
        out = {
            k: [e for e in self._entries[k] if wanted is None or e.label in wanted] for k in keys
        }
        if wanted is not None and not any(out.values()):
            raise ValueError(
                f"labels must name recorded entries {self.labels()}; found {sorted(wanted)}"
            )
        return out

    # -- querying -------------------------------------------------------------------------
    def account(
        self,
        delta: float,
        client: str | int | None = None,
        accountant: str = "best",
        labels: Iterable[str] | None = None,
    ) -> Accounting:
        """Epsilon at ``delta`` with the delta split it used (worst client when ``client`` is None)."""
        delta = check_open_unit(delta, "delta")
        check_choice(accountant, "accountant", _ALL_CHOICES)
        selected = self._selected(client, labels)
        if accountant == "best" and len(selected) > 1:
            return self._worst_best(selected, delta)
        results = [
            self._account_one(k, entries, delta, accountant) for k, entries in selected.items()
        ]
        return max(results, key=lambda r: r.epsilon)

    def _worst_best(self, selected: dict[str, list[LedgerEntry]], delta: float) -> Accounting:
        """The worst client under the best accountant, the clients' best taken in decreasing
        order of their RDP epsilon and stopped where the rest's is below the worst found: a
        client's best is at most its RDP epsilon (the same number, among those it minimises), so
        a client left out cannot be the worst, nor tie with it. The same result as every client's
        best (the first of equal ones in client order), without the certified PLD epsilons (tens
        of milliseconds each) of clients that cannot be the worst."""
        ceiling: dict[str, float] = {}
        for key, entries in selected.items():
            try:
                ceiling[key] = self._account_one(key, entries, delta, "rdp").epsilon
            except ValueError:  # no RDP epsilon: no ceiling (the best accountant says why, if any)
                ceiling[key] = math.inf
        place = {key: at for at, key in enumerate(selected)}
        worst: Accounting | None = None
        for key in sorted(selected, key=lambda k: -ceiling[k]):
            if worst is not None and ceiling[key] < worst.epsilon:
                break  # every client left has a lower ceiling
            res = self._account_one(key, selected[key], delta, "best")
            if (
                worst is None
                or res.epsilon > worst.epsilon
                or (res.epsilon == worst.epsilon and place[key] < place[str(worst.client)])
            ):
                worst = res
        assert worst is not None
        return worst

    def _account_one(
        self, key: str, entries: list[LedgerEntry], delta: float, accountant: str
    ) -> Accounting:
        split = _split(entries, key)
        kinds: tuple[str, ...] = ACCOUNTANTS if accountant == "best" else (accountant,)
        if accountant == "best":  # the tight accountants first: they usually give the minimum
            kinds = tuple(sorted(kinds, key=lambda k: k not in ("rdp", "pld")))
        vdi = self.value_discretization_interval
        best: Accounting | None = None
        first_error: UnsupportedEventError | None = None
        for kind in kinds:
            if best is not None and kind in ("basic", "advanced"):
                # a composition of the entries' certified epsilons is at least about that of
                # their plain ones: where the plain ones already lose to the best so far, the
                # certified ones (seconds per entry) cannot win, and leaving out a candidate of a
                # minimum of upper bounds leaves an upper bound
                try:
                    rough = _eps_for(split, delta, kind, vdi, estimate=True)[0]
                except (UnsupportedEventError, PldGridError):
                    rough = -math.inf
                if rough > best.epsilon * (1 + 1e-6):
                    continue
            try:
                eps, tight_delta, note = _eps_for(split, delta, kind, vdi)
            except UnsupportedEventError as exc:
                if accountant != "best":
                    raise
                first_error = first_error or exc
                continue
            res = Accounting(
                epsilon=eps,
                delta=delta,
                accountant=kind,
                client=key,
                neighbouring=split.neighbouring,
                fixed_epsilon=split.fixed_epsilon,
                fixed_delta=split.fixed_delta,
                tight_delta=tight_delta,
                note=note,
            )
            if best is None or res.epsilon < best.epsilon:
                best = res
        if best is None:
            assert first_error is not None
            raise first_error
        return best

    def epsilon(
        self,
        delta: float,
        client: str | int | None = None,
        accountant: str = "best",
        labels: Iterable[str] | None = None,
    ) -> float:
        """Epsilon at ``delta`` for ``client`` (None: the worst client) under ``accountant``.

        Parameters
        ----------
        delta : float
            Target delta in (0, 1).
        client : str or int, optional
            A client id; None takes the maximum over clients.
        accountant : {"best", "basic", "advanced", "rdp", "pld"}
            See the module docstring.  ``best`` is the minimum over the applicable accountants.
        labels : iterable of str, optional
            Only entries with these labels (e.g. FedAUX's "scores" part on its own).
        """
        return self.account(delta, client, accountant, labels).epsilon

    def delta(
        self,
        epsilon: float,
        client: str | int | None = None,
        accountant: str = "best",
        labels: Iterable[str] | None = None,
    ) -> float:
        """Delta at ``epsilon`` (worst client when ``client`` is None)."""
        epsilon = check_nonnegative(epsilon, "epsilon")
        check_choice(accountant, "accountant", _ALL_CHOICES)
        worst = 0.0
        for key, entries in self._selected(client, labels).items():
            split = _split(entries, key)
            kinds = ACCOUNTANTS if accountant == "best" else (accountant,)
            values, error = [], None
            for kind in kinds:
                try:
                    values.append(
                        _delta_for(split, epsilon, kind, self.value_discretization_interval)
                    )
                except UnsupportedEventError as exc:
                    if accountant != "best":
                        raise
                    error = error or exc
            if not values:
                raise error  # type: ignore[misc]
            worst = max(worst, min(values))
        return worst

    def summary(
        self,
        delta: float,
        labels: Iterable[str] | None = None,
        accountants: Iterable[str] | None = None,
    ) -> dict[str, Any]:
        """Epsilon at ``delta`` per client and for the worst client, under every applicable accountant.

        ``accountants`` restricts the computation to some of ``basic, advanced, rdp, pld`` (default:
        all); ``best`` is then the minimum over those only. Useful on long ledgers, where basic and
        advanced composition query every entry separately.

        Returns
        -------
        dict
            ``{"schema_version", "delta", "clients": {id: {acct: eps}}, "worst": {acct: eps},
            "worst_client": {acct: id}, "not_applicable": {acct: reason}, "neighbouring": {id: rel},
            "delta_split": {id: {...}}, "accountants": {acct: description}}``.  An accountant
            appears under ``worst`` only if it applies to every client.
        """
        delta = check_open_unit(delta, "delta")
        kinds = tuple(accountants) if accountants is not None else ACCOUNTANTS
        unknown = [k for k in kinds if k not in ACCOUNTANTS]
        if unknown or not kinds:
            raise ValueError(
                f"accountants must be a non-empty subset of {', '.join(ACCOUNTANTS)}; "
                f"found {list(kinds)}"
            )
        clients: dict[str, dict[str, float]] = {}
        not_applicable: dict[str, str] = {}
        neighbouring: dict[str, str | None] = {}
        split_info: dict[str, dict[str, Any]] = {}
        for key, entries in self._selected(None, labels).items():
            row: dict[str, float] = {}
            split = _split(entries, key)
            for kind in kinds:
                try:
                    eps, _, _ = _eps_for(split, delta, kind, self.value_discretization_interval)
                except UnsupportedEventError as exc:
                    not_applicable.setdefault(kind, str(exc))
                    continue
                row[kind] = eps
            if not row:
                raise UnsupportedEventError(
                    not_applicable.get(kinds[0], f"no accountant applies to client {key!r}")
                )
            row["best"] = min(row.values())
            clients[key] = row
            neighbouring[key] = split.neighbouring
            split_info[key] = _split_info(split, delta)
        worst: dict[str, float] = {}
        worst_client: dict[str, str] = {}
        for kind in kinds + ("best",):
            if all(kind in row for row in clients.values()):
                key = max(clients, key=lambda k: clients[k][kind])
                worst[kind], worst_client[kind] = clients[key][kind], key
        return {
            "schema_version": SCHEMA_VERSION,
            **self.noise_stamp(),
            "delta": delta,
            "clients": clients,
            "worst": worst,
            "worst_client": worst_client,
            "not_applicable": not_applicable,
            "neighbouring": neighbouring,
            "delta_split": split_info,
            "accountants": _ACCOUNTANT_NOTES,
        }

    def delta_split(
        self, delta: float, labels: Iterable[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Per client, how ``delta`` splits between the (epsilon, delta)-only events and the
        DpEvents, and its non-private releases: :meth:`summary`'s ``delta_split``, without
        accounting anything (what a headline needs beside :meth:`account`'s epsilon)."""
        delta = check_open_unit(delta, "delta")
        return {
            key: _split_info(_split(entries, key), delta)
            for key, entries in self._selected(None, labels).items()
        }

    def pld_bracket(
        self, delta: float, labels: Iterable[str] | None = None, *, worst_only: bool = False
    ) -> dict[str, Any]:
        """Certified ``[lower, upper]`` around the ``pld`` accountant's epsilon, per client and worst.

        ``upper`` is the ``pld`` epsilon :meth:`summary` reports.  ``lower`` is a lower bound on the
        exact epsilon of the client's composition: the optimistic PLD of its DpEvents
        (:mod:`accountants.bracket`) composed with each (epsilon, delta)-only event taken at its
        worst, randomised response with mass delta at infinity (NFDP's exact (0, delta) is that
        with epsilon 0), at the whole delta.  The ``pld`` accountant adds those events by basic
        composition instead, a looser upper bound: the exact value lies between, and the gap
        shows what basic composition costs.  Returns ``{"clients": {id: {"lower", "upper"}},
        "worst": {...}, "grid", "lower_grid", "method"}``; raises :class:`UnsupportedEventError`
        naming an event with no optimistic PLD, ``ValueError`` when a grid would be too large or
        the ends come out of order (float arithmetic at an extreme size).

        ``worst_only=True`` brackets only the client(s) with the largest upper end (a lower end
        costs seconds per client).  Its ``worst.lower`` is still a lower bound on the worst
        client's exact epsilon, which is at least that client's exact epsilon; it can be below the
        largest lower end over all clients only where another client's lower end is larger.
        """
        delta = check_open_unit(delta, "delta")
        vdi = self.value_discretization_interval
        splits = {
            key: _split(entries, key) for key, entries in self._selected(None, labels).items()
        }
        uppers = {key: _eps_for(split, delta, "pld", vdi)[0] for key, split in splits.items()}
        top = max(uppers.values(), default=0.0)
        clients = {}
        for key, split in splits.items():
            upper = uppers[key]
            if worst_only and upper < top:
                continue
            lower = _lower_end(split, delta, vdi)
            try:
                check_ordered(lower, upper)
            except ValueError as exc:
                raise ValueError(f"client {key!r}: {exc}") from None
            clients[key] = {"lower": lower, "upper": upper}
        return {
            "clients": clients,
            "worst": {end: max(c[end] for c in clients.values()) for end in ("lower", "upper")},
            "grid": vdi,
            "lower_grid": min(vdi, LOWER_VDI),
            "method": METHOD
            + (
                "; (epsilon, delta)-only events: basic composition at the upper end, at their "
                "worst (randomised response) in the composition at the lower end"
            ),
        }

    def brackets(
        self,
        delta: float,
        labels: Iterable[str] | None = None,
        accountants: Iterable[str] = ACCOUNTANTS,
        *,
        worst_only: bool = False,
    ) -> dict[str, Any]:
        """``{"epsilon_bracket": {acct: bracket or None}, "bracket_reason": {acct: why None}}`` for
        ``accountants``: :meth:`pld_bracket` for ``pld``; the others are upper bounds by
        construction (``"not-tight"``), and ``pld`` on an event without an optimistic PLD says so."""
        brackets: dict[str, Any] = {}
        reasons: dict[str, str] = {}
        for kind in accountants:
            brackets[kind] = None
            if kind != "pld":
                reasons[kind] = NOT_TIGHT
                continue
            try:
                brackets[kind] = self.pld_bracket(delta, labels, worst_only=worst_only)
            except _GridTooLarge as exc:
                reasons[kind] = f"no certified bracket: {exc}"
            except UnsupportedEventError as exc:
                reasons[kind] = f"unsupported: {exc}"
            except ValueError as exc:  # a grid past its limit; ends out of order
                reasons[kind] = str(exc)
        return {"epsilon_bracket": brackets, "bracket_reason": reasons}

    def epsilon_over_rounds(
        self, delta: float, accountant: str = "best", client: str | int | None = None
    ) -> list[tuple[int, float]]:
        """Epsilon at ``delta`` after each round (entries without a round count from the start).

        Returns
        -------
        list of (round, epsilon)
            One pair per distinct recorded round, ascending; the worst client when ``client`` is None.
        """
        delta = check_open_unit(delta, "delta")
        check_choice(accountant, "accountant", _ALL_CHOICES)
        selected = self._selected(client, None)
        rounds = sorted({e.round for es in selected.values() for e in es if e.round is not None})
        if not rounds:
            return []
        kinds = ACCOUNTANTS if accountant == "best" else (accountant,)
        per_client = []
        for key, entries in selected.items():
            curves, error = [], None
            for kind in kinds:
                try:
                    curves.append(self._curve(key, entries, delta, kind, rounds))
                except UnsupportedEventError as exc:
                    if accountant != "best":
                        raise
                    error = error or exc
            if not curves:
                raise error  # type: ignore[misc]
            per_client.append([min(vals) for vals in zip(*curves)])
        return [(r, max(vals)) for r, vals in zip(rounds, zip(*per_client))]

    def _curve(
        self, key: str, entries: list[LedgerEntry], delta: float, kind: str, rounds: list[int]
    ) -> list[float]:
        """Epsilon after each round for one client and accountant (memoised: clients often share histories)."""
        memo = (
            kind,
            delta,
            tuple(rounds),
            tuple((repr(e.event), e.round, e.neighbouring) for e in entries),
        )
        if memo not in self._curves:
            self._curves[memo] = self._compute_curve(key, entries, delta, kind, rounds)
        return self._curves[memo]

    def _compute_curve(
        self, key: str, entries: list[LedgerEntry], delta: float, kind: str, rounds: list[int]
    ) -> list[float]:
        vdi = self.curve_value_discretization_interval
        if kind not in ("rdp", "pld"):
            out = []
            for r in rounds:
                prefix = [e for e in entries if e.round is None or e.round <= r]
                out.append(_eps_for(_split(prefix, key), delta, kind, vdi)[0] if prefix else 0.0)
            return out
        # RDP/PLD: compose incrementally, one round at a time, into a single accountant.
        full = _split(entries, key)
        rel = _effective_relation(full.neighbouring or "add_remove", [u for u, _ in full.units])
        acc = _new_accountant(kind, rel, vdi)
        _check_supported(acc, kind, full.units, rel)
        cumulative = _Split(neighbouring=full.neighbouring)
        out, previous = [], None
        for r in rounds:
            new = [
                e
                for e in entries
                if (e.round is None and previous is None)
                or (
                    e.round is not None
                    and (previous is None or e.round > previous)
                    and e.round <= r
                )
            ]
            part = _split(new, key)
            for ev in _group(u for u, _ in part.units):
                _compose_or_say(acc, kind, ev, part.units)
            cumulative.fixed += part.fixed
            cumulative.units += part.units
            cumulative.nonprivate += part.nonprivate
            previous = r
            out.append(_eps_with(cumulative, delta, lambda d: float(acc.get_epsilon(d)))[0])
        return out

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with ``schema_version``; events via :func:`~accountants.events.event_to_dict`."""
        return {
            "schema_version": SCHEMA_VERSION,
            **self.noise_stamp(),
            "value_discretization_interval": self.value_discretization_interval,
            "curve_value_discretization_interval": self.curve_value_discretization_interval,
            "clients": {
                key: [
                    {
                        "label": e.label,
                        "round": e.round,
                        "neighbouring": e.neighbouring,
                        "event": event_to_dict(e.event),
                    }
                    for e in entries
                ]
                for key, entries in self._entries.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(data, dict) or "clients" not in data:
            raise ValueError("ledger data must be a dict with a 'clients' key")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema_version must be {SCHEMA_VERSION}; found {version!r}")
        if not isinstance(data["clients"], dict):
            raise ValueError(
                f"ledger 'clients' must map client ids to lists of entries; found {data['clients']!r:.80}"
            )
        ledger = cls(
            data.get("value_discretization_interval", PLD_VDI),
            data.get("curve_value_discretization_interval", CURVE_VDI),
        )
        ledger.reproducible_noise = bool(data.get("reproducible_noise", False))
        ledger.adaptive = data.get("adaptive_composition")
        for key, entries in data["clients"].items():
            if not isinstance(entries, list):
                raise ValueError(
                    f"ledger client {key!r} must hold a list of entries; found {entries!r:.80}"
                )
            for i, e in enumerate(entries):
                where = f"ledger client {key!r}, entry {i}"
                if not isinstance(e, dict) or not {"event", "label"} <= set(e):
                    raise ValueError(
                        f"{where} must be an object with 'label' and 'event'; found {e!r:.80}"
                    )
                try:
                    ledger.add(
                        key,
                        event_from_dict(e["event"]),
                        e["label"],
                        round=e.get("round"),
                        neighbouring=e.get("neighbouring", "add_remove"),
                    )
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{where} ({e.get('label')!r}): {exc}") from None
        return ledger

    def save(self, path: str | Path) -> Path:
        """Write the ledger as JSON, atomically with its checksum sidecar (:mod:`atomicfiles`)."""
        return atomicfiles.write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Ledger:
        """Read a ledger written by :meth:`save`; one whose checksum sidecar disagrees with it is
        refused (:class:`atomicfiles.CorruptFileError`, a ``ValueError`` naming the file)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ledger file not found: {path}")
        raw = atomicfiles.read_verified(path, "ledger file")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"ledger file {path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:  # name the file, not a record
            detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ValueError(f"ledger file {path} is malformed: {detail}") from exc

    def noise_stamp(self) -> dict[str, Any]:
        """``{"reproducible_noise": bool}``, plus ``"noise": NOT_FOR_RELEASE`` when it is True, plus
        ``"adaptive_composition"`` when a guarantee for adaptive choices was recorded."""
        out: dict[str, Any] = {"reproducible_noise": bool(self.reproducible_noise)}
        if self.reproducible_noise:
            out["noise"] = NOT_FOR_RELEASE
        if self.adaptive is not None:
            out["adaptive_composition"] = self.adaptive
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def __repr__(self) -> str:
        return f"Ledger(clients={len(self._entries)}, entries={len(self)})"


_ACCOUNTANT_NOTES = {
    "basic": "each entry accounted alone (min of RDP/PLD) at an equal share of the free delta, summed",
    "advanced": "KOV heterogeneous advanced composition of the entries, half the free delta as slack",
    "rdp": "dp-accounting RDP on all DpEvents + basic composition of (epsilon, delta)-only events",
    "pld": "dp-accounting PLD (pessimistic) on all DpEvents + basic composition of the rest",
    "best": "minimum of the applicable accountants above",
}
