"""Attribute-inference instantiations on what the seed methods share.

* Dominant-class inference from any per-client artifact (generic): FedAUX / FedAUXfdp certainty
  scores and scoring heads (FedAUX Appendix K: the top-scored public images reveal a client's
  class), FLiP's shared distilled samples and soft labels, FedMD's shared soft labels
  (reconstructed from the released party models on the public data, which is what a party
  shares each round). Features are fixed-size summaries of each artifact; the adversary is
  trained on shadow runs' clients and tested on the target run's clients.
* FLiP's Table II protocol (Sec. V-A): four binary FLiP runs (p1,s1), (p1,s2), (p2,s1), (p2,s2);
  an s1-vs-s2 classifier trained on the distilled samples of the p1 runs, tested on the p2 runs.
"""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np

from attacks.attribute import AttributeInferenceAttack, AttributeResult

_CLIENT_KEY = re.compile(r"^(?P<name>.+)/client_(?P<i>\d+)$")
_SKIP = ("indices", "_ids", "aggregated", "soft_labels")
_CHUNKS = 64


def dominant_classes(class_counts: np.ndarray) -> np.ndarray:
    """Each client's most frequent class (lowest index on ties)."""
    return np.asarray(class_counts).argmax(axis=1)


def _chunk_mean(v: np.ndarray, n: int = _CHUNKS) -> np.ndarray:
    """The means of ``v``'s ``n`` consecutive chunks as ``np.array_split`` cuts them (the first
    ``size % n`` one longer), in one ``reduceat``: a Python mean per chunk was 24,000 calls and
    0.4 s of a FLiP audit."""
    v = v.ravel()
    if v.size <= n:
        return v
    q, r = divmod(v.size, n)
    at = np.arange(n)
    sizes = q + (at < r)
    return np.add.reduceat(v, at * q + np.minimum(at, r)) / sizes


