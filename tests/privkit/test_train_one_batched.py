"""A single run through the batched engine (privkit.batched.many.train_one): what ``privkit train``
and ``privkit run`` take for a method with a batched form, on every device (issue 32).

Its result must be the loop's (:func:`privkit.trainers.train`): bit for bit for the Adam methods,
up to float rounding for the DP-SGD methods in reproducible-noise mode, with the same ledger,
client models and rounds (``test_batched_federations.py`` pins the same for many runs).
"""

from __future__ import annotations

import pytest
import torch
from audit_helpers import TINY_DPFED, TINY_FEDAVG, TINY_FEDMD, max_diff

from privkit.batched import many
from privkit.data import FederationConfig, build_federation
from privkit.flower_engine import engine
from privkit.trainers import train

DPFED = {**TINY_DPFED, "reproducible_noise": True}
FEDAVG = {**TINY_FEDAVG, "reproducible_noise": True}
FEDMD = {**TINY_FEDMD, "reproducible_noise": True}


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))


def _as_if_on_gpu(monkeypatch) -> None:
    """select_device answers ``cuda`` for every spec (only the choice asks it: the trainers
    resolve their device through their own import, which stays on the CPU)."""
    import privkit.models

    monkeypatch.setattr(privkit.models, "select_device", lambda spec="auto": torch.device("cuda"))


def test_every_device_takes_the_batched_engine_where_a_method_has_one(monkeypatch):
    assert many.trains_batched_alone("dp-fedavg", DPFED)
    assert many.trains_batched_alone("fedavg", FEDAVG)
    _as_if_on_gpu(monkeypatch)
    assert many.trains_batched_alone("dp-fedavg", DPFED)
    # no batched form, or one that batches an audit's reference runs only: the loop
    for method in ("fedauxfdp", "dp-fedavg-client", "centralized", "flip"):
        assert not many.trains_batched_alone(method, None)


@pytest.mark.parametrize(
    ("method", "cfg", "tol"),
    [
        ("dp-fedavg", DPFED, 1e-5),
        ("fedkadp", DPFED, 1e-5),
        ("fedavg", FEDAVG, 0.0),
        ("fedprox", {**FEDAVG, "mu": 0.1}, 0.0),
        ("fedmd-np", FEDMD, 0.0),
    ],
)
def test_engine_trains_one_run_batched_with_the_single_runs_result(
    fed, monkeypatch, method, cfg, tol
):
    torch.set_num_threads(1)
    alone = train(method, fed, cfg, seed=3)
    called = []
    real = many.train_many
    monkeypatch.setattr(many, "train_many", lambda *a, **k: called.append(a) or real(*a, **k))
    one = engine.train(method, fed, cfg, seed=3)
    assert len(called) == 1 and len(called[0][1]) == 1  # the batched engine, one run
    assert max_diff(alone.model, one.model) <= tol
    assert all(max_diff(p, q) <= tol for p, q in zip(alone.client_models, one.client_models))
    assert alone.ledger.to_dict() == one.ledger.to_dict()
    assert [r.get("clients") for r in alone.rounds] == [r.get("clients") for r in one.rounds]
    if tol == 0.0:  # the Adam methods: every round's losses and accuracies too
        assert alone.rounds == one.rounds
    assert one.reproducible_noise and one.warnings == alone.warnings


def test_engine_trains_a_method_without_a_batched_form_by_the_loop(fed, monkeypatch):
    called = []
    monkeypatch.setattr(many, "train_many", lambda *a, **k: called.append(a))
    cfg = {"feature_dim": 16, "rounds": 2, "device": "cpu", "reproducible_noise": True}
    one = engine.train("dp-fedavg-client", fed, cfg, seed=3)
    assert not called
    assert max_diff(train("dp-fedavg-client", fed, cfg, seed=3).model, one.model) == 0.0


def test_progress_advances_once_a_round(fed, monkeypatch):
    advanced = []
    import rich.progress

    class Bar(rich.progress.Progress):
        def advance(self, task, advance=1.0):
            advanced.append(advance)
            super().advance(task, advance)

    monkeypatch.setattr(rich.progress, "Progress", Bar)
    result = many.train_one("dp-fedavg", fed, DPFED, 0, progress=True)
    assert len(advanced) == len(result.rounds) == DPFED["rounds"]
    # outside train_one no bar is advanced
    many.train_many("dp-fedavg", [fed], DPFED, [0])
    assert len(advanced) == DPFED["rounds"]


def test_progress_of_dpsgd_advances_once_an_epoch(fed, monkeypatch):
    advanced, totals = [], []
    import rich.progress

    class Bar(rich.progress.Progress):
        def add_task(self, description, total=None, **kw):
            totals.append((description, total))
            return super().add_task(description, total=total, **kw)

        def advance(self, task, advance=1.0):
            advanced.append(advance)
            super().advance(task, advance)

    monkeypatch.setattr(rich.progress, "Progress", Bar)
    cfg = {
        "arch": "mlp",
        "feature_dim": 16,
        "epochs": 3,
        "batch_size": 64,
        "lr": 0.5,
        "device": "cpu",
        "noise_multiplier": 1.0,
        "clip_norm": 1.0,
        "reproducible_noise": True,
    }
    result = many.train_one("dpsgd", fed, cfg, 0, progress=True)
    assert totals == [("dpsgd epochs (batched)", 3)]
    assert len(advanced) == len(result.rounds) == 3
