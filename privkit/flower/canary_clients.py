"""White-box audit of a Flower federation's client-level DP claim with canary clients (Andrew, Chien,
Song, Steinke, Kairouz et al., "One-shot empirical privacy estimation for federated learning", ICLR
2024), tested against the run's own privkit ledger.

A federation with Flower's fixed-clipping wrapper (``DifferentialPrivacyClientSideFixedClipping``
with ``fixedclipping_mod``, or ``DifferentialPrivacyServerSideFixedClipping``) wrapped in
:class:`privkit.flower.Accounted` claims, per client and per round, the Gaussian that privkit reads
from the wrapper (:mod:`privkit.flower.mechanisms`): the noised mean of ``m`` clipped updates.
:class:`CanaryClients` wraps that strategy on the server, and :func:`canary_mod` (also
``CanaryClients.mod``) goes into the ClientApp after ``fixedclipping_mod``:

* **Canary clients.** The last ``canaries`` nodes (by node id, when the first round starts) are
  canary clients. Each has a uniformly random unit direction ``u_k`` over the flattened model
  arrays and a fair coin from the audit's own stream (:class:`attacks.whitebox.GradientCanaries`,
  ``kind="random"``, ``know_batch=False``). Flower's strategy samples them like any other node. A
  sampled canary whose coin says *included* gets its update ``raw_norm * u_k`` in the round's config
  and :func:`canary_mod` replaces the model the app returns by ``global + raw_norm * u_k`` (metrics
  and weight stay the app's); an *excluded* canary gets nothing and is an ordinary client.
* **What DP must do with them.** The wrapper clips every update to ``C`` (``raw_norm > C``, so
  clipping must act) and adds ``N(0, (z C / m)^2)`` to the mean, as for every client. An included
  and an excluded canary differ by one client's data replaced by another's, with the same nodes
  either way: the ``replace_one`` relation the ledger accounts under, so the ledger's epsilon holds
  for each canary's coin. (The zero-out relation, ``add_remove``, would need an excluded canary with
  a zero update, which Flower's clipping cannot take: it divides by the update's norm.)
* **What the auditor sees.** Only the releases: each round's aggregate ``w_{t+1}``, minus the model
  ``w_t`` the round sent, times the number of equal-weight replies it averaged, is
  ``sum of the sampled clients' clipped updates + N(0, (z C m_t / m)^2)``; its component along
  ``u_k``, in units of ``C``, is 1 for each round an included canary was sampled, plus noise. The
  other clients' updates are not subtracted: they add to the noise the tests see
  (``know_batch=False``: valid, less powerful; about ``m_t ||update||^2 / dim`` per component for
  clipped updates, whose directions the random ``u_k`` do not know; small where the model has many
  more parameters than a round has clients). Subtracting them would tell the auditor which nodes
  the round drew, the draw the ledger's sampling amplification assumes hidden.

**The claim tested** (:meth:`CanaryClients.claim`), read release by release from the ledger's
events for the canary nodes: round ``t`` releases once; each client is sampled with probability
``q_t = m_t / n_t`` (Flower draws exactly ``m_t`` of the ``n_t`` connected nodes, uniformly without
replacement: ``m_t / n_t`` is each node's marginal rate, so an included canary adds ``q_t C`` per
round in expectation more than an excluded one, the influence test's expectation); the noise on
the normalised release has standard deviation ``sigma_t C``, ``sigma_t`` twice the event's Gaussian
multiplier (privkit's ``replace_one`` multiplier is per ``2 C``: Flower's ``z m_t / m``); an included
canary moves the release by at most ``C``. The conformance test
(:func:`attacks.conformance.conformance_test`: releases, noise scale, influence) tests that
mechanism; the one-run bound (Steinke et al., f-DP analysis) tests the ledger's own epsilon for the
canary nodes at ``delta`` (its sampling without replacement included) over the canaries'
likelihood-ratio scores; each at half the error rate (:class:`attacks.whitebox.MechanismAudit`).
The influence test's t-statistic treats the canaries' totals as independent: Flower's fixed-size
draw makes them slightly negatively correlated, which only widens the interval (conservative).

Assumptions: fixed clipping (the adaptive wrappers change ``C`` each round: refused); the
``replace_one`` relation; FedAvg with equal client weights in every round (Flower's noise is
calibrated to an equal-weight mean; a round with unequal weights is refused at
:meth:`~CanaryClients.audit`); the canary clients run ``fixedclipping_mod`` where the wrapper clips
on the client side (else ``Accounted`` records them as non-private and there is no claim to test).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from privkit.flower import INSTALL_HINT

try:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.serverapp.strategy import Strategy
except ImportError as exc:  # one line naming the extra to install
    raise ImportError(INSTALL_HINT) from exc

__all__ = ["CANARY_KEY", "CanaryClients", "canary_mod"]

CANARY_KEY = "privkit-canary-update"
"""Config key carrying a canary client's update (float64 bytes) in the round's train message."""


# ----------------------------------------------------------------------------- client side
def canary_mod(msg: Message, context: Any, call_next: Any) -> Message:
    """Flower client mod of a canary client: the app's reply with its model replaced.

    On a train message whose config carries :data:`CANARY_KEY` (sent by :class:`CanaryClients` to
    the canary nodes it sampled), the key is removed, the app runs as usual, and the returned
    model becomes the model the server sent plus the canary's update (``raw_norm * u_k`` or zero),
    keeping the reply's array keys, dtypes, metrics and weight. Any other message passes through
    untouched. Put it after ``fixedclipping_mod`` in the ClientApp's mods, so that the canary's
    update is clipped as every client's is.

    Parameters
    ----------
    msg : flwr.app.Message
        The message the node received.
    context : flwr.app.Context
        The node's context (passed on to the app).
    call_next : callable
        The rest of the ClientApp (mods and app), as Flower passes it to a mod.

    Returns
    -------
    flwr.app.Message
        The reply, with the canary's model where the message carried a canary update.
    """
    if not str(msg.metadata.message_type).startswith("train") or not msg.has_content():
        return call_next(msg, context)
    configs = msg.content.config_records
    config = next((c for c in configs.values() if CANARY_KEY in c), None)
    if config is None:
        return call_next(msg, context)
    update = np.frombuffer(config.pop(CANARY_KEY), dtype=np.float64)
    if len(msg.content.array_records) != 1:
        raise ValueError(
            "canary_mod needs exactly one ArrayRecord (the global model) in the train message; "
            f"found {len(msg.content.array_records)}"
        )
    sent = next(iter(msg.content.array_records.values())).to_numpy_ndarrays()
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    records = reply.content.array_records
    if len(records) != 1:
        raise ValueError(
            f"canary_mod needs the app's reply to hold exactly one ArrayRecord; found {len(records)}"
        )
    key, record = next(iter(records.items()))
    size = sum(int(a.size) for a in sent)
    if update.size != size:
        raise ValueError(
            f"the canary update must have one entry per model parameter ({size}); found {update.size}"
        )
    out, at = [], 0
    for a in sent:
        out.append((a + update[at : at + a.size].reshape(a.shape)).astype(a.dtype))
        at += a.size
    reply.content[key] = ArrayRecord(
        dict(zip(record.keys(), (Array(np.asarray(a)) for a in out), strict=True))
    )
    return reply


# ----------------------------------------------------------------------------- server side
def _find_accounted(strategy: Any) -> Any:
    """The :class:`privkit.flower.Accounted` in ``strategy``'s chain of ``.strategy`` attributes."""
    from privkit.flower.accounting import Accounted

    seen, node = set(), strategy
    while node is not None and id(node) not in seen:
        if isinstance(node, Accounted):
            return node
        seen.add(id(node))
        node = getattr(node, "strategy", None)
    raise ValueError(
        "strategy must be or wrap privkit.flower.Accounted (the ledger whose claim is tested); "
        f"found {type(strategy).__name__}"
    )


