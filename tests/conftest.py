"""Shared test settings: one torch thread (CI has 2 cores) and the small/slow switch."""

import os

import pytest
import torch

torch.set_num_threads(1)

SLOW_SMALL = os.environ.get("PRIVKIT_SLOW", "") == "small"


@pytest.fixture(scope="session")
def slow_small() -> bool:
    """True when CI asks slow tests to run in their reduced configuration."""
    return SLOW_SMALL
