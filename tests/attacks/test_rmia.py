"""RMIA: definition (against a brute-force N x Z computation), power on planted signals with few
reference models, chance on null data, memory without an N x Z matrix, estimator contract."""

import tracemalloc

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError

from attacks.metrics import auc
from attacks.rmia import RMIA

C = 4


def _logits(rng, difficulty, included, labels, signal):
    """Logits whose true-label logit is difficulty + signal * included + model noise."""
    conf = difficulty + signal * included + 0.5 * rng.standard_normal(included.shape)
    out = 0.3 * rng.standard_normal(included.shape + (C,))
    np.put_along_axis(
        out, np.broadcast_to(labels, included.shape)[..., None], conf[..., None], axis=-1
    )
    return out


def world(seed, refs, n=2000, z=1000, signal=1.0, all_out=False):
    """Reference models on random halves (or none of the audit points), a target, population data.

    Examples differ in difficulty (spread 2), which a bare confidence threshold cannot tell from
    membership; reference models can.
    """
    rng = np.random.default_rng(seed)
    dx, dz = 2.0 * rng.standard_normal(n), 2.0 * rng.standard_normal(z)
    y, yz = rng.integers(0, C, n), rng.integers(0, C, z)
    keep = np.zeros((refs, n), bool) if all_out else rng.random((refs, n)) < 0.5
    member = rng.random(n) < 0.5
    return {
        "ref": _logits(rng, dx, keep, y, signal),
        "labels": y,
        "keep": keep,
        "ref_z": _logits(rng, dz, np.zeros((refs, z), bool), yz, signal),
        "labels_z": yz,
        "target": _logits(rng, dx, member, y, signal),
        "target_z": _logits(rng, dz, np.zeros(z, bool), yz, signal),
        "member": member,
    }


def run(w, **params):
    att = RMIA(**params).fit(
        w["ref"],
        w["labels"],
        w["keep"],
        population_logits=w["ref_z"],
        population_labels=w["labels_z"],
    )
    return att.score_samples(w["target"], w["labels"], population_logits=w["target_z"])


def raw_confidence_auc(w):
    return auc(w["target"][np.arange(w["labels"].size), w["labels"]], w["member"])


# ------------------------------------------------------------------------------ definition
@pytest.mark.parametrize("online,gamma", [(True, 1.0), (True, 2.0), (False, 2.0), (False, 1.5)])
def test_matches_the_pairwise_definition(online, gamma):
    w = world(0, refs=3, n=300, z=200)
    got = run(w, online=online, gamma=gamma)
    # brute force: P(x|theta)/P(x) over P(z|theta)/P(z), for every pair, with P(.) from fit
    att = RMIA(online=online, gamma=gamma).fit(
        w["ref"],
        w["labels"],
        w["keep"],
        population_logits=w["ref_z"],
        population_labels=w["labels_z"],
    )

    def prob(lg, lb):
        e = np.exp(lg - lg.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True))[np.arange(lb.size), lb]

    rx = prob(w["target"], w["labels"]) / att.marginal_x_
    rz = prob(w["target_z"], w["labels_z"]) / att.marginal_z_
    lr = rx[:, None] / rz[None, :]
    np.testing.assert_allclose(got, (lr >= gamma).mean(axis=1), atol=1e-12)


def test_marginals_follow_the_paper():
    w = world(1, refs=4, n=50, z=30)
    p = np.exp(w["ref"][..., :] - np.log(np.exp(w["ref"]).sum(-1, keepdims=True)))
    p = np.take_along_axis(p, np.broadcast_to(w["labels"], p.shape[:2])[..., None], -1)[..., 0]
    keep = w["keep"]
    both = keep.any(0) & (~keep).any(0)
    online = RMIA(online=True).fit(
        w["ref"], w["labels"], keep, population_logits=w["ref_z"], population_labels=w["labels_z"]
    )
    p_in = (p * keep).sum(0) / np.maximum(keep.sum(0), 1)
    p_out = (p * ~keep).sum(0) / np.maximum((~keep).sum(0), 1)
    np.testing.assert_allclose(online.marginal_x_[both], ((p_in + p_out) / 2)[both], rtol=1e-12)
    assert online.n_approximated_ == int((~both).sum())
    offline = RMIA(online=False, offline_a=0.3).fit(
        w["ref"], w["labels"], keep, population_logits=w["ref_z"], population_labels=w["labels_z"]
    )
    has_out = (~keep).any(0)
    np.testing.assert_allclose(
        offline.marginal_x_[has_out], (1.3 * p_out[has_out] + 0.7) / 2, rtol=1e-12
    )


