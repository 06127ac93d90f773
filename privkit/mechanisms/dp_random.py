"""The random bits a DP mechanism spends, as torch tensors: :class:`DpRandom`.

A mechanism's guarantee holds only while its random bits are secret, so in release mode they come
from a cryptographic stream: AES-128 in counter mode (``randomgen.AESCounter``, AES-NI where the
CPU has it) keyed with 128 bits from the operating system's CSPRNG (``secrets``), fresh for every
stream and never stored, wrapped in a ``numpy.random.Generator``.  Recovering the key from any
amount of output is breaking AES; torch's Mersenne Twister / Philox and numpy's PCG64 give their
state away to anyone who sees enough output.

torch cannot draw from a numpy bit generator, so the trainers draw through :class:`DpRandom`:
``randn``, ``mask`` (Bernoulli inclusion, the Poisson sampling) and ``randperm``, each returning a
torch tensor.  Backed by the AES stream, normals come from numpy's ziggurat (exact tails, float32
or float64 as asked) on the CPU and are moved to the requested device; Bernoulli masks compare
float64 uniforms (53 bits) with the rate.  Backed by a seeded ``torch.Generator`` (reproducible
mode, or a caller's own generator) every method is exactly the torch call the trainers made before
this type existed, so seeded results are bit-identical to theirs.

Gaussian noise a release carries is drawn through :func:`privkit.mechanisms.gaussian_release`
(one function for every single-model mechanism): in release mode the released floats lie on a grid
fixed by the noise scale alone and the grid offset is drawn exactly (:mod:`privkit.mechanisms.grid_noise`), so
the floating-point attack on ``clean + sigma * z`` does not apply.  Its bits come from the same
cipher computed by OpenSSL (:class:`privkit.mechanisms.grid_noise.CipherBits`, a third of
randomgen's time a word), keyed with 128 bits of the AES stream.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["DpRandom", "aes_generator", "is_secret"]

_DTYPES: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float64: np.float64}


def aes_generator(key: int | None = None) -> np.random.Generator:
    """A numpy Generator over AES-128 in counter mode (counter 0) under ``key``.

    ``key=None`` (release mode) takes 128 bits from ``secrets``; the key lives only inside the
    returned generator.  A fixed ``key`` is for tests of the stream itself, never for release.
    """
    from randomgen import AESCounter

    if key is None:
        key = secrets.randbits(128)
    if not 0 <= int(key) < 2**128:
        raise ValueError(f"key must be in [0, 2**128); found {key}")
    return np.random.Generator(AESCounter(key=int(key), counter=0))


def is_secret(rng: np.random.Generator) -> bool:
    """Whether ``rng`` is the release stream (AES-CTR), not a seeded numpy generator."""
    from randomgen import AESCounter

    return isinstance(rng.bit_generator, AESCounter)


class DpRandom:
    """Source of DP randomness handing out torch tensors (see the module docstring).

    Parameters
    ----------
    source : torch.Generator or numpy.random.Generator
        The stream: a numpy Generator (the AES stream, :meth:`secret`) or a torch Generator (seeded,
        reproducible; drawn from exactly as torch's own functions draw).
    device : torch.device or str, optional
        Where :meth:`randn` puts its tensors; defaults to the torch generator's device, else CPU.
    normals : privkit.mechanisms.device_random.ChaChaStream, optional
        Release mode on an accelerator: :meth:`randn` draws from this counter-based stream on
        :attr:`device` (no host copy); ``mask`` and ``randperm`` still read ``source``.
    """

    def __init__(
        self,
        source: torch.Generator | np.random.Generator,
        device: str | torch.device | None = None,
        normals=None,
    ):
        if not isinstance(source, (torch.Generator, np.random.Generator)):
            raise TypeError(
                f"source must be a torch.Generator or numpy Generator; found {type(source).__name__}"
            )
        self.source = source
        default = source.device if isinstance(source, torch.Generator) else "cpu"
        self.device = torch.device(default if device is None else device)
        if normals is not None and (self.seeded_torch or normals.device != self.device):
            raise ValueError(
                f"normals must be a stream on {self.device} beside a secret source; found "
                f"{type(normals).__name__} on {getattr(normals, 'device', None)}"
            )
        self.normals = normals
        self._cipher = None  # the noise's bit stream (bits()), keyed on first use
        self._ahead = None  # the grid's draws made a release ahead (grid_ahead())

    def __getstate__(self) -> dict:
        # the noise's cipher is OpenSSL state: a copy keys its own from its copy of the stream;
        # draws made ahead are secret noise on a device, never written anywhere
        return {**self.__dict__, "_cipher": None, "_ahead": None}

    def grid_ahead(self):
        """The grid's draws made one release ahead on the device
        (:class:`privkit.mechanisms.grid_ahead.GridAhead`), for a release stream on an accelerator
        (:attr:`normals`); None elsewhere (the CPU draws its releases in cache-sized chunks)."""
        if self.normals is None:
            return None
        if getattr(self, "_ahead", None) is None:  # absent from streams pickled before it
            from privkit.mechanisms.grid_ahead import GridAhead

            self._ahead = GridAhead()
        return self._ahead

    @classmethod
    def secret(cls, device: str | torch.device = "cpu", on_device: bool | None = None) -> DpRandom:
        """Release mode: a fresh AES-CTR stream keyed from the OS CSPRNG; normals on an
        accelerator (``on_device`` defaults to whether ``device`` is not the CPU) come from a fresh
        ChaCha20 stream computed there (:mod:`privkit.mechanisms.device_random`)."""
        device = torch.device(device)
        if on_device is None:
            on_device = device.type != "cpu"
        if not on_device:
            return cls(aes_generator(), device)
        from privkit.mechanisms.device_random import ChaChaStream

        return cls(aes_generator(), device, normals=ChaChaStream(device))

    @classmethod
    def of(cls, source: DpRandom | torch.Generator) -> DpRandom:
        """``source`` itself, or a torch Generator wrapped (callers may still pass one)."""
        return source if isinstance(source, DpRandom) else cls(source)

    @property
    def seeded_torch(self) -> bool:
        """Whether draws are torch's own (a torch Generator behind this stream)."""
        return isinstance(self.source, torch.Generator)

    def randn(
        self,
        *size: int | Sequence[int],
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Standard normals of shape ``size`` on :attr:`device` (into ``out`` when given).

        Parameters
        ----------
        *size : int or sequence of int
            The shape: several sizes (``randn(2, 3)``) or one sequence (``randn((2, 3))``).
        dtype : torch.dtype
            The result's dtype when ``out`` is not given. A torch source draws in it; the AES
            stream draws float64 for float64 and float32 cast to it otherwise; the device stream
            draws float64 and casts.
        out : torch.Tensor, optional
            Written in place and returned; its dtype replaces ``dtype``.
        """
        shape: tuple[int, ...] = (
            tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size  # type: ignore[assignment]  # sizes are ints here
        )
        src = self.source
        if isinstance(src, torch.Generator):
            if out is not None:
                return torch.randn(shape, generator=src, device=self.device, out=out)
            return torch.randn(shape, generator=src, device=self.device, dtype=dtype)
        want = out.dtype if out is not None else dtype
        if self.normals is not None:  # drawn on the device
            z = self.normals.normal(math.prod(shape), want).view(shape)
            return out.copy_(z) if out is not None else z
        # float64 where asked, else float32 normals cast to the narrower type (half, bfloat16)
        z = torch.from_numpy(src.standard_normal(shape, dtype=_DTYPES.get(want, np.float32)))
        if out is not None:
            return out.copy_(z)
        return z.to(device=self.device, dtype=want)

    def bits(self):
        """The release stream as raw bits (a :class:`privkit.mechanisms.grid_noise.BitSource`): the device
        stream when there is one, else AES-128-CTR computed by OpenSSL
        (:class:`privkit.mechanisms.grid_noise.CipherBits`) under a key of 128 bits drawn from the
        AES stream on the first call, the same stream for every later call.  Release mode only."""
        from privkit.mechanisms.grid_noise import CipherBits, WordBits

        if self.seeded_torch:
            raise ValueError("bits() is for release mode; found a seeded torch Generator")
        if self.normals is not None:
            return WordBits(self.normals)
        if self._cipher is None:  # keyed once, from this stream, on the first release
            self._cipher = CipherBits(self.source, self.device)
        return self._cipher

    def mask(self, *size: int, rate: float | torch.Tensor) -> torch.Tensor:
        """Independent Bernoulli(``rate``) inclusions of shape ``size`` (a bool CPU tensor);
        ``rate`` a number or a CPU tensor of rates broadcast against ``size`` (a rate per row:
        ``(rows, 1)``)."""
        src = self.source
        if isinstance(src, torch.Generator):  # torch.rand(float32) < rate, as opacus draws it
            # drawn where the generator lives (a GPU generator draws only on its device)
            r = rate.to(src.device) if isinstance(rate, torch.Tensor) else rate
            return (torch.rand(size, generator=src, device=src.device) < r).cpu()
        rates = rate.numpy() if isinstance(rate, torch.Tensor) else rate
        return torch.from_numpy(src.random(size) < rates)

    def randperm(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of ``range(n)`` (int64, CPU)."""
        src = self.source
        if isinstance(src, torch.Generator):
            return torch.randperm(n, generator=src, device=src.device).cpu()
        return torch.from_numpy(src.permutation(n).astype(np.int64))
