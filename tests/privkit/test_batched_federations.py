"""Batched federations (privkit.batched.many): many runs of a method as one computation give each
run what it gives alone.

In reproducible-noise mode every model of the batch draws its Poisson batches and noise from the
streams the single run draws them from, so the released weights must agree with
``train(method, ...)``'s up to float rounding (at most 1e-5), and so must everything decided from
them between rounds (client sampling, budget stops, ledgers). The audit takes the batched path on
the serial executor: its logits must be the loop's.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from audit_helpers import TINY_DPFED, TINY_FEDAVG, TINY_FEDMD, max_diff, subset_federations

from attacks.executor import SerialExecutor
from attacks.experiment import train_models
from privkit.audit.recipes import FederationRecipe
from privkit.batched.many import has_batched, train_many
from privkit.data import FederationConfig, build_federation
from privkit.methods.contract import make_config
from privkit.trainers import train

TOL = 1e-5
DPFED = {**TINY_DPFED, "reproducible_noise": True}
FEDAVG = {**TINY_FEDAVG, "reproducible_noise": True}
FEDMD = {**TINY_FEDMD, "reproducible_noise": True}
CASES = {
    "dp-fedavg": DPFED,
    # a budget that stops runs at different rounds (their clients hold different amounts of data)
    "dp-fedavg budget": {**DPFED, "rounds": 6, "target_epsilon": 4.0},
    "fedkadp": {**DPFED, "rounds": 4},
    "fedkadp adam": {**DPFED, "optimizer": "adam", "lr": 0.01, "feedback": False},
    # the single run forms each record's joint mentor+mentee+W_h gradient with torch.func
    "fedkd-dp": {**DPFED, "mentor_feature_dim": 24},
    "fedkd-dp deep-mentor": {
        **DPFED,
        "mentor_feature_dim": 24,
        "mentor_depth": 2,
        "hidden_loss": False,
        "compress": False,
    },
    # Adam (these methods' optimiser) amplifies float rounding: the batched path is bit for bit
    "fedavg": FEDAVG,
    "fedavg sgd": {**FEDAVG, "optimizer": "sgd", "lr": 0.1},
    "fedavg frozen": {
        **FEDAVG,
        "pretrain": True,
        "freeze": True,
        "pretrain_epochs": 1,
        "pretrain_seed": 0,
    },
    "fedprox": {**FEDAVG, "mu": 0.1},
    "feddf": {**FEDAVG, "distill_epochs": 1, "distill_lr": 1e-3},
    "fedaux": {
        **FEDAVG,
        "distill_epochs": 1,
        "distill_lr": 1e-3,
        "pretrain_epochs": 1,
        "pretrain_seed": 0,
    },
    "fedmd-nfdp": {**FEDMD, "k": 8},
    "fedmd-np": FEDMD,
    "fedmd-np logits": {**FEDMD, "knowledge": "logits"},  # an L1 digest: those jobs one at a time
    "fedmd-ldp": FEDMD,
    # opacus' streams and clipping rule, per-example norms from the layers (opacus forms them)
    "dpsgd": {
        "arch": "mlp",
        "feature_dim": 16,
        "epochs": 2,
        "batch_size": 64,
        "lr": 0.5,
        "device": "cpu",
        "calibration_accountant": "rdp",
        "reproducible_noise": True,
    },
    "dpsgd given-sigma": {
        "arch": "mlp",
        "feature_dim": 16,
        "epochs": 1,
        "batch_size": 200,
        "lr": 0.5,
        "noise_multiplier": 0.8,
        "clip_norm": 0.5,
        "device": "cpu",
        "reproducible_noise": True,
    },
}
EXACT = (
    "fedavg",
    "fedprox",
    "feddf",
    "fedaux",
    "fedmd-nfdp",
    "fedmd-np",
    "fedmd-ldp",
)  # methods whose batched runs equal the single runs bit for bit


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))


def _federations(fed, n: int, seed: int = 0):
    """``n`` federations like ``fed`` over random 80% subsets of its client records."""
    return subset_federations(fed, n, 0.8, seed)


_max_diff = max_diff


@pytest.mark.parametrize("case", list(CASES))
def test_batched_runs_equal_single_runs(fed, case):
    method, cfg = case.split()[0], CASES[case]
    assert has_batched(method)
    feds, seeds = _federations(fed, 3), [11, 12, 13]
    torch.set_num_threads(1)
    alone = [train(method, f, cfg, seed=s) for f, s in zip(feds, seeds)]
    many = train_many(method, feds, cfg, seeds)
    tol = 0.0 if method in EXACT else TOL
    for a, b in zip(alone, many):
        assert _max_diff(a.model, b.model) <= tol
        assert len(a.client_models) == len(b.client_models)
        assert all(_max_diff(p, q) <= tol for p, q in zip(a.client_models, b.client_models))
        assert [r.get("clients") for r in a.rounds] == [r.get("clients") for r in b.rounds]
        if method in EXACT:  # losses and accuracies of every round too
            assert a.rounds == b.rounds and a.artifacts.keys() == b.artifacts.keys()
        assert a.ledger.to_dict() == b.ledger.to_dict()
        assert a.claims.get("stop") == b.claims.get("stop")
        assert a.test_accuracy == pytest.approx(b.test_accuracy, abs=2e-3)
        assert b.reproducible_noise and a.warnings == b.warnings
    if case == "dp-fedavg budget":  # the budget stops the runs, not all at the last round
        assert {len(r.rounds) for r in alone} != {6}


def test_federated_runs_gather_each_clients_records_once(fed, monkeypatch):
    """FedAvg's batched runs (a release-mode target and reference runs) keep each client's
    records from round to round, where ``Federation.client_arrays`` gathers a fresh copy at
    every call: one call per run and client, however many rounds select it (the runs' results
    are pinned to their single runs' above)."""
    from privkit.data import Federation

    calls: list[tuple[int, int]] = []
    original = Federation.client_arrays

    def counted(self, i):
        calls.append((id(self), i))
        return original(self, i)

    monkeypatch.setattr(Federation, "client_arrays", counted)
    cfg = {**CASES["fedavg"], "rounds": 4, "reproducible_noise": False}
    runs = train_many(
        "fedavg", _federations(fed, 3), cfg, [1, 2, 3], references=[False, True, True]
    )
    trained = sum(row["clients"] for r in runs for row in r.rounds)  # clients a round, summed
    assert len(calls) == len(set(calls)) < trained  # some clients trained in several rounds


def test_dpsgd_with_adam_trains_one_run_after_the_other(fed, monkeypatch):
    from privkit.batched import many_dpsgd

    cfg = {**CASES["dpsgd"], "optimizer": "adam", "lr": 0.01}
    assert not many_dpsgd.batchable(make_config("dpsgd", cfg))
    feds = _federations(fed, 2)
    alone = [train("dpsgd", f, cfg, seed=s) for f, s in zip(feds, [1, 2])]
    many = train_many("dpsgd", feds, cfg, [1, 2])
    assert all(_max_diff(a.model, b.model) == 0 for a, b in zip(alone, many))


def test_dpsgd_reference_runs_of_two_noise_scales_come_back_in_the_callers_order(fed):
    """An audit's reference runs of two sizes calibrate two noise scales and draw their noise in
    two groups, stacked group by group: whether the caller interleaves the groups or not, each
    run comes back in its own place, bit for bit, with its rounds and ledger."""
    big, small = fed, fed.with_clients([c[: len(c) * 4 // 5] for c in fed.clients], "small")
    cfg = {**CASES["dpsgd"], "reproducible_noise": False}  # references: seeded, drawn together
    refs = [True] * 5
    mixed = train_many(
        "dpsgd", [big, small, big, small, big], cfg, [1, 2, 3, 4, 5], references=refs
    )
    grouped = train_many(
        "dpsgd", [big, big, big, small, small], cfg, [1, 3, 5, 2, 4], references=refs
    )
    assert len({r.claims["noise_multiplier"] for r in mixed}) == 2
    by_seed = dict(zip([1, 3, 5, 2, 4], grouped))
    for seed, run in zip([1, 2, 3, 4, 5], mixed):
        twin = by_seed[seed]
        assert _max_diff(run.model, twin.model) == 0 and run.rounds == twin.rounds
        assert run.ledger.to_dict() == twin.ledger.to_dict()
    assert min(_max_diff(a.model, b.model) for a, b in itertools.pairwise(mixed)) > 0


def test_release_mode_batched_runs_draw_secret_noise(fed):
    feds = _federations(fed, 2)
    cfg = {**DPFED, "reproducible_noise": False}
    a = train_many("dp-fedavg", feds, cfg, [5, 5])
    b = train_many("dp-fedavg", feds[:1], cfg, [5])
    # same seed and data: same client sampling and ledger, different secret noise
    assert a[0].ledger.to_dict() == b[0].ledger.to_dict()
    assert _max_diff(a[0].model, b[0].model) > 1e-3
    assert not a[0].reproducible_noise


def test_audit_trains_its_runs_batched_with_the_loops_outputs(fed):
    recipe = FederationRecipe(fed, "dp-fedavg", DPFED)
    assert recipe.batched
    x, y = fed.private.x[fed.members], fed.private.y[fed.members]
    rng = np.random.default_rng(1)
    sets = [np.sort(rng.choice(len(y), int(0.7 * len(y)), replace=False)) for _ in range(3)]
    query = np.arange(50)
    batched, d1 = train_models(
        recipe, x, y, sets, [1, 2, 3], query=query, n_classes=fed.num_classes
    )
    loop, d2 = train_models(
        recipe,
        x,
        y,
        sets,
        [1, 2, 3],
        query=query,
        n_classes=fed.num_classes,
        executor=SerialExecutor(),
    )
    assert batched.shape == loop.shape == (3, 50, fed.num_classes)
    assert np.abs(batched - loop).max() <= 1e-4
    assert [d["ledger"].to_dict() for d in d1] == [d["ledger"].to_dict() for d in d2]