# ------------------------------------------------------------------------------ power and chance
def test_online_beats_chance_with_a_clear_margin():
    aucs = [auc(run(world(s, refs=8)), world(s, refs=8)["member"]) for s in range(3)]
    assert min(aucs) > 0.75


@pytest.mark.parametrize("refs,all_out", [(1, True), (2, True), (2, False)])
def test_offline_with_one_or_two_reference_models(refs, all_out):
    for s in range(3):
        w = world(s, refs=refs, all_out=all_out)
        a = auc(run(w, online=False), w["member"])
        # beats chance, and beats the threshold attack that cannot see difficulty
        assert a > 0.62 and a > raw_confidence_auc(w) + 0.03


@pytest.mark.parametrize("online", [True, False])
def test_null_data_gives_chance(online):
    aucs = np.array(
        [
            auc(
                run(world(s, refs=4, n=1000, z=500, signal=0.0), online=online),
                world(s, refs=4, n=1000, z=500, signal=0.0)["member"],
            )
            for s in range(20)
        ]
    )
    se = np.sqrt((1000 / 2 + 1000 / 2 + 1) / (12 * 500 * 500))  # Mann-Whitney SE at AUC 0.5
    assert abs(aucs.mean() - 0.5) < 4 * se / np.sqrt(20)
    assert np.all(np.abs(aucs - 0.5) < 4.5 * se)


# ------------------------------------------------------------------------------ memory
def test_large_population_without_an_n_by_z_matrix():
    n, z = 300_000, 100_000  # an N x Z float matrix would take 240 GB
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((1, n, 2)).astype(np.float32)
    labels = rng.integers(0, 2, n)
    ref_z = rng.standard_normal((1, z, 2)).astype(np.float32)
    labels_z = rng.integers(0, 2, z)
    att = RMIA(online=False).fit(
        ref, labels, np.zeros((1, n), bool), population_logits=ref_z, population_labels=labels_z
    )
    target, target_z = rng.standard_normal((n, 2)), rng.standard_normal((z, 2))
    tracemalloc.start()
    scores = att.score_samples(target, labels, population_logits=target_z)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert scores.shape == (n,) and np.all((scores >= 0) & (scores <= 1))
    assert peak < 40 * n * 8  # a few O(N) arrays, nothing of size N x Z


# ------------------------------------------------------------------------------ contract
def test_estimator_contract():
    w = world(4, refs=2, n=100, z=50)
    att = RMIA(online=False, offline_a=0.5, gamma=1.0)
    assert clone(att).get_params() == {
        "online": False,
        "offline_a": 0.5,
        "gamma": 1.0,
        "temperature": 1.0,
    }
    with pytest.raises(NotFittedError):
        att.score_samples(w["target"], w["labels"], population_logits=w["target_z"])
    assert (
        att.fit(
            w["ref"],
            w["labels"],
            w["keep"],
            population_logits=w["ref_z"],
            population_labels=w["labels_z"],
        )
        is att
    )


@pytest.mark.parametrize(
    "params,kwargs,match",
    [
        ({"offline_a": 0.0}, {}, "offline_a must be in"),
        ({"gamma": 0.5}, {}, "gamma must be >= 1"),
        ({"temperature": 0.0}, {}, "temperature must be > 0"),
        ({}, {"keep": np.zeros((2, 99), bool)}, "keep must have shape"),
        ({}, {"population_keep": np.zeros((2, 3), bool)}, "population_keep must have shape"),
    ],
)
def test_bad_input(params, kwargs, match):
    w = world(5, refs=2, n=100, z=50)
    args = {"keep": w["keep"], **kwargs}
    with pytest.raises(ValueError, match=match):
        RMIA(**params).fit(
            w["ref"],
            w["labels"],
            args.pop("keep"),
            population_logits=w["ref_z"],
            population_labels=w["labels_z"],
            **args,
        )
