"""Partitions of a dataset's training indices among clients: Dirichlet, IID and label shards."""

from __future__ import annotations

import numpy as np

from privkit.errors import PrivkitError

PARTITIONS = ("dirichlet", "iid", "shards")


def _check_clients(n_items: int, n_clients: int) -> None:
    if n_clients < 1:
        raise PrivkitError(f"clients must be >= 1; found {n_clients}")
    if n_clients > n_items:
        raise PrivkitError(
            f"clients must be <= the number of samples to split ({n_items}); found {n_clients}"
        )


def sinkhorn_normalise(matrix: np.ndarray, iterations: int = 1000) -> np.ndarray:
    """Alternately normalise the columns and rows of a (classes x clients) matrix.

    FedAUX Appendix B: each column (client) is scaled to sum to one, then each row (class), for at
    most ``iterations`` rounds, ending on rows so that every class is fully allocated.
    """
    m = np.array(matrix, dtype=np.float64)
    for _ in range(iterations):
        m /= m.sum(axis=0, keepdims=True)
        m /= m.sum(axis=1, keepdims=True)
        if np.allclose(m.sum(axis=0), m.sum(axis=0).mean(), rtol=1e-12, atol=0):
            break
    return m


def dirichlet_partition(
    labels: np.ndarray,
    n_clients: int,
    alpha: float,
    rng: np.random.Generator,
    num_classes: int | None = None,
) -> list[np.ndarray]:
    """Split ``labels``' indices among ``n_clients`` with Dirichlet(alpha) class mixtures.

    FedAUX Appendix B: for each class j draw p_j ~ Dir_n(alpha) (n = clients), stack into a
    classes x clients matrix, alternately normalise columns and rows (1000 iterations), and give
    client i ``round(P_ji * M_j)`` non-overlapping points of class j (M_j = class size). Small
    alpha gives clients dominated by one class; large alpha approaches IID.

    Parameters
    ----------
    labels : numpy.ndarray
        Label of each item to split, shape (N,).
    n_clients : int
        Number of clients, at least 1 and at most N.
    alpha : float
        Dirichlet concentration, > 0.
    rng : numpy.random.Generator
        The stream that draws the mixtures and the order within each class.
    num_classes : int, optional
        Number of classes; by default ``labels.max() + 1``.

    Returns
    -------
    list of numpy.ndarray
        Each client's indices into ``labels`` (sorted int64), disjoint.
    """
    if not alpha > 0 or not np.isfinite(alpha):
        raise PrivkitError(f"alpha must be > 0; found {alpha}")
    labels = np.asarray(labels)
    _check_clients(len(labels), n_clients)
    c = int(num_classes if num_classes is not None else labels.max() + 1)
    # Dir(alpha) with tiny alpha underflows to all-zero rows in float64; a floor keeps them valid.
    weights = np.maximum(rng.dirichlet(np.full(n_clients, alpha), size=c), 1e-300)
    weights = sinkhorn_normalise(weights)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for j in range(c):
        idx = rng.permutation(np.flatnonzero(labels == j))
        counts = np.round(weights[j] * len(idx)).astype(int)
        cuts = np.minimum(np.cumsum(counts), len(idx))[:-1]
        for i, chunk in enumerate(np.split(idx, cuts)):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def iid_partition(n_items: int, n_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle and cut into ``n_clients`` near-equal parts.

    Parameters
    ----------
    n_items : int
        Number of items to split (indices ``0 .. n_items - 1``).
    n_clients : int
        Number of clients, at least 1 and at most ``n_items``.
    rng : numpy.random.Generator
        The stream that draws the shuffle.

    Returns
    -------
    list of numpy.ndarray
        Each client's indices (sorted int64); sizes differ by at most one.
    """
    _check_clients(n_items, n_clients)
    return [
        np.sort(p).astype(np.int64) for p in np.array_split(rng.permutation(n_items), n_clients)
    ]


def shard_partition(
    labels: np.ndarray, n_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Sort by label, cut into ``n_clients * shards_per_client`` equal shards, deal them out.

    The non-IID set-up of McMahan et al. used by FedKADP: with 2 shards per client most clients
    hold two classes.

    Parameters
    ----------
    labels : numpy.ndarray
        Label of each item to split, shape (N,).
    n_clients : int
        Number of clients.
    shards_per_client : int
        Shards each client receives, >= 1; ``n_clients * shards_per_client`` must be <= N.
    rng : numpy.random.Generator
        The stream that breaks ties within a label and deals the shards.

    Returns
    -------
    list of numpy.ndarray
        Each client's indices into ``labels`` (sorted int64), disjoint.
    """
    if shards_per_client < 1:
        raise PrivkitError(f"shards_per_client must be >= 1; found {shards_per_client}")
    labels = np.asarray(labels)
    n_shards = n_clients * shards_per_client
    _check_clients(len(labels), n_clients)
    if n_shards > len(labels):
        raise PrivkitError(
            f"clients * shards_per_client must be <= {len(labels)}; found {n_shards}"
        )
    # random tie-break inside each label so shards are not ordered by acquisition
    order = np.lexsort((rng.random(len(labels)), labels))
    shards = np.array_split(order, n_shards)
    dealt = rng.permutation(n_shards).reshape(n_clients, shards_per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])).astype(np.int64) for row in dealt]


def top_class_shares(class_counts: np.ndarray, top: int = 3) -> np.ndarray:
    """Mean ranked share of each client's ``top`` largest classes (FedAUXfdp Table 1), as fractions.

    ``class_counts`` is (clients x classes). Clients with no data are left out.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    counts = counts[counts.sum(axis=1) > 0]
    ranked = -np.sort(-counts, axis=1)[:, :top] / counts.sum(axis=1, keepdims=True)
    return ranked.mean(axis=0)
