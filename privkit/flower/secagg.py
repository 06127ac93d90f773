"""Secure aggregation with distributed noise (Flower's SecAgg+), accounted as it ran.

The mechanism (the distributed Gaussian of Kairouz et al., ICML 2021, accounted here as the
continuous Gaussian): each of the ``m`` sampled clients clips its update to L2 norm ``S`` and adds
``N(0, (z S)^2 / m_target)`` per coordinate (:func:`distributed_noise`), ``m_target`` the number of
clients the noise was calibrated for; Flower's ``secaggplus_mod`` masks the result and
``SecAggPlusWorkflow`` reconstructs only the weighted sum over the clients whose masked inputs
reached the server.  With ``r`` such survivors the sum carries noise of std ``z S sqrt(r / m_target)``:
fewer survivors, less noise, a larger epsilon.

Which count is ``r``: the clients whose masked vectors arrived in SecAgg+'s *collect masked
vectors* stage (the ``active_nids`` its unmask stage starts from).  A client that drops out after
that stage is still in the sum: its private mask is reconstructed from its neighbours' shares, so
its noise survives with its input.  A client that drops out before it is not in the sum: neither
its data nor its noise.  :class:`SecAggPlusAccounted` counts ``r`` after the masked vectors
arrived and before the unmask stage, so a round whose realised ``r`` would take a client past the
budget is halted before the aggregate is reconstructed (nothing is released).

Each survivor ``i`` is charged ``GaussianDpEvent(sqrt(sum_j w_j^2 std_j^2) / (w_i s S_i))`` over the
survivors ``j`` (SecAgg+ weights each input by its ``num_examples`` ``w``; ``s`` = 2 under
``replace_one``, 1 under zero-out ``add_remove``): ``z sqrt(r / m_target) / s`` with equal weights
and equal shares.  A survivor that recorded no share (its update neither clipped nor noised as far
as the server knows) is charged a :class:`~accountants.NonPrivateEvent`; sampled clients that
dropped out before their input was summed are charged nothing this round.

Client sampling: no amplification.  privkit's central-DP accounting amplifies by Flower's draw of
``m`` of ``n`` nodes only for whoever sees the released model but not the draw; secure aggregation
guards against the server, and the server knows which nodes it sampled, so only the survivors are
charged, each with the unamplified Gaussian.

Not accounted: SecAgg+'s quantization.  After the noise, client by client, ``secaggplus_mod``
scales the parameters by ``num_examples / max_weight``, clips each coordinate to
``[-clipping_range, clipping_range]`` and stochastically rounds it to ``quantization_range`` levels
(a step of ``2 clipping_range max_weight / (quantization_range num_examples)`` in parameter units);
the continuous Gaussian accounts the idealised sum (the discrete Gaussian of Kairouz et al. accounts
the quantized one).  Keep that step far below the noise share's std and the scaled parameters,
noise included, inside the clipping range.  The threat model is SecAgg+'s: an honest-but-curious
server and fewer than ``reconstruction_threshold`` colluding clients; the survivor count and the
clients' weights are visible to the server and are taken as public.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, cast

import numpy as np

from accountants import Ledger, NonPrivateEvent
from privkit.flower import INSTALL_HINT

try:
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.supercore import log
except ImportError as exc:  # one line naming the extra to install
    raise ImportError(INSTALL_HINT) from exc

from privkit.flower.client import _active, entries_of
from privkit.flower.mechanisms import distributed_event
from privkit.flower.rundir import RunWriter

__all__ = ["KIND", "SecAggPlusAccounted", "distributed_noise"]

KIND = "distributed_noise"
_WEIGHT_RECORD = "fitres.num_examples"  # where a legacy FitRes reply carries its weight


def distributed_noise(
    arrays: list[Any],
    reference: list[Any],
    *,
    clip_norm: float,
    noise_multiplier: float,
    num_clients: int,
    source: np.random.Generator | None = None,
    label: str = "distributed noise",
) -> list[np.ndarray]:
    """This client's part of a distributed Gaussian: clip, add its noise share, record it.

    Clips the update ``arrays - reference`` (all arrays together) to L2 norm ``clip_norm`` and
    releases it with ``N(0, (noise_multiplier clip_norm)^2 / num_clients)`` per coordinate through
    :func:`privkit.mechanisms.gaussian.gaussian_release`; records ``clip_norm``,
    ``noise_multiplier``, ``num_clients`` and the share's std with the reply (the ClientApp's mods
    must hold :data:`~privkit.flower.ledger_mod`), where :class:`SecAggPlusAccounted` reads it.

    Parameters
    ----------
    arrays : list of numpy.ndarray
        The locally trained model.
    reference : list of numpy.ndarray
        The global model the round sent (same shapes).
    clip_norm : float
        ``S``: the L2 norm the update is clipped to (``> 0``).
    noise_multiplier : float
        ``z``: the noise std on the sum of ``num_clients`` shares over ``S`` (``>= 0``).
    num_clients : int
        ``m_target``: the number of clients whose shares make up the noise of std ``z S``.
    source : numpy.random.Generator, optional
        The noise stream; default the release stream (:func:`privkit.mechanisms.dp_random.aes_generator`).
        A seeded generator is for tests.
    label : str
        The ledger label.

    Returns
    -------
    list of numpy.ndarray
        ``reference + clipped update + noise share``, in ``arrays``' shapes and float dtypes: what
        the client returns for SecAgg+ to mask.
    """
    from privkit.mechanisms.gaussian import gaussian_release

    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ValueError(f"clip_norm must be a finite number > 0; found {clip_norm!r}")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0; found {noise_multiplier!r}"
        )
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be an int >= 1; found {num_clients!r}")
    if not isinstance(label, str) or not label:
        raise ValueError(f"label must be a non-empty string; found {label!r}")
    entries = _active("distributed_noise()")
    new = [np.asarray(a) for a in arrays]
    ref = [np.asarray(r, dtype=np.float64) for r in reference]
    if [a.shape for a in new] != [r.shape for r in ref]:
        raise ValueError(
            f"arrays and reference must have the same shapes; found {[a.shape for a in new]} and "
            f"{[r.shape for r in ref]}"
        )
    update = np.concatenate([(a.astype(np.float64) - r).ravel() for a, r in zip(new, ref)])
    norm = float(np.linalg.norm(update))
    clipped = update * (clip_norm / norm) if norm > clip_norm else update
    std = noise_multiplier * clip_norm / math.sqrt(num_clients)
    released, _ = gaussian_release(
        clipped,
        std=std,
        sensitivity=clip_norm,
        source=source if source is not None else _release_stream(),
    )
    out, start = [], 0
    for a, r in zip(new, ref):
        part = released[start : start + r.size].reshape(r.shape) + r
        start += r.size
        out.append(part.astype(a.dtype if np.issubdtype(a.dtype, np.floating) else np.float64))
    entries.append(
        {
            "kind": KIND,
            "label": label,
            "clip_norm": float(clip_norm),
            "noise_multiplier": float(noise_multiplier),
            "num_clients": int(num_clients),
            "std": float(std),
        }
    )
    return out


def _release_stream() -> np.random.Generator:
    from privkit.mechanisms.dp_random import aes_generator

    return aes_generator()


class _CapturingGrid:
    """The workflow's Grid, keeping each reply's privkit entries and its FedAvg weight."""

    def __init__(self, grid: Any) -> None:
        self._grid = grid
        self.entries: dict[int, list[dict]] = {}
        self.weights: dict[int, float] = {}

    def send_and_receive(self, messages: Any, **kwargs: Any) -> list:
        replies = list(self._grid.send_and_receive(messages, **kwargs))
        for reply in replies:
            if reply.has_error():
                continue
            node = int(reply.metadata.src_node_id)
            self.entries[node] = entries_of(reply)
            if _WEIGHT_RECORD in reply.content.metric_records:
                self.weights[node] = float(
                    reply.content.metric_records[_WEIGHT_RECORD]["num_examples"]
                )
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


@dataclass
class _Pending:
    """A round between its masked vectors and its unmasking."""

    number: int
    sampled: int
    survivors: list[int]
    target: int | None  # m_target the shares were calibrated for (None: no share recorded)
    events: dict[str, list[tuple[Any, str, str]]]


class SecAggPlusAccounted(RunWriter, SecAggPlusWorkflow):
    """Flower's ``SecAggPlusWorkflow`` with a privkit ledger of the distributed noise that survived.

    Use it as ``DefaultWorkflow(fit_workflow=SecAggPlusAccounted(...))`` in a ServerApp with
    Flower's ``LegacyContext`` (SecAgg+ in flwr 1.42 drives a legacy ``flwr.server.strategy``;
    the strategy should average as ``FedAvg`` does).  Each round is accounted from the replies
    whose masked inputs are in the aggregate (see :mod:`privkit.flower.secagg`).

    Parameters
    ----------
    num_shares, reconstruction_threshold
        As for ``SecAggPlusWorkflow``.
    delta : float
        The run's delta: the per-round epsilon and the budget are at this delta.
    budget : float, optional
        Epsilon budget.  Before a round's model is sent, the round is refused if even all its
        clients surviving would pass it (the noise of the last round's shares); after the masked
        inputs arrived, a round whose realised survivors would pass it is halted before the
        aggregate is reconstructed.  Either way the remaining rounds send nothing, and a refusal
        before any release raises :class:`~privkit.flower.accounting.RunRefused`.
    neighbouring : {"replace_one", "add_remove"}
        Client-level relation: a clipped update moves the sum by ``2 S`` (replace-one) or ``S``
        (zero-out add/remove).
    accountant : {"rdp", "pld"}
        Accountant of the per-round epsilon and of the budget.
    name : str
        The run's name when :meth:`save` writes it.
    **secagg : Any
        The other arguments of ``SecAggPlusWorkflow`` (``max_weight``, ``clipping_range``, ...).
    """

    def __init__(
        self,
        num_shares: int | float,
        reconstruction_threshold: int | float,
        *,
        delta: float,
        budget: float | None = None,
        neighbouring: str = "replace_one",
        accountant: str = "rdp",
        name: str = "flower-secagg",
        **secagg: Any,
    ) -> None:
        super().__init__(num_shares, reconstruction_threshold, **secagg)
        from accountants._validate import check_choice, check_open_unit, check_positive

        self.delta = check_open_unit(delta, "delta")
        self.budget = None if budget is None else check_positive(budget, "budget")
        self.neighbouring = check_choice(
            neighbouring, "neighbouring", ("replace_one", "add_remove")
        )
        self.accountant = check_choice(accountant, "accountant", ("rdp", "pld"))
        self.name = name
        self.ledger = Ledger()
        self.rounds: list[dict] = []
        self.failures: list[str] = []
        self.notes: list[str] = []
        self.stopped: str | None = None
        self.written: Path | None = None
        self._pending: _Pending | None = None
        self._last_share: dict | None = (
            None  # the last round's share (for the check before sending)
        )
        self._worst = 0.0

    # -- SecAgg+ stages ------------------------------------------------------------------------
    def setup_stage(self, grid: Any, context: Any, state: Any) -> bool:
        """SecAgg+'s setup, unless the run has stopped (then the round sends nothing).

        Parameters
        ----------
        grid : flwr.serverapp.Grid
            The Grid the setup's configuration goes through.
        context : flwr.server.LegacyContext
            The ServerApp's legacy context (strategy, round, model).
        state : flwr.server.workflow.secure_aggregation.secaggplus_workflow.WorkflowState
            The round's SecAgg+ state, where the setup records the sampled nodes.

        Returns
        -------
        bool
            False once the run has stopped (nothing is sent) or when too few nodes answered.
        """
        if self.stopped:
            return False
        return bool(super().setup_stage(grid, context, state))

    def collect_masked_vectors_stage(self, grid: Any, context: Any, state: Any) -> bool:
        """Send the model and collect the masked inputs; then account the round from the replies
        that arrived (``r``) and halt it before unmasking when it would pass the budget.

        Parameters
        ----------
        grid : flwr.serverapp.Grid
            The Grid the model and the key shares go through (privkit reads the replies'
            records on the way back).
        context : flwr.server.LegacyContext
            The ServerApp's legacy context (strategy, round, model).
        state : flwr.server.workflow.secure_aggregation.secaggplus_workflow.WorkflowState
            The round's SecAgg+ state: its active nodes after this stage are the survivors.

        Returns
        -------
        bool
            False when too few masked inputs arrived or the budget halts the round.
        """
        number = int(context.state.config_records[MAIN_CONFIGS_RECORD][WorkflowKey.CURRENT_ROUND])
        why = self._refused_before(number, len(state.active_node_ids))
        if why is not None:
            self._stop(f"stopped before round {number}: {why}")
            return False
        seen = _CapturingGrid(grid)
        ok = super().collect_masked_vectors_stage(cast(Any, seen), context, state)
        survivors = sorted(int(n) for n in state.active_node_ids)
        if not ok:
            self._fail(number, "too few masked inputs for SecAgg+ to unmask; nothing released")
            return False
        pending = self._round_events(number, len(state.sampled_node_ids), survivors, seen)
        would = self._epsilon_with(pending.events)
        if self.budget is not None and would > self.budget:
            self._stop(
                f"round {number} halted before unmasking: with {len(survivors)} survivor(s) it "
                f"would take a client to epsilon {would:.4g} > budget {self.budget:g} "
                f"({self.accountant}, delta={self.delta:g}); the aggregate was not reconstructed"
            )
            return False
        self._pending = pending
        return True

    def unmask_stage(self, grid: Any, context: Any, state: Any) -> bool:
        """Unmask the aggregate; once it is released, record the round's events.

        Parameters
        ----------
        grid : flwr.serverapp.Grid
            The Grid the unmask requests go through.
        context : flwr.server.LegacyContext
            The ServerApp's legacy context (strategy, round, model).
        state : flwr.server.workflow.secure_aggregation.secaggplus_workflow.WorkflowState
            The round's SecAgg+ state, holding the masked sum to unmask.

        Returns
        -------
        bool
            Whether the aggregate was reconstructed and handed to the strategy.
        """
        pending, self._pending = self._pending, None
        ok = bool(super().unmask_stage(grid, context, state))
        if pending is None:
            return ok
        if not ok:
            self._fail(pending.number, "SecAgg+ could not unmask the aggregate; nothing released")
            return ok
        self._record(pending)
        return ok

    # -- accounting ----------------------------------------------------------------------------
    def _round_events(
        self, number: int, sampled: int, survivors: list[int], seen: _CapturingGrid
    ) -> _Pending:
        """Each survivor's events: its share of the noise that survived, or what else it recorded."""
        from privkit.flower.accounting import _entry_event

        shares: dict[int, dict] = {}
        own: dict[int, list[dict]] = {}
        for node in survivors:
            entries = seen.entries.get(node, [])
            mine = [e for e in entries if e.get("kind") == KIND]
            if len(mine) > 1:
                raise ValueError(
                    f"a client must add one distributed-noise share per round; node {node} "
                    f"recorded {len(mine)} in round {number}"
                )
            if mine:
                shares[node] = mine[0]
            own[node] = [e for e in entries if e.get("kind") != KIND]
        weights = {n: seen.weights.get(n, 1.0) for n in survivors}
        noise = [(weights[n], float(s["std"])) for n, s in shares.items()]
        targets = sorted({int(s["num_clients"]) for s in shares.values()})
        r = len(survivors)
        events: dict[str, list[tuple[Any, str, str]]] = {}
        for node in survivors:
            key, share = str(node), shares.get(node)
            events[key] = []
            if share is not None:
                event = distributed_event(
                    float(share["clip_norm"]), weights[node], noise, self.neighbouring
                )
                label = (
                    f"round {number}: distributed noise under SecAgg+ ({r} survivor(s), "
                    f"calibrated for {share['num_clients']})"
                )
                events[key].append((event, label, self.neighbouring))
            for entry in own[node]:
                event, label, relation = _entry_event(entry, self.neighbouring)
                events[key].append((event, f"round {number}: {label}", relation))
            if not events[key]:
                reason = "update summed by SecAgg+ without a recorded distributed-noise share"
                events[key].append(
                    (NonPrivateEvent(reason), f"round {number}: model update", self.neighbouring)
                )
        if shares:
            self._last_share = next(iter(shares.values()))
        return _Pending(number, sampled, survivors, targets[0] if targets else None, events)

    def _record(self, pending: _Pending) -> None:
        for client, events in pending.events.items():
            for event, label, relation in events:
                self.ledger.add(client, event, label, round=pending.number, neighbouring=relation)
        if pending.events:
            self._worst = self.ledger.account(self.delta, accountant=self.accountant).epsilon
        r, target = len(pending.survivors), pending.target
        self.rounds.append(
            {
                "round": pending.number,
                "epsilon": self._worst,
                "clients": pending.survivors,
                "sampled": pending.sampled,
                "survivors": r,
                "calibrated_for": target,
            }
        )
        if target is not None and r < target:
            note = (
                f"round {pending.number}: {r} of the {target} clients the distributed noise was "
                f"calibrated for are in the aggregate: its noise std is sqrt({r}/{target}) of the "
                "calibrated one, and the round is accounted at the realised count"
            )
            self.notes.append(note)
            log(WARNING, "privkit: %s", note)
        log(
            INFO,
            "privkit: round %s (SecAgg+, %s of %s sampled clients in the aggregate), worst client's "
            "epsilon %.6g at delta %g (%s, client-level %s, no sampling amplification)",
            pending.number,
            r,
            pending.sampled,
            self._worst,
            self.delta,
            self.accountant,
            self.neighbouring,
        )

    def _client_epsilon(self, client: str, extra: list[tuple[Any, str, str]]) -> float:
        return self._with(client, extra).account(self.delta, accountant=self.accountant).epsilon

    def _epsilon_with(self, pending: dict[str, list[tuple[Any, str, str]]]) -> float:
        touched = [self._client_epsilon(c, evs) for c, evs in pending.items() if evs]
        return max([self._worst, *touched])

    def _refused_before(self, number: int, active: int) -> str | None:
        """Why the round's model may not be sent: even with all ``active`` clients in the sum,
        the last round's shares would pass the budget (None when it may be sent, or before any
        share is known)."""
        if self.budget is None or self._last_share is None or active < 1:
            return None
        share = self._last_share
        event = distributed_event(
            float(share["clip_norm"]),
            1.0,
            [(1.0, float(share["std"]))] * active,
            self.neighbouring,
        )
        label = f"round {number}: distributed noise under SecAgg+ (predicted)"
        clients = self.ledger.clients or ["next"]
        would = max(self._client_epsilon(c, [(event, label, self.neighbouring)]) for c in clients)
        if would <= self.budget:
            return None
        return (
            f"even with all {active} clients in the aggregate it would take a client to epsilon "
            f"{would:.4g} > budget {self.budget:g} ({self.accountant}, delta={self.delta:g})"
        )

    def _stop(self, why: str) -> None:
        from privkit.flower.accounting import RunRefused

        self.stopped = why
        log(WARNING, "privkit: %s", why)
        if not self.rounds:
            raise RunRefused(f"privkit refused the first SecAgg+ round: {why}")

    def _fail(self, number: int, why: str) -> None:
        self.failures.append(f"round {number}: {why}")
        log(WARNING, "privkit: %s", self.failures[-1])

    # -- results (epsilon and save: RunWriter) ----------------------------------------------
    def convention(self) -> dict:
        """What ``ledger.json``'s events mean (no client-sampling amplification)."""
        from privkit.flower.rundir import convention

        return convention(self.neighbouring, "none")

    def describe(self) -> list[str]:
        """The accounting assumptions, as the run's warnings."""
        return [
            (
                "Flower SecAgg+ run accounted by privkit: distributed Gaussian noise, each client "
                f"charged the noise of the clients whose masked inputs are in the aggregate, "
                f"client-level {self.neighbouring}, no client-sampling amplification (the server "
                "knows the sample); SecAgg+'s quantization is not accounted."
            ),
            *self.notes,
            *self.failures,
        ]