def _flat(arrays: Any) -> np.ndarray:
    return np.concatenate(
        [np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays.to_numpy_ndarrays()]
    )


def _gaussian(event: Any) -> tuple[float, tuple[int, int] | None]:
    """(noise multiplier, (n, m) of a sampling without replacement or None) of a central event."""
    import dp_accounting as dpa

    if isinstance(event, dpa.SampledWithoutReplacementDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        return float(event.event.noise_multiplier), (
            int(event.source_dataset_size),
            int(event.sample_size),
        )
    if isinstance(event, dpa.GaussianDpEvent):
        return float(event.noise_multiplier), None
    raise ValueError(
        "a canary client's ledger event must be a Gaussian or a sampled-without-replacement "
        f"Gaussian (Flower's fixed-clipping wrappers); found {type(event).__name__}"
    )


class CanaryClients(Strategy):
    """Canary clients in a Flower federation, and the audit of its ledger's client-level claim.

    Wrap the strategy the ServerApp starts (an :class:`privkit.flower.Accounted`, or a strategy
    around one) and put :func:`canary_mod` (``CanaryClients.mod``) after ``fixedclipping_mod`` in the
    ClientApp's mods; run the federation with ``canaries`` nodes more than it has clients; then
    :meth:`audit`. See the module docstring for what is tested and under which assumptions.

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        The app's strategy: :class:`privkit.flower.Accounted` around a fixed-clipping Flower DP
        wrapper, or a strategy whose ``.strategy`` chain holds one.
    canaries : int
        Number of canary clients (>= 2): the last ``canaries`` node ids when the first round is
        configured. Set the inner strategy's ``min_available_nodes`` to the number of nodes, so
        that every node is connected by then.
    raw_norm : float, optional
        An included canary's update norm before clipping; default four clip norms. Must exceed the
        clip norm: a canary already within it would not test the clipping.
    seed : int
        The audit's seed: the canaries' directions and fair coins come from their own streams.
    """

    mod = staticmethod(canary_mod)

    def __init__(
        self,
        strategy: Strategy,
        *,
        canaries: int,
        raw_norm: float | None = None,
        seed: int = 0,
    ) -> None:
        from accountants._validate import check_int, check_positive

        super().__init__()
        self.strategy = strategy
        self.accounted = _find_accounted(strategy)
        dp = self.accounted.central
        if dp is None:
            raise ValueError(
                "strategy must hold one of Flower's fixed-clipping DP wrappers (canary clients test "
                "a central-DP claim); found none in the chain"
            )
        if self.accounted.neighbouring != "replace_one":
            raise ValueError(
                "the Accounted strategy's neighbouring must be 'replace_one' (an excluded canary is an "
                f"ordinary client); found {self.accounted.neighbouring!r}"
            )
        if dp.clipping != "fixed":
            raise ValueError(
                "strategy's DP wrapper must clip at a fixed norm (an adaptive clip norm changes "
                f"the influence each round); found {dp.name}"
            )
        self.n = check_int(canaries, "canaries", minimum=2)
        self.clip_norm = dp.clip_norm
        raw = 4.0 * self.clip_norm if raw_norm is None else check_positive(raw_norm, "raw_norm")
        if not raw > self.clip_norm:
            raise ValueError(
                f"raw_norm must exceed the clip norm {self.clip_norm:g} (clipping must act on the "
                f"canaries); found {raw_norm!r}"
            )
        self.raw_norm = raw
        self.seed = int(seed)
        self.canaries: Any = None  # attacks.whitebox.GradientCanaries, made in the first round
        self.nodes: list[int] = []  # canary node ids, canary k on nodes[k]
        self.rounds: list[dict] = []  # per release: round, replies, sampled, nodes, weights equal
        self._pending: dict | None = None
        self._updates: dict[int, bytes] = {}
        self._relations: set[str] = set()  # the ledger relations the last claim read

    # -- the canaries ----------------------------------------------------------------------
    def _designate(self, arrays: Any, grid: Any) -> None:
        from attacks.whitebox import GradientCanaries

        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) < self.n:
            raise ValueError(
                f"canaries must be at most the number of nodes ({len(nodes)}); found {self.n}"
            )
        dim = int(_flat(arrays).size)
        dp = self.accounted.central
        self.nodes = nodes[-self.n :]
        self.canaries = GradientCanaries(
            dim,
            self.n,
            clip_norm=self.clip_norm,
            sample_rate=min(1.0, dp.num_sampled_clients / len(nodes)),
            noise_multiplier=dp.update_multiplier,
            kind="random",
            know_batch=False,
            raw_norm=self.raw_norm,
            seed=self.seed,
        )

    def _update(self, k: int) -> bytes:
        """Included canary ``k``'s update ``raw_norm * u_k`` (float64 bytes, made once)."""
        c = self.canaries
        if k not in self._updates:
            weights = np.zeros(c.included_ids.size)
            weights[int(np.searchsorted(c.included_ids, k))] = self.raw_norm
            self._updates[k] = c.vector(weights).numpy().astype(np.float64).tobytes()
        else:
            c.appearances[k] += 1  # as vector() counts a canary's appearance (diagnostics only)
        return self._updates[k]

    def _with_update(self, msg: Message, update: bytes) -> Message:
        """``msg`` with its own copy of the config, carrying the canary's update."""
        content = msg.content
        items = {}
        for name, record in content.items():
            if isinstance(record, ConfigRecord):
                record = ConfigRecord(dict(record))
                record[CANARY_KEY] = update
            items[name] = record
        if not content.config_records:
            items["config"] = ConfigRecord({CANARY_KEY: update})
        msg.content = RecordDict(items)
        return msg

    # -- Strategy --------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: Any, config: Any, grid: Any) -> list:
        """The inner strategy's messages; those to sampled canary nodes carry the canary's update.

        Parameters
        ----------
        server_round : int
            The round being configured.
        arrays : flwr.app.ArrayRecord
            The global model sent to the clients.
        config : flwr.app.ConfigRecord
            The round's configuration.
        grid : flwr.serverapp.Grid
            The grid the inner strategy samples nodes from.

        Returns
        -------
        list of flwr.app.Message
        """
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if not messages:
            self._pending = None
            return messages
        if self.canaries is None:
            self._designate(arrays, grid)
        included = {self.nodes[k]: k for k in self.canaries.included_ids}
        out = []
        for msg in messages:
            k = included.get(int(msg.metadata.dst_node_id))
            out.append(msg if k is None else self._with_update(msg, self._update(int(k))))
        self._pending = {
            "round": int(server_round),
            "sent": _flat(arrays),
            "sampled": len(messages),
            "nodes": len(list(grid.get_node_ids())),
        }
        return out

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[Any, Any]:
        """The inner strategy's aggregate; a release is observed by the canaries."""
        from privkit.flower.accounting import _weight

        replies = list(replies)
        pending, self._pending = self._pending, None
        key = self.accounted.central.aggregator.weighted_by_key
        weights = [_weight(r, key) for r in replies if not r.has_error()]
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None or pending is None or pending["round"] != server_round:
            return arrays, metrics
        m = len(weights)
        released = (_flat(arrays) - pending["sent"]) * m
        import torch  # server side only: the ClientApp's canary_mod needs no torch

        self.canaries.observe(torch.from_numpy(released))
        self.rounds.append(
            {
                "round": int(server_round),
                "replies": m,
                "sampled": pending["sampled"],
                "nodes": pending["nodes"],
                "equal_weights": len(set(weights)) <= 1 and None not in weights,
                "weights": sorted({w for w in weights if w is not None}),
            }
        )
        return arrays, metrics

    def configure_evaluate(self, *args: Any) -> Any:  # evaluation: the inner strategy's, as is
        return self.strategy.configure_evaluate(*args)

    def aggregate_evaluate(self, *args: Any) -> Any:
        return self.strategy.aggregate_evaluate(*args)

    def summary(self) -> None:
        self.strategy.summary()

    def start(self, *args: Any, **kwargs: Any) -> Any:
        """Run the rounds (``Strategy.start``), then write the ledger as ``Accounted.start`` does."""
        result = super().start(*args, **kwargs)
        acc = self.accounted
        if acc.out is not None and len(acc.ledger):  # where Accounted.start would write it
            acc.save(acc._resolve(acc.out, kwargs.get("grid", args[0] if args else None)))
        return result

    # -- the claim and the audit -----------------------------------------------------------
    def claim(self, delta: float | None = None) -> tuple[Any, float]:
        """The ledger's claim for the canary clients, release by release, and its epsilon.

        Parameters
        ----------
        delta : float, optional
            The delta of the epsilon; default the ``Accounted`` strategy's.

        Returns
        -------
        (attacks.conformance.MechanismClaim, float)
            Per release with a ledger entry: the sampling rate ``m / n`` of the ledger's
            ``SampledWithoutReplacementDpEvent(n, m, ...)`` (for a ledger that claims no
            amplification, ``client_sampling="none"``, the rate of Flower's draw in that round),
            the noise multiplier in units of the clip norm on the normalised release (twice the
            replace-one multiplier), sensitivity ``C``; and the largest epsilon at ``delta`` (the
            ``Accounted`` strategy's accountant) the ledger gives a canary node.
        """
        from accountants import NonPrivateEvent
        from accountants._validate import check_open_unit
        from attacks.conformance import MechanismClaim
        from privkit.flower.mechanisms import update_sensitivity

        if self.canaries is None or not self.rounds:
            raise ValueError(
                "no release was observed; start the strategy (with canary_mod in the ClientApp) first"
            )
        acc = self.accounted
        delta = acc.delta if delta is None else check_open_unit(delta, "delta")
        for r in self.rounds:
            if not r["equal_weights"]:
                raise ValueError(
                    f"client weights must be equal in every round (Flower's noise is calibrated to "
                    f"an equal-weight mean); found {r['weights']} in round {r['round']}"
                )
        ledger = acc.ledger
        entries = {
            node: ledger.entries(node) if str(node) in ledger.clients else [] for node in self.nodes
        }
        self._relations = set()
        rates, noises = [], []
        for r in self.rounds:
            found = [(node, e) for node, es in entries.items() for e in es if e.round == r["round"]]
            if not found:  # sampling "none": no canary drawn this round; any client's entry
                found = [
                    (c, e)
                    for c in ledger.clients
                    for e in ledger.entries(c)
                    if e.round == r["round"] and "central dp" in e.label
                ]
            if not found:
                continue  # a release the ledger does not count: the releases test says so
            sigmas, drawn = [], []
            for node, e in found:
                if isinstance(e.event, NonPrivateEvent):
                    raise ValueError(
                        f"the ledger records canary node {node} as non-private in round "
                        f"{r['round']} ({e.event.reason}): there is no DP claim to test; put "
                        "canary_mod after fixedclipping_mod in the ClientApp's mods"
                    )
                mult, sampling = _gaussian(e.event)
                sigmas.append(mult * update_sensitivity(1.0, e.neighbouring))
                if sampling is not None:
                    drawn.append(sampling[1] / sampling[0])
                self._relations.add(e.neighbouring)
            # the ledger's sampling where it claims one; else (no amplification claimed) Flower's draw
            rates.append(max(drawn) if drawn else r["sampled"] / r["nodes"])
            noises.append(min(sigmas))
        if not rates:
            raise ValueError(
                "the ledger has no central-DP entry for any round the canaries observed; found "
                f"{len(ledger)} entries"
            )
        claim = MechanismClaim(np.array(rates), np.array(noises), self.clip_norm)
        histories = {
            repr([(e.event, e.neighbouring) for e in es]): node
            for node, es in entries.items()
            if es
        }
        eps = max(
            (
                ledger.epsilon(delta, client=node, accountant=acc.accountant)
                for node in histories.values()
            ),
            default=ledger.epsilon(delta, accountant=acc.accountant),
        )
        return claim, float(eps)

    def audit(self, *, delta: float | None = None, confidence: float = 0.95) -> Any:
        """Test the federation's releases against its ledger's claim for the canary clients.

        The conformance test (releases, noise scale, influence) of :meth:`claim`'s mechanism and the
        one-run bound over the canaries' likelihood-ratio scores against the ledger's epsilon, each
        at half the error rate.

        Parameters
        ----------
        delta : float, optional
            The delta of the ledger's epsilon; default the ``Accounted`` strategy's.
        confidence : float
            Family-wise confidence of the verdict, in (0, 1).

        Returns
        -------
        attacks.whitebox.MechanismAudit
            ``verdict`` is ``violation`` when either test rejects the claim; ``conformance`` and
            ``one_run`` hold the two tests (the one-run bound's ``accounted_epsilon`` is the
            ledger's epsilon for the canary nodes).
        """
        from accountants._validate import check_open_unit
        from attacks.whitebox import MechanismAudit

        confidence = check_open_unit(confidence, "confidence")
        claim, eps = self.claim(delta)
        delta = self.accounted.delta if delta is None else delta
        half = 1 - (1 - confidence) / 2
        conformance = self.canaries.conformance(claim=claim, confidence=half)
        conformance.notes.append(self._note(claim))
        one_run = self.canaries.audit(
            analysis="one-run",
            claim=claim,
            accounted_epsilon=eps,
            delta=delta,
            confidence=half,
        )
        return MechanismAudit.of(conformance, one_run, confidence)

    def _note(self, claim: Any) -> str:
        c = self.canaries
        rel = sorted(self._relations)
        return (
            f"{self.n} canary clients (nodes {self.nodes[0]}..{self.nodes[-1]}, {int(c.included.sum())} "
            f"included by fair coins, update norm {self.raw_norm:g} before clipping to "
            f"{self.clip_norm:g}); claim read from the ledger ({', '.join(rel) or 'no entry'}): "
            f"{claim.steps} releases, each client sampled at rate m/n = "
            f"{_span(claim.sample_rates)} (Flower's draw of m of n nodes), noise std "
            f"{_span(claim.noise_multipliers)} clip norms on the sum of the round's updates"
        )


def _span(values: np.ndarray) -> str:
    lo, hi = float(np.min(values)), float(np.max(values))
    return f"{lo:.4g}" if math.isclose(lo, hi) else f"{lo:.4g} to {hi:.4g}"
