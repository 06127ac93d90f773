"""Seeds: one root seed, independent child seeds per client / shadow model / task.

Children come from ``numpy.random.SeedSequence.spawn`` keyed by a purpose string, so adding a new
consumer of randomness never shifts the streams the others see, and results do not depend on the
executor that runs the tasks.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a generator is made, not when seeds are derived
    import torch


def _purpose_key(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


def child_seeds(seed: int, n: int, purpose: str = "") -> list[int]:
    """``n`` independent 32-bit seeds derived from ``seed`` for the given purpose."""
    ss = np.random.SeedSequence([int(seed), _purpose_key(purpose)])
    return [int(c.generate_state(1)[0]) for c in ss.spawn(n)]


def derive_seed(seed: int, purpose: str) -> int:
    """One child seed of ``seed`` for ``purpose``."""
    return child_seeds(seed, 1, purpose)[0]


def make_rng(seed: int, purpose: str = "") -> np.random.Generator:
    """A numpy Generator for ``purpose`` under ``seed``."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), _purpose_key(purpose)]))


def torch_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch Generator seeded with ``seed`` on ``device``."""
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(int(seed) % (2**63))
    return g


def seed_torch(seed: int) -> None:
    """Seed torch's global generators (for layer initialisation inside model constructors)."""
    import torch

    torch.manual_seed(int(seed) % (2**63))
