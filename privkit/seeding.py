"""Seeds: one root seed, independent child seeds per client / shadow model / task; DP noise apart.

Children come from ``numpy.random.SeedSequence.spawn`` keyed by a purpose string, so adding a new
consumer of randomness never shifts the streams the others see, and results do not depend on the
executor that runs the tasks.

**DP randomness is the exception** (:func:`noise_generator`, :func:`noise_rng`).  A mechanism's
guarantee holds only while its random bits are secret: the Gaussian noise, and the sampling that
the accountant amplifies on (Poisson batches, the NFDP subsample), as opacus's secure mode treats
them.  The run seed is written into every run directory, so noise derived from it could be
regenerated and subtracted by anyone holding the directory.  In release mode (the default) these
streams are AES-128 in counter mode keyed with 128 bits from the operating system's CSPRNG
(``secrets``), fresh for every stream and never stored or logged (:mod:`privkit.mechanisms.dp_random`): a
cryptographic generator, so neither the seed nor any amount of released output gives the rest of
the stream away.  Everything else (data split, model initialisation, client sampling, audits)
stays a function of the run seed.  With ``reproducible=True`` the streams are derived from the run
seed like everything else (torch's and numpy's ordinary generators, bit-identical to earlier
privkit versions), and the ledger and report say "reproducible noise: not for release".

Floating-point attacks on Gaussian sampling (Mironov 2012; Jin et al. 2022: the set of floats
``clean + sigma * z`` can take depends on ``clean``) are answered in release mode by releasing every
noisy value on a data-independent grid with exactly drawn offsets (:mod:`privkit.mechanisms.grid_noise`);
reproducible mode draws ``clean + sigma * z`` as before.
The AES key sits in process memory while the run lasts; an attacker who can read that memory is
outside this threat model.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a generator is made, not when seeds are derived
    import torch

    from privkit.mechanisms.dp_random import DpRandom


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
    """Seed torch's global generators (for layer initialisation inside model constructors).

    Where no accelerator is available this seeds the CPU generator alone, as ``torch.manual_seed``
    would: that also queues a seeding of the CUDA generators for a later CUDA start, with the
    caller's formatted stack each time (0.1-0.9 ms a call; an audit seeds 700 models)."""
    import torch

    seed = int(seed) % (2**63)
    if _accelerator_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _accelerator_available() -> bool:
    import torch

    xpu = getattr(torch, "xpu", None)
    return (
        torch.cuda.is_available()
        or torch.backends.mps.is_available()
        or bool(xpu is not None and xpu.is_available())
    )


def noise_generator(
    seed: int, purpose: str, *, reproducible: bool, device: str | torch.device = "cpu"
) -> DpRandom:
    """Source of DP noise or privacy-amplifying sampling (see the module docstring).

    Release mode (``reproducible=False``): a fresh AES-CTR stream keyed from the OS, ignoring
    ``seed``. Reproducible mode: draws exactly as ``torch_generator(derive_seed(seed, purpose))``.
    """
    from privkit.mechanisms.dp_random import DpRandom

    if reproducible:
        return DpRandom(torch_generator(derive_seed(seed, purpose), device=device))
    return DpRandom.secret(device)


def noise_rng(seed: int, purpose: str, *, reproducible: bool) -> np.random.Generator:
    """numpy counterpart of :func:`noise_generator`: the AES-CTR Generator in release mode."""
    if reproducible:
        return make_rng(seed, purpose)
    from privkit.mechanisms.dp_random import aes_generator

    return aes_generator()
