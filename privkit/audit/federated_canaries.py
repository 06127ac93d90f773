"""Canary records inside one client of a federated method (a one-run audit of that client's
record-level guarantee).

The federation is the released one (same clients, public data, test set) with ``n`` canaries made
by :func:`attacks.canaries.make_canaries` (``mislabel``: copies of shadow-pool records, which no
client holds, with a wrong label; ``ood``: out-of-distribution inputs) added to *one* client's
data, each by an independent fair coin from the audit's stream. The method trains once on it; the
canaries are scored from the released (global) model and the one-run bound over the canaries alone
is checked against that client's record-level epsilon in the canary run's own ledger (adding
records to a client can change what its mechanisms account, e.g. a sampling rate).

Client-level claims: the ledgers of privkit's methods are record-level (each entry protects one
record of one client; ``dp-fedavg`` runs record-level DP-SGD on every client) except those
registered with ``level="client"`` (``dp-fedavg-client``, McMahan et al.'s client-level DP-FedAvg),
whose per-client epsilon protects a client's whole data. A record canary does not test that claim
(a record's guarantee there is the client's replace-one one, not the ledger's add/remove epsilon),
so :func:`audit_client_canaries` refuses such a method; canary *clients* test client-level claims
(:class:`privkit.flower.CanaryClients` on a Flower federation).
"""

from __future__ import annotations

import numpy as np

from privkit.errors import PrivkitError


def federation_with_canaries(
    federation, client: int, canary_x: np.ndarray, canary_y: np.ndarray, included: np.ndarray
):
    """``federation`` with every canary appended to its private dataset and the included ones added
    to ``client``'s records (no other client, test set or pool changes)."""
    from dataclasses import replace

    from privkit.data import ArrayDataset

    base = federation.private
    n0 = len(base.y)
    private = ArrayDataset(
        name=f"{base.name}+canaries",
        num_classes=base.num_classes,
        x=np.ascontiguousarray(np.concatenate([base.x, canary_x.astype(base.x.dtype)])),
        y=np.concatenate([base.y, np.asarray(canary_y, dtype=base.y.dtype)]),
        description=base.description,
        test_indices=base.test_indices,
    )
    clients = [np.asarray(c, dtype=np.int64) for c in federation.clients]
    clients[client] = np.concatenate([clients[client], n0 + np.flatnonzero(included)]).astype(
        np.int64
    )
    return replace(federation, private=private, clients=clients, name=f"{federation.name}+canaries")


def audit_client_canaries(
    federation,
    method: str,
    trainer_config: dict,
    *,
    delta: float,
    client: int | None = None,
    n: int = 500,
    kind: str = "mislabel",
    score: str = "loss",
    seed: int = 0,
    confidence: float = 0.95,
    accounted_epsilon: float | None = None,
) -> dict:
    """One-run canary audit of ``client``'s record-level guarantee (see the module docstring).

    Parameters
    ----------
    federation, method, trainer_config : the released run's federation and method.
    delta : delta of the claim and of the bound.
    client : the client that holds the canaries (default: the one with the most records).
    n, kind : number and kind of canaries (``mislabel`` needs ``n`` <= the shadow pool size).
    score : ``loss`` or ``logit-gap``.
    seed : audit seed (canaries, coins, the run's seed, tie-break).
    accounted_epsilon : the claim to test (default: the client's epsilon at ``delta`` in the
        canary run's own ledger).

    Returns
    -------
    The verdict record of :func:`attacks.audit_scores` plus ``client``, ``canaries`` and
    ``test_accuracy``.
    """
    from attacks import audit_scores
    from attacks.canaries import ONE_SIDED_GUESSES, canary_scores, make_canaries
    from attacks.experiment import stream, stream_seeds
    from attacks.recipe import torch_logits
    from privkit.methods import get_trainer
    from privkit.trainers import train

    if get_trainer(method).level != "record":
        raise PrivkitError(
            f"method must make a record-level claim for canary records; found {method!r}, whose "
            "ledger is client-level (audit it with canary clients)"
        )
    if client is None:
        client = int(np.argmax([len(c) for c in federation.clients]))
    if not 0 <= client < federation.num_clients:
        raise PrivkitError(f"client must be in [0, {federation.num_clients}); found {client}")
    if kind == "mislabel":
        pool = federation.shadow_pool
        if pool.size < n:
            raise PrivkitError(
                f"n must be <= the shadow pool size {pool.size} for mislabelled canaries "
                f"(their sources must be in no client's data); found {n}"
            )
        px, py = federation.private.x[pool], federation.private.y[pool]
    else:
        px, py = federation.pooled_arrays()
    cx, cy, _ = make_canaries(px, py, n, kind=kind, num_classes=federation.num_classes, seed=seed)
    included = stream(seed, "canaries/coins").random(n) < 0.5
    fed = federation_with_canaries(federation, client, cx, cy, included)
    result = train(
        method, fed, trainer_config, seed=stream_seeds(seed, 1, "client-canaries/run")[0]
    )
    claim = accounted_epsilon
    if claim is None:
        claim = float(result.ledger.epsilon(delta, client=client))
    scores = canary_scores(torch_logits(result.model, cx), cy, score)
    name = f"client-{client}-canaries"
    res = audit_scores(
        {name: scores},
        included,
        accounted_epsilon=claim,
        delta=delta,
        confidence=confidence,
        seed=seed,
        guesses=ONE_SIDED_GUESSES,
        inclusion="random",
        notes={
            name: f"{n} {kind} canary records in client {client}'s data, "
            f"{int(included.sum())} included by fair coins; score = {score} on "
            "the released model"
        },
    )
    out = res.to_dict()
    out.update(
        {
            "client": client,
            "canaries": {"kind": kind, "n": n, "included": int(included.sum())},
            "method": method,
            "test_accuracy": float(result.test_accuracy),
            "claim": "the client's record-level epsilon in the canary run's ledger"
            if accounted_epsilon is None
            else "given by the caller",
        }
    )
    return out
