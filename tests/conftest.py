"""Shared test settings: one torch thread (CI has 2 cores), the small/slow switch, and one random
state per test."""

import os
import random
import zlib

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

SLOW_SMALL = os.environ.get("PRIVKIT_SLOW", "") == "small"


@pytest.fixture(scope="session")
def slow_small() -> bool:
    """True when CI asks slow tests to run in their reduced configuration."""
    return SLOW_SMALL


@pytest.fixture(autouse=True)
def _random_state_of_the_test(request):
    """Every test starts from its own fixed global random state, whichever tests ran before it in
    its process: ``make test`` spreads the files over workers in an order that varies from run to
    run, so a test that draws without a seed of its own would otherwise see different numbers."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
