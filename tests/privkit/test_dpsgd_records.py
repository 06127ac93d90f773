"""Centralised DP-SGD's stacked runs gather every step's batches from their records held once.

``privkit.batched.many_dpsgd._Records``: the runs' records (each distinct record set once) with a
zero record after them, a step's batches of all runs gathered in one pass. Checked here: the
records held are the runs' union and nothing else; a run drawn alone (an audit's target run) gets
exactly its own stream's batch of its pooled records (opacus' loader's; a record its clients
share, twice), labels and squared norms with it, zeros past it; the seeded reference runs'
batches, drawn together, are records of their own runs at their own rates (each record's
inclusion frequency), and a run past its last step gets an empty batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privkit.batched.many_dpsgd import _Records, _Run
from privkit.data import FederationConfig, build_federation
from privkit.methods.contract import make_config
from privkit.seeding import noise_generator

CONFIG = {"arch": "mlp", "feature_dim": 8, "epochs": 1, "batch_size": 50, "noise_multiplier": 1.0}


@pytest.fixture(scope="module")
def feds():
    """One federation and two with other clients' records (as an audit's reference runs')."""
    fed = build_federation(FederationConfig(partition="shards", clients=20, seed=0))
    rng = np.random.default_rng(0)
    members = fed.members
    others = [
        fed.with_clients(
            np.array_split(np.sort(rng.choice(members, size, replace=False)), 4), f"ref{size}"
        )
        for size in (900, 1500)
    ]
    # clients that share records: a record twice in the pooled records (pooled_arrays keeps both)
    some = np.sort(rng.choice(members, 700, replace=False))
    shared = fed.with_clients([some, some[:200], some[500:]], "overlapping")
    return [fed, *others, shared]


def _runs(feds, order: list[int], **config) -> list[_Run]:
    cfg = make_config("dpsgd", {**CONFIG, **config, "reproducible_noise": True})
    return [_Run(feds[i], cfg, seed, torch.device("cpu")) for seed, i in enumerate(order)]


def test_the_records_some_run_trains_on_are_held_once(feds):
    runs = _runs(feds, [1, 2, 1])
    records = _Records(runs, [False, True, True], torch.device("cpu"))
    union = np.unique(np.concatenate([feds[1].members, feds[2].members]))
    private = feds[0].private
    assert len(union) < len(private)  # the test records and others no run trains on
    assert torch.equal(records.x[:-1], torch.as_tensor(private.x[union]))
    assert not records.x[-1].any() and records.y[-1] == 0
    assert torch.equal(records.in_use(), records.x[:-1])


def test_a_run_drawn_alone_gets_its_own_streams_batch_of_its_pooled_records(feds):
    members = feds[3].members
    assert len(members) > len(np.unique(members))  # records twice in its pooled records
    runs = _runs(feds, [0, 1, 2, 3])
    records = _Records(runs, [False] * 4, torch.device("cpu"))
    records.with_norms()
    twins = _runs(feds, [0, 1, 2, 3])  # the same streams, drawn one run at a time
    pooled = [f.pooled_arrays() for f in feds]
    scratch: dict = {}
    for t in range(5):
        counts, xb, yb, nb = records.batches(t, [0, 1, 2, 3], scratch)
        for j, twin in enumerate(twins):
            own = twin.batch(t).numpy()
            assert counts[j] == len(own)
            x, y = pooled[j]
            assert torch.equal(xb[j, : len(own)], torch.as_tensor(x[own]))
            assert torch.equal(yb[j, : len(own)], torch.as_tensor(y[own], dtype=torch.long))
            assert torch.equal(nb[j, : len(own)], torch.as_tensor(x[own]).flatten(1).pow(2).sum(-1))
            assert not xb[j, len(own) :].any() and not nb[j, len(own) :].any()


def test_reference_runs_drawn_together_sample_their_own_records_at_their_rates(feds):
    runs = _runs(feds, [0, 1, 2, 1], epochs=12)  # 216 steps of the smallest
    records = _Records(runs, [False, True, True, True], torch.device("cpu"))
    assert records.joint is not None and records.joint.positions == [1, 2, 3]
    records.with_norms()
    pooled = [feds[i].pooled_arrays()[0].reshape(-1, 784) for i in (0, 1, 2, 1)]
    # each record by its pixels: a gathered row is one of its own run's records
    where = [{r.tobytes(): k for k, r in enumerate(x)} for x in pooled]
    hits = [np.zeros(len(x)) for x in pooled]
    scratch: dict = {}
    for t in range(max(r.steps for r in runs)):
        live = [j for j, r in enumerate(runs) if t < r.steps]
        counts, xb, _, nb = records.batches(t, live, scratch)
        for j in range(1, 4):
            if j not in live:
                assert counts[j] == 0
                continue
            rows = xb[j, : counts[j]].reshape(counts[j], -1).numpy()
            got = [where[j][r.tobytes()] for r in rows]  # KeyError: a record not its run's
            assert len(set(got)) == len(got)
            hits[j][got] += 1
            assert torch.equal(nb[j, : counts[j]], xb[j, : counts[j]].flatten(1).pow(2).sum(-1))
    for j in range(1, 4):
        q, steps = runs[j].rate, runs[j].steps
        # every record at its run's rate (5 standard errors; a false alarm ~1e-4 over all)
        assert np.abs(hits[j] / steps - q).max() < 5 * np.sqrt(q * (1 - q) / steps)
        # and on average over the records (tells a rate 5% off apart)
        n = len(hits[j])
        assert abs(hits[j].mean() / steps - q) < 5 * np.sqrt(q * (1 - q) / (steps * n))
    # two runs with the same records but their own draws: their batches differ
    assert not np.array_equal(hits[1], hits[3])


def test_a_reference_run_past_its_last_step_gets_an_empty_batch(feds):
    runs = _runs(feds, [0, 1, 2])  # 900 and 1,500 records: 18 and 30 steps of 50
    assert runs[1].steps < runs[2].steps
    records = _Records(runs, [False, True, True], torch.device("cpu"))
    scratch: dict = {}
    t = runs[1].steps
    counts, *_ = records.batches(t, [0, 2], scratch)
    assert counts[1] == 0 and counts[2] > 0


def test_reference_runs_without_seeded_streams_draw_alone(feds):
    runs = _runs(feds, [0, 1, 2])
    runs[2].batches = noise_generator(2, "poisson", reproducible=False)
    records = _Records(runs, [False, True, True], torch.device("cpu"))
    assert records.joint is None and records.alone == [0, 1, 2]
