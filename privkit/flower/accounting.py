"""privkit's ledger for a Flower app: :class:`Accounted` wraps a Message-API strategy (flwr 1.42,
``flwr.serverapp.strategy``) and records, per client (node id) and per round, every DP mechanism
the round applied to that client's data.

What a round records for a client (the release it covers in brackets):

* the entries the client sent with its reply (:mod:`privkit.flower.client`: privkit's DP-SGD step,
  Flower's LocalDpMod, a :func:`~privkit.flower.distributed_noise` share, which here, without
  secure aggregation, covers the update with its own share only) [the update the client uploaded;
  the aggregate is post-processing of it]; secure aggregation with distributed noise runs on
  Flower's legacy workflow and is accounted by :class:`privkit.flower.SecAggPlusAccounted`;
* otherwise, with one of Flower's central-DP wrappers in the strategy chain, the wrapper's Gaussian
  (:mod:`privkit.flower.mechanisms`) [the noised global model]; with ``client_sampling=
  "without_replacement"`` every connected node gets the subsampled event, since the server draws
  ``m`` of ``n`` nodes uniformly without replacement (``random.sample`` in flwr's
  ``sample_nodes``), and amplification holds for whoever sees the model but not the draw;
* otherwise a :class:`~accountants.NonPrivateEvent` [a model averaged without noise].

A client-side clipping wrapper trusts the clients to clip; the server checks each reply's update
norm and records a client whose update exceeds the clip norm as non-private.  Training and
evaluation metrics (``MetricRecord``) pass through un-noised, as Flower's wrappers leave them: they
are not accounted, so publish the model, not the metrics.

Per round the worst client's epsilon at ``delta`` (``accountant``, RDP by default) is added to the
round's train metrics as ``privkit-epsilon``; with ``budget`` a round that would take any client
past it is not sent (the remaining rounds send nothing); :meth:`Accounted.start` writes the run's
``ledger.json`` and ``privacy.json`` when given ``out``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from accountants import Ledger, NonPrivateEvent, event_from_dict
from privkit.errors import PrivkitError
from privkit.flower import INSTALL_HINT

try:
    from flwr.serverapp.strategy import Strategy
    from flwr.supercore import log
except ImportError as exc:  # one line naming the extra to install
    raise ImportError(INSTALL_HINT) from exc

from privkit.flower.adaptive import RoundFilter
from privkit.flower.checks import check_flower_dp
from privkit.flower.client import entries_of, ledger_mod, record, record_dpsgd, recorded
from privkit.flower.mechanisms import (
    CentralDp,
    central_dp,
    central_event,
    central_multiplier,
    distributed_share_event,
    local_dp_event,
)
from privkit.flower.rundir import RunWriter

__all__ = [
    "Accounted",
    "RunFailed",
    "RunRefused",
    "ledger_mod",
    "record",
    "record_dpsgd",
    "recorded",
]


class RunRefused(PrivkitError):
    """The federation's first release was refused before anything was sent (budget, lifetime
    budget, or no recognised DP mechanism): the ServerApp ends with this one-line error."""


class RunFailed(PrivkitError):
    """Every round of the federation failed: no model was released (the error names the first
    failure), so the ServerApp does not end as a successful private run."""


EPSILON_METRIC = "privkit-epsilon"
SAMPLINGS = ("without_replacement", "none")
_RUNNING_ACCOUNTANTS = ("rdp", "pld")
_NORM_SLACK = 1e-4  # float32 arrays: a clipped update's norm may exceed C by rounding


@dataclass
class _Round:
    """What :meth:`Accounted.configure_train` fixed for the round before anything was sent."""

    number: int
    nodes: list[int]
    sampled: list[int]
    sent: list | None  # the global arrays sent (numpy), for the clip-norm check
    clip_norm: float | None
    config: Any = None  # the ConfigRecord the round sends


def _local_dp_parameters(entry: dict) -> Any:
    """A LocalDpMod's parameters as a client sent them (the attributes the mod has)."""
    from flwr.clientapp.mod import LocalDpMod

    keys = ("clipping_norm", "sensitivity", "epsilon", "delta")
    return LocalDpMod(**{k: float(entry[k]) for k in keys})


