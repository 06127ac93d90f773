"""Every Gaussian mechanism privkit runs releases on the grid in release mode (privkit.mechanisms.grid_noise).

Each release-mode path is run with float normals from the secret stream forbidden
(``DpRandom.randn`` raises unless it is the seeded torch generator) and every snapping to the grid
checked: the released floats are multiples of the grid step (a float32 or float64 rounding of a
multiple of a power of two ``gamma`` is one, its spacing there being ``gamma`` or a larger power of
two).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import TINY_DPFED

from privkit.batched import batched_sgd
from privkit.batched.many import train_many
from privkit.data import FederationConfig, build_federation
from privkit.mechanisms import grid_noise
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.output_perturbation import gaussian_output_perturbation
from privkit.seeding import noise_rng
from privkit.trainers import train

DPFED = {**TINY_DPFED, "rounds": 2, "local_steps": 2, "reproducible_noise": False}
DPSGD = {
    "arch": "mlp",
    "feature_dim": 16,
    "epochs": 1,
    "batch_size": 64,
    "lr": 0.5,
    "device": "cpu",
    "noise_multiplier": 1.0,
    "reproducible_noise": False,
}


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="shards", clients=20, seed=0))


@pytest.fixture
def grid(monkeypatch):
    """Counts the grid releases; release-mode float normals fail the test."""
    seen = {"releases": 0, "values": 0}
    randn, snap = DpRandom.randn, grid_noise.snap_add

    def no_float_normals(self, *args, **kwargs):
        assert self.seeded_torch, "release mode drew float normals"
        return randn(self, *args, **kwargs)

    def checked(clean, k, gamma, out=None):
        out = snap(clean, k, gamma, out=out)
        scaled = out.double() / gamma
        assert torch.equal(scaled, torch.round(scaled)), "a release off the grid"
        seen["releases"] += 1
        seen["values"] += out.numel()
        return out

    monkeypatch.setattr(DpRandom, "randn", no_float_normals)
    monkeypatch.setattr(grid_noise, "snap_add", checked)
    return seen


def test_dp_sgd_step(fed, grid):  # dp-fedavg, and every other DpSgdStep user
    train("dp-fedavg", fed, DPFED, seed=1)
    assert grid["releases"] > 0


def test_opacus_dpsgd(fed, grid):
    train("dpsgd", fed, DPSGD, seed=1)
    assert grid["releases"] > 0


def test_batched_local_dp_sgd_and_batched_dpsgd(fed, grid):
    train_many("dp-fedavg", [fed, fed], DPFED, [1, 2])
    local = grid["releases"]
    train_many("dpsgd", [fed, fed], DPSGD, [1, 2])
    assert local > 0 and grid["releases"] > local


def test_batched_training_recipe(grid):
    rng = np.random.default_rng(0)
    x, y = rng.random((120, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 120)
    spec = {"arch": "mlp", "input_shape": [1, 8, 8], "num_classes": 4, "feature_dim": 16}
    recipe = batched_sgd.SGDRecipe(
        epochs=1, batch_size=16, clip=1.0, noise_multiplier=1.0, sampling="poisson"
    )
    batched_sgd.train_many(
        spec, x, y, [np.arange(100), np.arange(20, 120)], recipe, [1, 2], reproducible=False
    )
    many = grid["releases"]
    batched_sgd.train_one(spec, x, y, np.arange(100), recipe, 1, reproducible=False)
    assert many > 0 and grid["releases"] > many


def test_output_perturbation(grid):
    rng = noise_rng(0, "heads", reproducible=False)
    gaussian_output_perturbation(np.zeros((3, 5)), sigma=0.4, sensitivity=0.1, rng=rng)
    gaussian_output_perturbation(
        np.zeros((3, 5)), sigma=0.4, sensitivity=0.1, rng=rng, rows=True, dtype=np.float32
    )
    assert grid["releases"] == 2 and grid["values"] == 30
