"""The accelerator path of the batched trainer, run on PRIVKIT_TEST_DEVICE (default: the CPU).

On a machine without a GPU these tests run the device-agnostic code on the CPU (with the ChaCha20
release stream forced on, as a GPU would use it); on a GPU, ``PRIVKIT_TEST_DEVICE=cuda`` runs them
there (benchmarks/run_gpu.sh does).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from privkit.batched.batched_sgd import SGDRecipe, train_many, train_one
from privkit.models import model_spec

DEVICE = os.environ.get("PRIVKIT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.random((200, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, 200)


@pytest.mark.parametrize(
    "arch",
    [{"arch": "mlp", "feature_dim": 16}, {"arch": "cnn", "width": 4, "feature_dim": 16}],
    ids=["mlp", "cnn"],
)
def test_batched_equals_loop_on_the_device(data, arch):
    x, y = data
    spec = model_spec(arch["arch"], (1, 8, 8), 4, **{k: v for k, v in arch.items() if k != "arch"})
    recipe = SGDRecipe(
        epochs=2, batch_size=16, lr=0.2, clip=1.0, noise_multiplier=0.8, sampling="poisson"
    )
    idx = [np.arange(0, 100), np.arange(50, 170)]
    many = train_many(spec, x, y, idx, recipe, [1, 2], device=DEVICE)
    for j, seed in enumerate([1, 2]):
        one = train_one(spec, x, y, idx[j], recipe, seed, device=DEVICE)
        for k in one:
            torch.testing.assert_close(many[j][k], one[k], rtol=1e-5, atol=1e-5)


def test_a_seeded_generator_on_the_device_draws_masks_and_permutations():
    """Reproducible mode on a GPU: the seeded generator lives there and torch draws from it only
    on its own device (a CPU draw from it raised); results come back as CPU tensors, the same for
    the same seed."""
    from privkit.mechanisms.dp_random import DpRandom

    def draws(seed):
        src = DpRandom(torch.Generator(device=DEVICE).manual_seed(seed))
        return src.mask(4000, rate=0.25), src.randperm(50)

    mask, perm = draws(3)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert abs(mask.float().mean().item() - 0.25) < 0.03  # 4000 draws: 4.5 standard errors
    assert sorted(perm.tolist()) == list(range(50)) and perm.device.type == "cpu"
    again = draws(3)
    assert torch.equal(mask, again[0]) and torch.equal(perm, again[1])