def _summarise(a: np.ndarray, fed) -> np.ndarray:
    """A fixed-size feature vector for one client's artifact array."""
    a = np.asarray(a, dtype=np.float64)
    c = fed.num_classes
    if a.ndim == 1 and a.size == len(fed.distill) and fed.public.num_classes == c:
        # certainty scores over the distillation set: label histogram of the top-scored points
        k = max(1, a.size // 20)
        top = fed.public.y[fed.distill][np.argsort(-a, kind="stable")[:k]]
        return np.r_[np.bincount(top, minlength=c) / k, a.mean(), a.std()]
    if a.ndim == 2 and a.shape[1] == c:
        # soft labels / label logits: mean row and histogram of the arg-max
        return np.r_[a.mean(0), np.bincount(a.argmax(1), minlength=c) / len(a)]
    if a.size <= _CHUNKS:
        return a.ravel()
    return _chunk_mean(a.mean(0) if a.ndim >= 2 else a)


def client_artifacts(artifacts: dict, num_clients: int) -> dict[int, dict[str, np.ndarray]]:
    """Per-client artifacts: keys ``name/client_i`` and top-level arrays with one row per client."""
    out: dict[int, dict[str, np.ndarray]] = {i: {} for i in range(num_clients)}
    for key in sorted(artifacts):
        if any(s in key for s in _SKIP):
            continue
        m = _CLIENT_KEY.match(key)
        if m:
            i = int(m.group("i"))
            if i < num_clients:
                out[i][m.group("name")] = np.asarray(artifacts[key])
        elif np.ndim(artifacts[key]) >= 2 and np.shape(artifacts[key])[0] == num_clients:
            for i in range(num_clients):
                out[i][key] = np.asarray(artifacts[key])[i]
    return out


def client_artifact_features(artifacts: dict, fed) -> np.ndarray | None:
    """(num_clients, d) features from the per-client artifacts, or None if there are none.

    Clients without an artifact (inactive in the last round) get zeros for that artifact.
    """
    per = client_artifacts(artifacts, fed.num_clients)
    keys = sorted({k for d in per.values() for k in d})
    if not keys:
        return None
    cols = []
    for k in keys:
        ref = next(per[i][k] for i in per if k in per[i])
        width = _summarise(ref, fed).size
        cols.append(
            np.stack(
                [
                    _summarise(per[i][k], fed) if k in per[i] else np.zeros(width)
                    for i in range(fed.num_clients)
                ]
            )
        )
    return np.concatenate(cols, axis=1)


def soft_label_artifacts(client_models: list, fed, max_points: int = 512) -> dict[str, np.ndarray]:
    """Soft labels each party model gives on (a fixed prefix of) the public data: what FedMD
    parties share each round, reconstructed from the released party models. The party MLPs and
    CNNs of an architecture run in one stacked forward pass (:func:`~privkit.batched.many_fedmd.
    stacked_party_logits`: equal to their own up to float rounding; it reads their parameters
    only, and runs any other model on its own, leaving its device and mode as they were): one
    module at a time this took 22 ms a run, 0.37 s of a FedMD audit."""
    from attacks.signals import probabilities
    from privkit.batched.many_fedmd import stacked_party_logits

    if not client_models or len(client_models) != fed.num_clients:
        return {}
    x, _ = fed.public_arrays("distill")
    logits = stacked_party_logits(client_models, x[:max_points])
    return {
        f"party_predictions/client_{i}": probabilities(z).astype(np.float32)
        for i, z in enumerate(logits)
    }


# ------------------------------------------------------------------------------ FLiP Table II
def binary_federation(fed, positive: int, negative: int, name: str):
    """The federation restricted to classes ``positive`` (label 1) and ``negative`` (label 0).

    Clients keep their own records of the two classes; test set and shadow pool are restricted
    the same way. Used for FLiP's binary tasks psi_{p-s}.
    """
    from privkit.data import ArrayDataset, Federation

    y = fed.private.y
    keep = np.nonzero((y == positive) | (y == negative))[0]
    new_index = -np.ones(len(y), dtype=np.int64)
    new_index[keep] = np.arange(keep.size)
    ds = ArrayDataset(
        name=f"{fed.private.name}[{positive}v{negative}]",
        x=fed.private.x[keep],
        y=(y[keep] == positive).astype(np.int64),
        num_classes=2,
    )
    sub = lambda idx: new_index[idx[np.isin(idx, keep)]]
    return Federation(
        config=fed.config,
        private=ds,
        public=fed.public,
        clients=[sub(c) for c in fed.clients],
        test=sub(fed.test),
        shadow_pool=sub(fed.shadow_pool),
        distill=fed.distill,
        negative=fed.negative,
        name=name,
    )


def _train_flip(args) -> dict:
    fed, cfg, seed = args
    from privkit.trainers import train

    res = train("flip", fed, cfg, seed=seed)
    return {k: v for k, v in res.artifacts.items() if k.startswith("distilled_x")}


def table2_classifier(attack: dict, random_state: int):
    """The psi_{s1-s2} attacker of a FLiP attack config (``attack`` field of the trainer config):
    CatBoost (depth, iterations as configured; the paper's: 1 and 10 000) or "logreg"."""
    if attack.get("table2_classifier", "catboost") == "logreg":
        return "logreg"
    from attacks.mia import _catboost

    return _catboost(
        int(attack.get("catboost_iterations", 10_000)),
        int(attack.get("catboost_depth", 1)),
        None,
        random_state,
        1,
    )


def flip_table2_attack(
    fed,
    trainer_config: dict,
    *,
    p1: int,
    p2: int,
    s1: int,
    s2: int,
    seed: int = 0,
    executor: str = "serial",
    alpha: float = 0.05,
) -> AttributeResult:
    """FLiP's task-irrelevant attribute attack (Sec. V-A, Table II) on the shared distilled samples.

    Runs the binary FLiP tasks (p1,s1), (p1,s2), (p2,s1), (p2,s2); trains an s1-vs-s2 classifier
    psi on the distilled samples the clients shared in the p1 runs (label = the run's negative
    class) and tests it on those of the p2 runs. Accuracy near 50 % = no leakage. The trainer
    config's ``attack`` field says which releases and which attacker (the paper's: every round's
    release, CatBoost depth 1 with 10 000 iterations). Samples of one run are not independent, so
    the interval is optimistic about the sample size.
    """
    from attacks.executor import get_executor
    from privkit.seeding import child_seeds

    if len({p1, p2, s1, s2}) != 4:
        raise ValueError(f"p1, p2, s1, s2 must be four distinct classes; found {p1, p2, s1, s2}")
    attack = dict(trainer_config.get("attack") or {})
    cfg = dict(trainer_config)
    if attack.get("table2_rounds", "all") == "all":
        cfg["record_every"] = 1  # keep every round's upload, not only the last
    pairs = [(p1, s1), (p1, s2), (p2, s1), (p2, s2)]
    seeds = child_seeds(seed, 4, "flip-table2")
    tasks = [
        (binary_federation(fed, p, s, f"flip-{p}v{s}"), dict(cfg), sd)
        for (p, s), sd in zip(pairs, seeds)
    ]
    arts = get_executor(executor).map(_train_flip, tasks, description="FLiP binary runs")

    def samples(a: dict) -> np.ndarray:
        if not a:
            raise ValueError(
                "FLiP run shared no distilled samples (artifacts distilled_x*/client_i)"
            )
        return np.concatenate([v.reshape(len(v), -1) for _, v in sorted(a.items())])

    xs = [samples(a) for a in arts]
    x_tr, y_tr = np.concatenate(xs[:2]), np.r_[np.zeros(len(xs[0])), np.ones(len(xs[1]))]
    x_te, y_te = np.concatenate(xs[2:]), np.r_[np.zeros(len(xs[2])), np.ones(len(xs[3]))]
    att = AttributeInferenceAttack(classifier=table2_classifier(attack, seed), random_state=seed)
    att.fit(x_tr, y_tr)
    which = "every round's" if cfg.get("record_every") == 1 else "the last round's"
    res = att.evaluate(
        x_te,
        y_te,
        alpha=alpha,
        chance=0.5,
        notes=(
            f"FLiP Table II protocol: psi_s1-s2 ({attack.get('table2_classifier', 'catboost')}) "
            f"trained on {which} distilled samples of runs ({p1},{s1}),({p1},{s2}); tested "
            f"on ({p2},{s1}),({p2},{s2}); {len(y_te)} test samples from 2 runs "
            "(not independent)"
        ),
    )
    return replace(res)