def _entry_event(entry: dict, neighbouring: str) -> tuple[Any, str, str]:
    """(event, label, relation) of one entry a client sent."""
    if entry.get("kind") == "local_dp":
        mod = _local_dp_parameters(entry)
        return local_dp_event(mod, neighbouring), "local dp (LocalDpMod)", neighbouring
    if entry.get("kind") == "distributed_noise":  # no secure aggregation: the share alone
        event = distributed_share_event(
            float(entry["clip_norm"]), float(entry["std"]), neighbouring
        )
        return event, "distributed noise share (aggregated in the clear)", neighbouring
    if entry.get("kind") == "event":
        return (
            event_from_dict(entry["event"]),
            str(entry["label"]),
            str(entry.get("neighbouring", "add_remove")),
        )
    raise ValueError(
        "privkit ledger entry kind must be 'event', 'local_dp' or 'distributed_noise'; found "
        f"{entry.get('kind')!r}"
    )


def _weight(reply: Any, key: str) -> float | None:
    """The reply's FedAvg weight (its single MetricRecord's ``key``), or None without one."""
    records = list(reply.content.metric_records.values())
    value = records[0].get(key) if len(records) == 1 else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _update_norm(reply_arrays: list, sent: list) -> float:
    import numpy as np

    return float(
        math.sqrt(
            sum(
                float(
                    np.sum((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2)
                )
                for a, b in zip(reply_arrays, sent, strict=True)
            )
        )
    )


class _RecordingGrid:
    """A Grid that remembers the node list it last handed out (everything else delegated)."""

    def __init__(self, grid: Any) -> None:
        self._grid, self.last = grid, []

    def get_node_ids(self) -> list:
        self.last = list(self._grid.get_node_ids())
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class Accounted(RunWriter, Strategy):
    """A Flower strategy whose rounds are recorded in a privkit :class:`~accountants.Ledger`.

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        The app's strategy, DP wrapper included (e.g. ``DifferentialPrivacyClientSideFixedClipping(
        FedAvg(...), ...)``).
    delta : float
        The run's delta: the per-round epsilon and the budget are at this delta.
    budget : float, optional
        Epsilon budget: a round that would take any client past it is not sent.
    neighbouring : {"replace_one", "add_remove"}
        Client-level relation of the central-DP and LocalDpMod events (see
        :mod:`privkit.flower.mechanisms`); ``add_remove`` is the zero-out relation.
    client_sampling : {"without_replacement", "none"}
        ``without_replacement``: amplification by Flower's uniform draw of ``m`` of ``n`` nodes
        (replace-one only; dp-accounting's RDP); ``none``: only the sampled clients are charged.
    client_mechanism : callable, optional
        ``client_mechanism(server_round, config) -> [(event, label, neighbouring), ...]``: what each
        sampled client will apply in the round, from the config the round sends; used to check the
        budget (and the filter) before the round is sent.  Without it a client's mechanisms are
        predicted from its previous round.
    adaptive : bool
        The app picks a round's noise from earlier releases: charge each round to a Rényi filter
        (:mod:`privkit.flower.adaptive`) whose guarantee is ``(budget, delta)``; needs ``budget``.
    order : float, optional
        The filter's RDP order (by default planned from the first round's mechanisms).
    accountant : {"rdp", "pld"}
        Accountant of the per-round epsilon and the budget check (``privacy.json`` has all).
    out : path, optional
        Where :meth:`start` writes the run (``<out>/<name>/ledger.json``, ``privacy.json``, ...).
        A relative path is taken from the directory where the user ran the federation: the run
        config's ``privkit-dir`` (``flwr run . --run-config "privkit-dir='$PWD'"``, the key declared
        in the app's ``[tool.flwr.app.config]``), else the ServerApp's working directory; a path
        inside a Flower app folder (which the next ``flwr run`` packs) moves next to that folder.
    name : str
        The run's name in ``out``; a name already taken there gets ``-2``, ``-3``, ...
    store : path, optional
        The federation's lifetime ledger (a folder, resolved as ``out``): each run appends its
        worst client's events there, and the lifetime budget is checked against all of them.
    lifetime_budget : float, optional
        Epsilon budget over every run in ``store``: a round that would pass it is not sent (the
        first round: the run is refused, :class:`RunRefused`).
    context : flwr.app.Context, optional
        The ServerApp's context, where the run config (``privkit-dir``) is read.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        delta: float,
        budget: float | None = None,
        neighbouring: str = "replace_one",
        client_sampling: str = "without_replacement",
        client_mechanism: Callable[[int, Any], list[tuple[Any, str, str]]] | None = None,
        adaptive: bool = False,
        order: float | None = None,
        accountant: str = "rdp",
        out: str | Path | None = None,
        name: str = "flower-app",
        store: str | Path | None = None,
        lifetime_budget: float | None = None,
        context: Any = None,
    ) -> None:
        super().__init__()
        from accountants._validate import check_choice, check_open_unit, check_positive

        self.strategy = strategy
        self.delta = check_open_unit(delta, "delta")
        self.budget = None if budget is None else check_positive(budget, "budget")
        self.neighbouring = check_choice(
            neighbouring, "neighbouring", ("replace_one", "add_remove")
        )
        self.client_sampling = check_choice(client_sampling, "client_sampling", SAMPLINGS)
        if client_sampling == "without_replacement" and neighbouring != "replace_one":
            raise ValueError(
                "client_sampling must be 'none' with neighbouring 'add_remove' (sampling without "
                f"replacement is accounted under replace-one); found {client_sampling!r}"
            )
        self.accountant = check_choice(accountant, "accountant", _RUNNING_ACCOUNTANTS)
        if accountant == "pld" and client_sampling == "without_replacement":
            raise ValueError(
                "accountant must be 'rdp' with client_sampling 'without_replacement' "
                "(dp-accounting's PLD has no sampling without replacement); found 'pld'"
            )
        if adaptive and self.budget is None:
            raise ValueError(
                "budget must be set with adaptive=True (the Renyi filter's guarantee); found None"
            )
        self.filter = RoundFilter(self.budget, self.delta, order) if adaptive else None
        self.client_mechanism = client_mechanism
        self.central: CentralDp | None = central_dp(strategy)
        self.notes: list[str] = []  # what check_flower_dp warns about the app's DP configuration
        self._checked: set[str] = set()
        if self.central is not None:
            self._note(check_flower_dp(strategy, delta=self.delta, neighbouring=self.neighbouring))
        self.out, self.name = (None if out is None else Path(out)), name
        self.lifetime_budget = (
            None if lifetime_budget is None else check_positive(lifetime_budget, "lifetime_budget")
        )
        if self.lifetime_budget is not None and store is None:
            raise ValueError(
                "store must be set with lifetime_budget (where the earlier runs are); found None"
            )
        self.context = context
        self.store: Path | None = None if store is None else Path(store)
        self._prior_runs: list[dict] = []
        self._prior: list[tuple[Any, str, str]] = []
        self.ledger = Ledger()
        self.rounds: list[dict] = []
        self.failures: list[str] = []  # one line per round with failed replies
        self.stopped: str | None = None
        self.written: Path | None = None  # where start() wrote the run
        self._round: _Round | None = None
        self._worst = 0.0
        self._flower: list[float] = []  # Flower's accountant's reading: one multiplier per round
        log(INFO, "privkit: %s", self.relation_line())

    def _note(self, check: Any) -> None:
        """Log the check's statement and keep its warnings for the run's ``train.json``."""
        log(INFO, "privkit: %s", str(check).splitlines()[0])
        for w in check.warnings:
            if w not in self.notes:
                self.notes.append(w)
                log(WARNING, "privkit: %s", w)

    def relation_line(self) -> str:
        """The start-up line: the neighbouring relation, and how it relates to Flower's number."""
        if self.neighbouring == "replace_one":
            unit = (
                "client-level DP under replace-one (one client's whole data replaced by another's: "
                "a clipped update moves by 2C)"
            )
            flower = (
                "Flower's own accountant counts zero-out add/remove (C) without client-sampling "
                "amplification, a smaller epsilon for the same noise; "
                "Accounted(..., neighbouring='add_remove', client_sampling='none') reproduces it"
            )
        else:
            unit = (
                "client-level DP under zero-out add/remove (one client's update replaced by zero: "
                "a clipped update moves by C)"
            )
            flower = "the relation of Flower's own accountant" + (
                ", whose number this is" if self.client_sampling == "none" else ""
            )
        sampling = (
            "with amplification by Flower's draw of m of n nodes"
            if self.client_sampling == "without_replacement"
            else "without sampling amplification"
        )
        return f"accounting {unit}, {sampling}, {self.accountant} at delta {self.delta:g}; {flower}"

    def _flower_epsilon(self) -> float | None:
        """What Flower's own accountant would print after the rounds so far (fixed clipping,
        zero-out add/remove, no amplification), or None where it accounts nothing."""
        if not self._flower or self.central is None or self.central.clipping != "fixed":
            return None
        import dp_accounting as dpa

        acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
        for mult in self._flower:
            acc.compose(dpa.GaussianDpEvent(mult))
        return float(acc.get_epsilon(self.delta))

    # -- lifetime ledger -------------------------------------------------------------------
    def _load_store(self) -> None:
        """The earlier runs in ``store``: each counts as its worst client's events."""
        from privkit.flower.lifetime import read_store

        assert self.store is not None
        self._prior_runs = read_store(self.store)
        self._prior = [
            (event_from_dict(e["event"]), f"{r['run']}: {e['label']}", e["neighbouring"])
            for r in self._prior_runs
            for e in r["entries"]
        ]

    def _lifetime_epsilon(self, pending: dict[str, list[tuple[Any, str, str]]]) -> float:
        """The federation's lifetime epsilon if ``pending`` were recorded: the earlier runs' worst
        clients composed with this run's worst client."""
        clients = set(self.ledger.clients) | {c for c, evs in pending.items() if evs}
        if not clients:
            return self._client_epsilon(None, [])
        return max(self._client_epsilon(c, pending.get(c, []), prior=True) for c in clients)

    # -- accounting ------------------------------------------------------------------------
    def _client_epsilon(
        self, client: str | None, extra: list[tuple[Any, str, str]], prior: bool = False
    ) -> float:
        """``client``'s epsilon at delta with ``extra`` (event, label, relation) added (and the
        earlier runs' events of the lifetime ledger with ``prior``)."""
        scratch = Ledger()
        if prior:
            for event, label, relation in self._prior:
                scratch.add(client or "prior", event, label, neighbouring=relation)
        if client is None:
            return (
                scratch.account(self.delta, accountant=self.accountant).epsilon
                if len(scratch)
                else 0.0
            )
        scratch = self._with(client, extra, scratch)
        return scratch.account(self.delta, accountant=self.accountant).epsilon

    def _epsilon_with(self, pending: dict[str, list[tuple[Any, str, str]]]) -> float:
        """The worst client's epsilon if ``pending`` were recorded (clients with identical histories
        hit the ledger's cache)."""
        touched = [self._client_epsilon(c, evs) for c, evs in pending.items() if evs]
        return max([self._worst, *touched])

    def _central_pending(self, rnd: _Round, shares: dict[int, float]) -> dict[str, list]:
        """Central-DP events of the round: ``shares`` = each replying client's weight in the mean."""
        dp = self.central
        assert dp is not None
        label = f"round {rnd.number}: central dp ({dp.name})"
        equal = len({round(s, 12) for s in shares.values()}) <= 1
        if self.client_sampling == "without_replacement" and equal and shares:
            share = next(iter(shares.values()))
            event = central_event(dp, share, self.neighbouring, (len(rnd.nodes), len(rnd.sampled)))
            return {str(n): [(event, label, self.neighbouring)] for n in rnd.nodes}
        if self.client_sampling == "without_replacement" and not equal:
            log(
                WARNING,
                "privkit: unequal client weights in round %s: accounted without sampling amplification",
                rnd.number,
            )
        return {
            str(n): [(central_event(dp, s, self.neighbouring), label, self.neighbouring)]
            for n, s in shares.items()
        }

    def _predict(self, rnd: _Round) -> dict[str, list]:
        """The round's events as known before sending: central DP at equal weights; a client's own
        mechanisms from ``client_mechanism``, else as in its last round (unknown for a client that
        never reported)."""
        pending: dict[str, list] = {}
        if self.central is not None:
            pending = self._central_pending(rnd, {n: 1.0 / len(rnd.sampled) for n in rnd.sampled})
        for n in rnd.sampled:
            key = str(n)
            if self.client_mechanism is not None:
                declared = self.client_mechanism(rnd.number, rnd.config)
                pending[key] = [
                    (ev, f"round {rnd.number}: {label}", rel) for ev, label, rel in declared
                ]
            elif key in self.ledger.clients:
                last = max((e.round or 0) for e in self.ledger.entries(key))
                own = [
                    (e.event, e.label, e.neighbouring)
                    for e in self.ledger.entries(key)
                    if e.round == last and not e.label.startswith(f"round {last}: central")
                ]
                if own:
                    pending[key] = own
        return pending

    # -- Strategy --------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
        """The inner strategy's messages, unless the round would take a client past the budget.

        Parameters
        ----------
        server_round : int
            The round about to be sent (Flower counts from 1).
        arrays : flwr.app.ArrayRecord
            The global model the round sends; with client-side central DP, kept to check the
            norms of the clients' updates.
        config : flwr.app.ConfigRecord
            The round's configuration, passed to the inner strategy and to ``client_mechanism``.
        grid : flwr.serverapp.Grid
            The Grid the inner strategy samples its nodes from.

        Returns
        -------
        list of flwr.app.Message
            The inner strategy's messages; empty once the run has stopped or when this round is
            refused (:class:`RunRefused` instead when no round has run yet).
        """
        if self.stopped:
            return []
        clip = self.central.clip_norm if self.central is not None else None
        seen = _RecordingGrid(grid)
        messages = list(self.strategy.configure_train(server_round, arrays, config, seen))
        # the population the inner strategy drew from: flwr's sample_nodes draws from the node list
        # of its last get_node_ids() call (it polls until enough nodes are connected)
        nodes = sorted(
            {int(n) for n in seen.last} | {int(m.metadata.dst_node_id) for m in messages}
        )
        sent = (
            arrays.to_numpy_ndarrays()
            if self.central is not None and self.central.side == "client"
            else None
        )
        rnd = _Round(
            server_round, nodes, [int(m.metadata.dst_node_id) for m in messages], sent, clip, config
        )
        why = self._refusal(rnd) if rnd.sampled else None
        if why is not None:
            self.stopped = f"stopped before round {server_round}: {why}"
            log(WARNING, "privkit: %s", self.stopped)
            if not self.rounds:  # nothing released yet: the run ends here, with an error
                raise RunRefused(f"privkit refused round {server_round} before sending it: {why}")
            return []
        self._round = rnd
        return messages

    def _refusal(self, rnd: _Round) -> str | None:
        """Why the round may not be sent (None when it may): a release no recognised DP mechanism
        covers (with a budget), the Renyi filter, the run's budget or the lifetime budget."""
        pending = self._predict(rnd)
        uncovered = sorted(n for n in rnd.sampled if not pending.get(str(n)))
        if uncovered and (self.budget is not None or self.lifetime_budget is not None):
            return (
                f"no recognised DP mechanism covers the release of client {uncovered[0]} (the "
                "strategy holds no Flower DP wrapper and no client_mechanism declares what the "
                "clients apply): its epsilon would be infinite"
            )
        if self.filter is not None:
            return self._refused_by_filter(rnd)
        if self.budget is not None:
            would = self._epsilon_with(pending)
            if would > self.budget:
                return (
                    f"it would take a client to epsilon {would:.4g} > budget {self.budget:g} "
                    f"({self.accountant}, delta={self.delta:g})"
                )
        if self.lifetime_budget is not None:
            would = self._lifetime_epsilon(pending)
            if would > self.lifetime_budget:
                return (
                    f"it would take the federation to lifetime epsilon {would:.4g} > lifetime "
                    f"budget {self.lifetime_budget:g} ({self.accountant}, delta={self.delta:g}, "
                    f"{len(self._prior_runs)} earlier run(s) in {self.store})"
                )
        return None

    def _refused_by_filter(self, rnd: _Round) -> str | None:
        """Why the Rényi filter refuses the round (None when it admits it)."""
        assert self.filter is not None
        pending = self._predict(rnd)
        self.filter.plan(pending)
        client = self.filter.refused(pending)
        if client is None:
            return None
        f = self.filter.filter
        return (
            f"the Renyi filter (order {f.order:g}, budget {f.budget:.4g}, epsilon {self.budget:g} at delta "
            f"{self.delta:g}) would be passed by client {client}"
        )

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[Any, Any]:
        """Aggregate with the inner strategy, then record the round's events and its epsilon."""
        rnd, self._round = self._round, None
        if rnd is None or rnd.number != server_round:
            return None, None
        replies = list(replies)
        errors = [r for r in replies if r.has_error()]
        if errors or len(replies) < len(rnd.sampled):
            first = errors[0].error.reason if errors else "no reply"
            self.failures.append(
                f"round {rnd.number}: {len(rnd.sampled) - len(replies) + len(errors)} of "
                f"{len(rnd.sampled)} clients failed or did not reply (first: {first})"
            )
            log(WARNING, "privkit: %s", self.failures[-1])
        reported = {int(r.metadata.src_node_id): entries_of(r) for r in replies}
        shares, unclipped = self._weights_and_norms(rnd, replies)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None:  # nothing released this round: nothing to record
            log(WARNING, "privkit: round %s released no model (no reply aggregated)", rnd.number)
            return arrays, metrics
        if self.central is not None and shares:
            self._flower.append(central_multiplier(self.central, 1.0 / len(shares), "add_remove"))
        pending: dict[str, list] = {}
        if arrays is not None:
            if self.central is not None and shares:
                pending = self._central_pending(rnd, shares)
            else:
                reason = "model update averaged without DP noise"
                pending = {
                    str(n): [
                        (
                            NonPrivateEvent(reason),
                            f"round {rnd.number}: model update",
                            self.neighbouring,
                        )
                    ]
                    for n in rnd.sampled
                }
        for node, norm in unclipped.items():
            pending[str(node)] = [
                (
                    NonPrivateEvent(
                        f"update norm {norm:.6g} exceeds the clipping norm {rnd.clip_norm:.6g} (is the clipping mod "
                        "installed?)"
                    ),
                    f"round {rnd.number}: unclipped update",
                    self.neighbouring,
                )
            ]
        for node, entries in reported.items():  # the client's own release covers the round
            for entry in entries:
                if entry.get("kind") == "local_dp" and repr(entry) not in self._checked:
                    self._checked.add(repr(entry))
                    self._note(
                        check_flower_dp(_local_dp_parameters(entry), neighbouring=self.neighbouring)
                    )
            if entries:
                pending[str(node)] = [_entry_event(e, self.neighbouring) for e in entries]
                pending[str(node)] = [
                    (ev, f"round {rnd.number}: {label}", rel)
                    for ev, label, rel in pending[str(node)]
                ]
        for client, events in pending.items():
            for event, label, relation in events:
                self.ledger.add(client, event, label, round=rnd.number, neighbouring=relation)
        if pending:
            self._worst = self.ledger.account(self.delta, accountant=self.accountant).epsilon
        if self.filter is not None and self.filter.filter is not None:
            self.filter.spend(pending, rnd.number)
            self.ledger.adaptive = self.filter.to_dict()
            if self.filter.passed and self.filter.passed not in self.notes:
                self.notes.append(self.filter.passed)
                log(WARNING, "privkit: %s", self.filter.passed)
        self.rounds.append(
            {
                "round": rnd.number,
                "epsilon": self._worst,
                "clients": sorted(rnd.sampled),
                "nodes": len(rnd.nodes),
            }
        )
        flower = self._flower_epsilon()
        log(
            INFO,
            "privkit: round %s, worst client's epsilon %.6g at delta %g (%s, client-level %s%s)%s",
            rnd.number,
            self._worst,
            self.delta,
            self.accountant,
            self.neighbouring,
            ", sampling amplified" if self.client_sampling == "without_replacement" else "",
            ""
            if flower is None
            else f"; Flower's accountant (zero-out add/remove, no amplification): {flower:.6g}",
        )
        from flwr.app import MetricRecord

        metrics = MetricRecord() if metrics is None else metrics
        metrics[EPSILON_METRIC] = float(self._worst)
        return arrays, metrics

    def _weights_and_norms(
        self, rnd: _Round, replies: list
    ) -> tuple[dict[int, float], dict[int, float]]:
        """Each valid reply's share of the weighted mean, and the clients whose updates exceed the clip
        norm (client-side clipping only)."""
        dp = self.central
        if dp is None:
            return {}, {}
        ok = [r for r in replies if not r.has_error()]
        key = dp.aggregator.weighted_by_key
        weights = {int(r.metadata.src_node_id): _weight(r, key) for r in ok}
        total = math.fsum(w for w in weights.values() if w is not None)
        # a reply without its weight: FedAvg does not aggregate the round, so nothing is released
        shares = (
            {n: w / total for n, w in weights.items() if w is not None}
            if total > 0 and None not in weights.values()
            else {}
        )
        unclipped: dict[int, float] = {}
        if rnd.sent is not None and rnd.clip_norm is not None:
            for r in ok:
                norm = _update_norm(
                    next(iter(r.content.array_records.values())).to_numpy_ndarrays(), rnd.sent
                )
                if norm > rnd.clip_norm * (1 + _NORM_SLACK):
                    unclipped[int(r.metadata.src_node_id)] = norm
        return shares, unclipped

    def configure_evaluate(self, server_round: int, arrays: Any, config: Any, grid: Any) -> Any:
        """The inner strategy's evaluation messages, passed through unchanged (the ledger records
        nothing for them).

        Parameters
        ----------
        server_round : int
            The current round (Flower counts from 1).
        arrays : flwr.app.ArrayRecord
            The global model to evaluate.
        config : flwr.app.ConfigRecord
            The evaluation round's configuration.
        grid : flwr.serverapp.Grid
            The Grid the inner strategy samples its nodes from.
        """
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Any) -> Any:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        log(
            INFO,
            "\t├──> privkit ledger: delta=%g, budget=%s, neighbouring=%s, client sampling=%s",
            self.delta,
            self.budget,
            self.neighbouring,
            self.client_sampling,
        )
        self.strategy.summary()

    def start(self, *args: Any, **kwargs: Any) -> Any:
        """Run the inner loop (``Strategy.start``), then write the run to ``out`` if given and
        append it to ``store``.

        Raises :class:`RunRefused` when the first round was refused before it was sent, and
        :class:`RunFailed` when no round released a model (every client failed): the ServerApp
        then ends with an error, not as a private run.
        """
        grid = kwargs.get("grid", args[0] if args else None)
        if self.store is not None:
            self.store = self._resolve(self.store, grid)
            self._load_store()
        refused: RunRefused | None = None
        try:
            result = super().start(*args, **kwargs)
        except RunRefused as exc:
            refused, result = exc, None
        if self.out is not None and (len(self.ledger) or self.stopped or self.failures):
            self.save(self._resolve(self.out, grid))
            log(INFO, "privkit: run written to %s", self.written)
        if self.store is not None and len(self.ledger):
            from privkit.flower.lifetime import append_run

            append_run(self.store, self._run_record())
        if refused is not None:
            raise refused
        if not self.rounds:
            why = self.failures[0] if self.failures else "no round ran"
            raise RunFailed(f"privkit: no round of the federation released a model ({why})")
        return result

    def _resolve(self, path: Path, grid: Any) -> Path:
        """``path`` taken from the user's directory (see ``out``), outside any Flower app folder."""
        from privkit.flower.lifetime import user_path

        config = dict(getattr(self.context, "run_config", None) or {})
        run = getattr(grid, "run", None) if grid is not None else None
        config.update(dict(getattr(run, "override_config", None) or {}))
        deployed = type(grid).__name__ not in ("InProcessGrid", "InMemoryGrid", "_RecordingGrid")
        return user_path(path, config.get("privkit-dir") or None, deployed=deployed)

    def _run_record(self) -> dict:
        """This run for the lifetime ledger: its worst client's entries."""
        from accountants import event_to_dict

        worst = max(
            self.ledger.clients,
            key=lambda c: self._client_epsilon(c, []),
        )
        return {
            "run": self.written.name if self.written is not None else self.name,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon": self._worst,
            "rounds": len(self.rounds),
            "worst_client": worst,
            "entries": [
                {
                    "label": e.label,
                    "neighbouring": e.neighbouring,
                    "event": event_to_dict(e.event),
                }
                for e in self.ledger.entries(worst)
            ],
        }

    # -- results (epsilon and save: RunWriter) ----------------------------------------------
    def convention(self) -> dict:
        """What ``ledger.json``'s events mean, and how to replay them in dp-accounting."""
        from privkit.flower.rundir import convention

        return convention(self.neighbouring, self.client_sampling)

    def describe(self) -> list[str]:
        """The accounting assumptions, as the run's warnings."""
        out = [
            (
                f"Flower app accounted by privkit: client-level events with neighbouring {self.neighbouring} "
                "(see privkit.flower.mechanisms); training and evaluation metrics are not accounted."
            )
        ]
        if self.central is not None:
            out.append(
                f"central DP: {self.central.name} (noise multiplier {self.central.update_multiplier:g} on the "
                f"mean of {self.central.num_sampled_clients} clients), client sampling: {self.client_sampling}"
            )
        return out + self.notes + self.failures
