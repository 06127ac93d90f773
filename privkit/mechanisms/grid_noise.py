"""Release-mode Gaussian noise whose floating-point bits leak nothing: releases on a data-independent grid.

**The attack.**  ``clean + sigma * z`` computed in floating point, with ``z`` a float from a normal
sampler, does not have the distribution the Gaussian mechanism's analysis assumes: the set of
floats it can return depends on ``clean`` (Mironov 2012, "On significance of the least significant
bits for differential privacy"; Jin et al. 2022, "Are we there yet? Timing and floating-point
attacks on differential privacy systems").  For ``clean = 1024`` and ``sigma = 1024`` every float32
release is a multiple of ``2**-14``, while for ``clean = 0`` a quarter of them are not: one release
can tell the two inputs apart with certainty, whatever the noise multiplier.

**The defence** (the snapping idea of Mironov 2012 and of Google's secure noise generation:
release only points of a grid chosen without looking at the data, and draw the grid offset
exactly).  With ``gamma`` a power of two fixed by ``sigma`` alone (:class:`Grid`), the release is::

    release = gamma * (round(clean / gamma) + k),   k_i = round(N_i),  N_i ~ N(0, s^2) i.i.d.

``clean / gamma`` is exact (a power-of-two scaling), ``k`` is an integer drawn exactly from the
*rounded Gaussian* law ``P(k) = Phi((k + 1/2) / s) - Phi((k - 1/2) / s)`` (:func:`rounded_gaussian`),
and the integer ``round(clean / gamma) + k`` is turned into a float by correctly rounded IEEE
operations: the released float is a fixed function of that integer, so it carries nothing beyond
it, and two inputs reach the same set of floats.

**Accounting: unchanged.**  Because ``round(r + N) = r + round(N)`` for an integer ``r``, the
release is a post-processing (``y -> gamma * round(y / gamma)``) of the continuous Gaussian
mechanism ``gamma * round(clean / gamma) + N(0, (gamma s)^2 I)``.  Rounding moves each of the ``d``
coordinates by at most ``gamma / 2``, so neighbouring inputs whose ``clean`` differ by at most
``Delta`` in L2 have rounded inputs within ``Delta + gamma * sqrt(d)`` (:func:`rounded_sensitivity`).
:meth:`Grid.for_release` takes ``gamma * s >= sigma * (1 + gamma * sqrt(d) / Delta)``, so the
noise multiplier ``gamma * s / (Delta + gamma * sqrt(d))`` is at least ``sigma / Delta``: the
ledger's ``GaussianDpEvent(sigma / Delta)`` (and every subsampled, composed event built on it)
stays a sound description of what ran, for every accountant (PLD, RDP, PRV).  The price is noise
larger by the factor ``1 + gamma * sqrt(d) / Delta <= 1 + 2**-24 * (sigma / Delta) * sqrt(d)``
(``1 + 6e-5`` for a million coordinates at noise multiplier 1).  The discrete Gaussian of Canonne,
Kamath & Steinke (2020) would be exact too, but its privacy equals the continuous Gaussian's in
zCDP, not in the hockey-stick divergence privkit's PLD accountant composes (at ``s = 2`` its delta
exceeds the Gaussian's closed form: tests/privkit/test_grid_noise.py); the rounded Gaussian needs
no new accounting.

**Exactness of the sampler.**  ``k = round(s * Phi^-1(U))`` with ``U`` uniform on (0, 1), read as
an infinite-precision number whose first 53 bits come from the secret stream.  The 53 bits fix
``U`` to a cell of width ``2**-53``; when the whole cell maps inside one integer's interval (with
a margin of ``2**-44`` relative, far above the error of the float64 inverse: ``ndtri``, measured
below ``2**-50`` against mpmath on the CPU and on a GPU, and on the CPU, for the bulk ``|z| <= 3``,
``sqrt(2) * erfinv(2 U - 1)``, a fifth of its time, measured below ``2**-51.8`` and checked against
``ndtri`` once a process) ``k`` is decided.  Otherwise (about 4 draws in a
million at ``s = 2**24``) it is settled by :func:`_settle`: mpmath compares the cell with
``Phi((k +- 1/2) / s)`` at ``w + 80`` bits (``w`` the bits of ``U`` read), requiring a relative
separation of ``2**-(w + 64)``, and draws 64 more bits of ``U`` from the stream while a boundary
lies closer.  Where the cell's image, as the float64 inverse places it (its width plus the
inverse's margin), is shorter than a grid unit, it can cross only the half-integer nearest the
estimate, and only that boundary is compared (:func:`_settle_at`: one ``ncdf`` where two were;
the others are excluded by the same margin every bulk decision rests on).  The law of ``k`` is the
rounded Gaussian exactly, as long as the inverse stays within its measured error and mpmath's
``ncdf`` is accurate to that separation (it is accurate to its working precision).

The bits come from :class:`CipherBits` on the CPU (AES-128-CTR by OpenSSL) and :class:`WordBits`
on an accelerator (ChaCha20 on the device), where a release stream draws each release's
integers one release ahead (:mod:`privkit.mechanisms.grid_ahead`: the same integers, without a
wait for the device inside the release).  A CPU release of more than one chunk (65,536 draws,
kept in cache) decides each chunk's bulk and snaps it, then decides the draws every chunk left
open (the tail, those near a boundary) together and snaps those coordinates again.

Reproducible mode (a seeded torch generator) keeps drawing ``clean + sigma * z`` as before, bit for
bit: the defence is for release mode, where the noise is secret.
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from privkit.errors import PrivkitError

if TYPE_CHECKING:  # pragma: no cover
    from privkit.mechanisms.grid_ahead import GridAhead

__all__ = [
    "GRID_BITS",
    "BitSource",
    "CipherBits",
    "Grid",
    "NumpyBits",
    "WordBits",
    "grid_release",
    "rounded_gaussian",
    "rounded_sensitivity",
    "snap_add",
]

GRID_BITS = 24
"""The grid step is ``2**(floor(log2 sigma) - GRID_BITS)``: ``s = sigma / gamma`` lies in
``[2**24, 2**25)`` (a fixed part of the mechanism's definition)."""
_CHUNK = 1 << 16  # draws per pass on the CPU
_MARGIN = 2.0**-44  # relative margin of the float64 decision (ndtri's error is ~2**-52)
_Z_BULK = 3.0  # |z| beyond it (0.3% of the draws): the cell's width is computed for each
_BULK_WIDTH = 2.0**-52 * math.sqrt(2.0 * math.pi) * math.exp(0.5 * _Z_BULK**2)  # 2**-52 / phi(3)


class BitSource(Protocol):
    """The secret stream as raw bits: 53-bit integers in bulk, 64-bit words one at a time, on
    :attr:`device`."""

    device: torch.device

    def bits53(self, n: int) -> torch.Tensor:
        """``n`` independent uniform integers in ``[0, 2**53)``, as float64 (exact), on the
        source's device."""
        ...

    def bits64(self) -> int:
        """One uniform integer in ``[0, 2**64)``."""
        ...


def _top53(words: np.ndarray, device: torch.device) -> torch.Tensor:
    """The top 53 bits of each 64-bit word, as exact float64 integers on ``device``."""
    return torch.from_numpy(np.right_shift(words, np.uint64(11)).astype(np.float64)).to(device)


class NumpyBits:
    """:class:`BitSource` over a numpy Generator's bit generator (the AES-CTR stream)."""

    def __init__(self, generator: np.random.Generator, device: str | torch.device = "cpu"):
        self.bit_generator = generator.bit_generator
        self.device = torch.device(device)

    def bits53(self, n: int) -> torch.Tensor:
        return _top53(self.bit_generator.random_raw(n), self.device)

    def bits64(self) -> int:
        return int(self.bit_generator.random_raw())


class CipherBits:
    """:class:`BitSource` over AES-128 in counter mode computed by OpenSSL (``cryptography``), keyed
    with 128 bits from the release stream (or the OS CSPRNG): the release stream's own cipher at a
    third of its cost a word on the CPU (OpenSSL's pipelined AES-NI: 1.1 ns a 64-bit word against
    randomgen's 3.6 ns, measured on privkit's development machine).

    Parameters
    ----------
    generator : numpy.random.Generator, optional
        Where the key comes from: two 64-bit words of this stream (the AES-CTR release stream of
        :func:`privkit.mechanisms.dp_random.aes_generator`, so a fixed-key stream in tests gives a
        fixed noise stream); ``None`` takes the key from ``secrets``.
    device : torch.device or str
        Where :meth:`bits53` puts its draws.
    """

    def __init__(
        self, generator: np.random.Generator | None = None, device: str | torch.device = "cpu"
    ):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        if generator is None:
            key = secrets.token_bytes(16)
        else:
            key = generator.bit_generator.random_raw(2).astype("<u8").tobytes()
        # counter block 0, incremented over all 128 bits: no block repeats under this key
        self._cipher = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        self.device = torch.device(device)
        self._zeros = bytes(0)

    def _words(self, n: int) -> np.ndarray:
        """The next ``n`` 64-bit words of the keystream (little-endian)."""
        if len(self._zeros) < 8 * min(n, _CHUNK):  # the plaintext: the keystream is the ciphertext
            self._zeros = bytes(8 * min(n, _CHUNK))
        if n <= _CHUNK:
            return np.frombuffer(self._cipher.update(memoryview(self._zeros)[: 8 * n]), dtype="<u8")
        out = np.empty(n, dtype="<u8")  # a long draw (an accelerator's one pass), a chunk at a time
        for start in range(0, n, _CHUNK):
            out[start : start + _CHUNK] = self._words(min(_CHUNK, n - start))
        return out

    def bits53(self, n: int) -> torch.Tensor:
        return _top53(self._words(n), self.device)

    def bits64(self) -> int:
        return int(self._words(1)[0])


class WordBits:
    """:class:`BitSource` over a counter-based stream of 32-bit words computed on a device
    (:class:`privkit.mechanisms.device_random.ChaChaStream`: ``words(blocks) -> (16, blocks)`` int64)."""

    def __init__(self, stream):
        self.stream = stream
        self.device = torch.device(stream.device)

    def bits53(self, n: int) -> torch.Tensor:
        return self.stream.bits53(n).to(torch.float64)

    def bits64(self) -> int:
        w = self.stream.words(1)[:2, 0].tolist()
        return (int(w[0]) << 32) | int(w[1])


@dataclass(frozen=True)
class Grid:
    """The release grid ``gamma * Z`` and the noise scale ``s`` in grid units.

    ``gamma`` is a power of two, ``std = gamma * s`` the standard deviation of the continuous
    Gaussian the release post-processes.
    """

    gamma: float
    scale: float

    @property
    def std(self) -> float:
        return self.gamma * self.scale

    @classmethod
    def for_release(cls, std: float, sensitivity: float | None, dim: int = 1) -> Grid:
        """The grid for noise ``std`` on a ``dim``-coordinate release of L2 sensitivity ``sensitivity``.

        ``gamma = 2**(floor(log2 std) - GRID_BITS)`` and ``s`` the smallest float with
        ``gamma * s >= std * (1 + gamma * sqrt(dim) / sensitivity)``: the noise covers the rounding
        (see the module docstring), so the accounted multiplier ``std / sensitivity`` holds.
        ``sensitivity=None`` leaves the noise at ``std`` (``gamma * s >= std``): for draws no
        privacy claim rests on.

        Parameters
        ----------
        std : float
            The noise standard deviation the mechanism claims (finite, ``>= 2**-900``); sets
            ``gamma``.
        sensitivity : float or None
            The release's L2 sensitivity (``> 0``), or ``None`` for no widening.
        dim : int
            The number of coordinates of one release (``>= 1``): each adds its rounding error.
        """
        if not (math.isfinite(std) and std >= 2.0**-900):
            raise PrivkitError(f"std must be a finite number >= 2**-900; found {std}")
        if sensitivity is not None and not sensitivity > 0:
            raise PrivkitError(f"sensitivity must be > 0; found {sensitivity}")
        if dim < 1:
            raise PrivkitError(f"dim must be >= 1; found {dim}")
        return _grid_for(float(std), None if sensitivity is None else float(sensitivity), int(dim))


@functools.lru_cache(maxsize=1024)
def _grid_for(std: float, sensitivity: float | None, dim: int) -> Grid:
    """:meth:`Grid.for_release` past its checks, kept per ``(std, sensitivity, dim)``: a training
    releases with the same ones at every step, and the exact check in rationals took 18 us of
    each release (0.4 us kept)."""
    gamma = math.ldexp(1.0, math.frexp(std)[1] - 1 - GRID_BITS)
    widened = std if sensitivity is None else std * (1.0 + gamma * math.sqrt(dim) / sensitivity)
    scale = float(np.nextafter(widened / gamma, np.inf))
    while not _covers(std, sensitivity, gamma, scale, dim):  # exact: float rounding may fall short
        scale = float(np.nextafter(scale, np.inf))
    return Grid(gamma, scale)


def _covers(std: float, sensitivity: float | None, gamma: float, scale: float, dim: int) -> bool:
    """``gamma * scale >= std * (1 + gamma * sqrt(dim) / sensitivity)`` in exact rationals (squared
    to keep the square root out)."""
    noise = Fraction(gamma) * Fraction(scale)
    if sensitivity is None:
        return noise >= Fraction(std)
    excess = (noise - Fraction(std)) * Fraction(sensitivity)  # must be >= std * gamma * sqrt(dim)
    return excess >= 0 and excess * excess >= (Fraction(std) * Fraction(gamma)) ** 2 * dim


def rounded_sensitivity(sensitivity: float, gamma: float, dim: int) -> float:
    """L2 sensitivity of ``gamma * round(x / gamma)`` when ``x`` has L2 sensitivity ``sensitivity``:
    ``sensitivity + gamma * sqrt(dim)`` (each coordinate's rounding error lies in
    ``[-gamma/2, gamma/2]``, so two inputs' errors differ by at most ``gamma`` per coordinate).
    Rounded up to the next float.

    Parameters
    ----------
    sensitivity : float
        The L2 sensitivity of the unrounded value ``x``.
    gamma : float
        The grid step.
    dim : int
        The number of coordinates of ``x``.
    """
    return float(np.nextafter(sensitivity + gamma * math.sqrt(dim), np.inf))


def rounded_gaussian(
    scale: float, n: int, bits: BitSource, *, margin: float = _MARGIN
) -> torch.Tensor:
    """``n`` independent draws of ``round(N(0, scale^2))``, exactly (see the module docstring).

    Parameters
    ----------
    scale : float
        The standard deviation ``s`` of ``N`` in grid units (finite, ``> 0``).
    n : int
        The number of draws.
    bits : BitSource
        The secret stream the uniforms (53 bits each, more for a draw near a boundary) come from.
    margin : float
        The relative margin a float64 decision must clear; draws closer to a boundary are
        settled by mpmath (tests raise it to exercise that path).

    Returns
    -------
    torch.Tensor
        ``n`` float64 integers on the bit source's device.
    """
    if not (math.isfinite(scale) and scale > 0):
        raise PrivkitError(f"scale must be a finite number > 0; found {scale}")
    if n <= _CHUNK or bits.device.type != "cpu":  # one pass on an accelerator
        k, rest, u_rest = _bulk(scale, n, bits, margin)
        k[rest] = _undecided(u_rest, scale, bits, margin)
        return k
    out = torch.empty(n, dtype=torch.float64)

    def take(start: int, k: torch.Tensor) -> None:
        out[start : start + len(k)] = k

    idx, k_open = _in_chunks(scale, n, bits, margin, take)
    out[idx] = k_open
    return out


def _in_chunks(scale: float, n: int, bits: BitSource, margin: float, take):
    """``n`` draws on the CPU in chunks that stay in cache (2x faster than one pass): each chunk's
    bulk handed to ``take(start, k)`` (its open draws' entries not yet the draws'), then the open
    draws of every chunk decided together: returns their indices and integers."""
    pending = []
    for start in range(0, n, _CHUNK):
        k, rest, u_rest = _bulk(scale, min(_CHUNK, n - start), bits, margin)
        take(start, k)
        pending.append((rest + start, u_rest))
    idx, u = (torch.cat(parts) for parts in zip(*pending))
    return idx, _undecided(u, scale, bits, margin)


def _bulk(
    scale: float, n: int, bits: BitSource, margin: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` draws decided in bulk: ``(k, rest, u_rest)``, the integers (float64; those at the
    indices ``rest`` still undecided) and the undecided draws' 53-bit cells, for
    :func:`_undecided`. A release on the CPU decides its chunks' bulk first and all their
    undecided draws together: a chunk's tail alone took 25 small operations (60-120 us a chunk)."""
    u = bits.bits53(n)
    decided = bulk_decision(u, scale, margin, _not_below)
    if decided is None:  # a scale below 1 / 6 or above 2**42 (or a test's margin): one by one
        k, rest = torch.empty_like(u), torch.arange(n, device=u.device)
    else:
        k, rest = decided
    return k, rest, u[rest]


def bulk_decision(u: torch.Tensor, scale: float, margin: float, undecided):
    """The bulk's integers ``k`` (float64) of the 53-bit cells ``u``, and ``undecided(off,
    limit)`` of how far each draw's estimate lies from its integer (``off``; a draw is decided
    where ``off < limit``), or None where no draw can be decided in bulk (a scale below 1 / 6 or
    above 2**42, or a test's margin)."""
    # the cell [u, u + 1) * 2**-53 around its midpoint; z = Phi^-1(midpoint), a = scale * z
    a = _bulk_inverse(u, scale)
    # The cell lies within 2**-53 of the computed midpoint (half its width, plus the midpoint's
    # rounding, 2**-54 when u >= 2**52), so it maps into z +- w, w = 2**-53 * max(1 / phi) over it,
    # and that max is below 2 / phi(z) while w < 2**-10 (phi varies by e**(|z| w + w**2 / 2) < 2):
    # w <= 2**-52 / phi(z), at most _BULK_WIDTH where |z| <= _Z_BULK. The margin covers the
    # float64 inverse (measured within 2**-50 relative) 64 times over.
    # Decided in bulk: |a - k| < 0.5 - _BULK_WIDTH * scale - margin * (bound + 1) with |a| <= bound,
    # a half-integer within _Z_BULK * scale: a beyond it is clamped to +-bound, half-way between two
    # integers, which no bulk decision accepts (nor NaN). The rest (the 0.3% tail, draws near a
    # boundary) is checked draw by draw with ndtri and its own width (_undecided).
    bound = math.floor(_Z_BULK * scale - 0.5) + 0.5
    limit = 0.5 - _BULK_WIDTH * scale - margin * (bound + 1.0)
    if not (bound > 0 and limit > 0):
        return None
    # then scale < 2**43: bound is a half-integer exactly
    k = torch.round(a.clamp_(-bound, bound))
    return k, undecided(a.sub_(k).abs_(), limit)


def _undecided(
    u: torch.Tensor,
    scale: float,
    bits: BitSource,
    margin: float,
    estimates: torch.Tensor | None = None,
) -> torch.Tensor:
    """The integers of the cells ``u`` the bulk left open (the tail, draws near a boundary): each
    decided with ``ndtri`` and its own width, and what stays open settled exactly
    (:func:`_settle_at`, :func:`_settle`). On the CPU the decisions run in numpy: a tail's twenty
    small operations cost a few microseconds each in torch, a third of that in numpy.
    ``estimates``: the cells' ``tail_estimates``, where a device computed them (beside ``u``)."""
    if not len(u):
        return u
    a = tail_estimates(u, scale) if estimates is None else estimates
    if a.device.type == "cpu":
        # numpy quiet: the top cell's midpoint rounds to 1, a = inf, settled from no guess
        with np.errstate(invalid="ignore", over="ignore"):
            return torch.from_numpy(_decide(a.numpy(), u.numpy(), scale, bits, margin, _NUMPY))
    return _decide(a, u, scale, bits, margin, _Torch(a.device))


class _Torch:
    """The array functions :func:`_decide` calls, for torch tensors on ``device``."""

    round, exp, where = (staticmethod(f) for f in (torch.round, torch.exp, torch.where))

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def flatnonzero(mask):
        return torch.nonzero(mask).flatten()

    def asarray(self, values):
        return torch.tensor(values, dtype=torch.float64, device=self.device)


class _Numpy:
    """The same for numpy arrays."""

    round, exp, where, flatnonzero = (
        staticmethod(f) for f in (np.round, np.exp, np.where, np.flatnonzero)
    )

    @staticmethod
    def asarray(values):
        return np.asarray(values, dtype=np.float64)


_NUMPY = _Numpy()


def _decide(a, u, scale: float, bits: BitSource, margin: float, xp):
    """:func:`_undecided` past the inverse: ``a = scale * Phi^-1(midpoint)`` of the cells ``u``, both
    numpy arrays or both torch tensors (``xp`` their functions)."""
    k = xp.round(a)  # both round half to even; no decided draw lies half-way
    z = a / scale
    width = scale * 2.0**-52 * math.sqrt(2.0 * math.pi) * xp.exp(0.5 * z * z)
    error = margin * (abs(a) + 1.0)
    off = abs(a - k)
    # the width bound holds where the cell's image is below 2**-10 wide in z (see _bulk), far
    # into the tail: 2**-10 in grid units, as this check once asked, sent every draw beyond
    # |z| = 4.7 to mpmath (2 in a million, 0.8 ms each)
    valid = width < scale * 2.0**-10
    near = ~(off < 0.5 - width - error) | ~valid
    idx = xp.flatnonzero(near)
    if len(idx):
        # One boundary: the cell's image lies within width + error of a, an interval shorter
        # than one grid unit around a, so it can cross only the half-integer nearest a (two
        # half-integers are one unit apart); the others are as far as a bulk decision needs.
        one = valid & (width + error < 0.5)
        near_side = xp.where(a >= k, k + 0.5, k - 0.5)
        settled = [
            _settle_at(int(c), b, scale, bits) if single else _settle(int(c), scale, bits, guess)
            for c, b, single, guess in zip(
                u[idx].tolist(), near_side[idx].tolist(), one[idx].tolist(), k[idx].tolist()
            )
        ]
        k[idx] = xp.asarray(settled)
    return k


def tail_estimates(u: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * Phi^-1`` of the cells ``u``'s midpoints by ``ndtri`` (accurate in the tails too,
    measured within ``2**-50`` on the CPU and on a GPU): the estimates :func:`_undecided`
    decides open draws from."""
    return torch.special.ndtri(_midpoint(u)).mul_(scale)


def _bulk_inverse(u: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * Phi^-1((u + 1/2) * 2**-53)`` in float64 (a new tensor), the bulk decision's input:
    where ``|z| <= _Z_BULK`` its error must stay below the decision's margin, ``2**-44 * (bound +
    1)`` grid units (about ``3 * 2**-44`` in ``z``).

    On the CPU ``sqrt(2) * erfinv(y)`` with ``y = (2 u + 1) * 2**-53 - 1``, twice the midpoint less
    one, exact (:func:`_erfinv_argument`): a fifth of ``ndtri``'s time (2.1-2.4 ns a draw against
    11-13 ns), measured within ``2**-51.8`` relative of mpmath over the bulk; in the tails erfinv's
    Newton steps lose accuracy, and the draws there are recomputed with ``ndtri``. Where this
    torch's ``erfinv`` does not agree with ``ndtri`` to ``2**-48`` over the bulk
    (:func:`_erfinv_agrees`), and on accelerators (where only ``ndtri``'s error was measured),
    ``ndtri`` (within ``2**-50``)."""
    if u.device.type == "cpu" and _erfinv_agrees():
        return _erfinv_argument(u).erfinv_().mul_(math.sqrt(2.0) * scale)
    return torch.special.ndtri(_midpoint(u)).mul_(scale)


@functools.cache
def _erfinv_agrees() -> bool:
    """Whether this process's float64 CPU ``erfinv`` gives ``Phi^-1`` within ``2**-48`` relative of
    ``ndtri`` (measured within ``2**-50`` of the true value) on 20 000 cells across the bulk,
    erfinv's switch between its two approximations (``|y| = 0.7``) and ``|z| = 3``: a check of the
    build this runs on, once a process, before the faster inverse decides any draw."""
    spread = torch.linspace(-_Z_BULK, _Z_BULK, 12_001, dtype=torch.float64)
    switch = 1.0364333894937898  # Phi^-1(0.85): erfinv's argument 0.7
    edges = torch.tensor([-_Z_BULK, _Z_BULK, -switch, switch], dtype=torch.float64)
    steps = torch.arange(-2_000, 2_000, dtype=torch.float64) * 2.0**-40
    points = torch.cat(
        [torch.special.ndtr(spread), (torch.special.ndtr(edges)[:, None] + steps).flatten()]
    )
    y = _erfinv_argument(torch.floor(points * 2.0**53))
    fast = torch.special.erfinv(y).mul_(math.sqrt(2.0))
    # ndtri where its argument is exact: (1 - |y|) / 2 <= 1/2, a multiple of 2**-54
    exact = torch.special.ndtri((1.0 - y.abs()) * 0.5).neg_().mul_(torch.sign(y))
    gap = (fast - exact).abs_().div_(exact.abs().add_(2.0**-25))
    return bool(gap.max() <= 2.0**-48)


def _midpoint(u: torch.Tensor) -> torch.Tensor:
    """``(u + 1/2) * 2**-53``, ``ndtri``'s argument: the cell's midpoint, rounded to ``2**-53``
    where ``u >= 2**52`` (the comment in :func:`_bulk` allows for it)."""
    return u.mul(2.0**-53).add_(2.0**-54)


def _erfinv_argument(u: torch.Tensor) -> torch.Tensor:
    """``(2 u + 1) * 2**-53 - 1``, exactly: ``u * 2**-52`` is exact, and so is the sum, a multiple of
    ``2**-53`` in ``(-1, 1)``."""
    return u.mul(2.0**-52).add_(2.0**-53 - 1.0)


def _not_below(values: torch.Tensor, limit: float) -> torch.Tensor:
    """Indices where ``values < limit`` fails (NaN included); numpy's comparison and search on the
    CPU (torch's comparison took 1 ns a draw, numpy's 0.1 ns)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(~np.less(values.numpy(), limit)))
    return torch.nonzero(~torch.lt(values, limit)).flatten()


def _settle(cell: int, scale: float, bits: BitSource, guess: float = math.nan) -> int:
    """The integer ``k`` whose interval ``(Phi((k - 1/2) / s), Phi((k + 1/2) / s)]`` holds ``U``,
    where ``U`` lies in ``[cell, cell + 1) * 2**-53``, exactly: more bits of ``U`` are drawn while a
    boundary lies inside its cell. ``guess`` (the float64 estimate) only sets where the search
    starts: the comparisons below move ``k`` to the right integer from any start; without a finite
    guess it starts from mpmath's ``erfinv`` (slower: a root search)."""
    import mpmath as mp

    width = 53
    k = int(guess) if math.isfinite(guess) else None
    while True:
        with mp.workprec(width + 80):
            lo = mp.mpf(cell) / mp.mpf(2) ** width
            hi = mp.mpf(cell + 1) / mp.mpf(2) ** width
            s = mp.mpf(scale)
            if k is None:
                mid = (lo + hi) / 2
                k = int(mp.floor(s * mp.sqrt(2) * mp.erfinv(2 * mid - 1) + mp.mpf(0.5)))
            tol = mp.mpf(2) ** -(width + 64)
            below = mp.ncdf((k - mp.mpf(0.5)) / s)
            above = mp.ncdf((k + mp.mpf(0.5)) / s)
            if hi <= below * (1 - tol):
                k -= 1
            elif lo >= above * (1 + tol):
                k += 1
            elif lo >= below * (1 + tol) and hi <= above * (1 - tol):
                return k
            else:  # a boundary inside the cell: read 64 more bits of U
                cell = (cell << 64) | bits.bits64()
                width += 64
                k = None  # the narrower cell's own estimate (a wide tail cell spans many integers)


def _settle_at(cell: int, boundary: float, scale: float, bits: BitSource) -> int:
    """The integer ``k`` of the cell ``[cell, cell + 1) * 2**-53`` when ``boundary`` (a
    half-integer) is the only one its image can cross: ``boundary - 1/2`` if the cell lies below
    ``Phi(boundary / s)``, ``boundary + 1/2`` if above, decided exactly as :func:`_settle` decides
    (mpmath at ``w + 80`` bits, a relative separation of ``2**-(w + 64)``, 64 more bits of ``U``
    while the boundary lies closer), with one ``ncdf`` where :func:`_settle` takes two."""
    import mpmath as mp

    width = 53
    while True:
        with mp.workprec(width + 80):
            tol = mp.mpf(2) ** -(width + 64)
            at = mp.ncdf(mp.mpf(boundary) / mp.mpf(scale))
            if mp.mpf(cell + 1) / mp.mpf(2) ** width <= at * (1 - tol):
                return int(boundary - 0.5)
            if mp.mpf(cell) / mp.mpf(2) ** width >= at * (1 + tol):
                return int(boundary + 0.5)
        cell = (cell << 64) | bits.bits64()  # the boundary inside the cell: read 64 more bits
        width += 64


def snap_add(
    clean: torch.Tensor, k: torch.Tensor, gamma: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``gamma * (round(clean / gamma) + k)`` in float64, then in ``clean``'s dtype.

    ``clean / gamma`` and the product by ``gamma`` are exact (power of two), the sum of two integers
    is correctly rounded: the result is a fixed function of the integer ``round(clean / gamma) + k``.

    Parameters
    ----------
    clean : torch.Tensor
        The pre-noise value; the result has its shape, dtype and device.
    k : torch.Tensor
        Integer noise in grid units (float64 integers from :func:`rounded_gaussian`), of
        ``clean``'s shape.
    gamma : float
        The grid step, a power of two.
    out : torch.Tensor, optional
        Written in place (``clean``'s shape and dtype) and returned: the cast to ``clean``'s
        dtype and the copy into a chunk of a larger release are one pass.
    """
    c = clean.to(torch.float64, copy=True)  # in place from here on (0.75x the time of new tensors)
    c.mul_(1.0 / gamma).round_().add_(k.to(device=c.device, dtype=torch.float64)).mul_(gamma)
    return c.to(clean.dtype) if out is None else out.copy_(c)


def grid_release(
    clean: torch.Tensor, grid: Grid, bits: BitSource, ahead: GridAhead | None = None
) -> torch.Tensor:
    """``clean`` released with the grid's Gaussian noise: ``gamma * (round(clean / gamma) + k)``,
    ``k`` drawn by :func:`rounded_gaussian` from ``bits`` (see the module docstring).

    Parameters
    ----------
    clean : torch.Tensor
        The pre-noise value, any shape; the release has its shape, dtype and device.
    grid : Grid
        The grid step ``gamma`` and noise scale ``s`` (:meth:`Grid.for_release`).
    bits : BitSource
        The secret stream the noise is drawn from.
    ahead : privkit.mechanisms.grid_ahead.GridAhead, optional
        A device stream's draws made one release ahead (no wait for the device inside the
        release: :meth:`privkit.mechanisms.dp_random.DpRandom.grid_ahead`); ``None`` draws now.
    """
    flat = clean.reshape(-1)
    if ahead is not None:
        k = ahead.take(grid.scale, flat.numel(), bits)
        return snap_add(flat, k, grid.gamma).view(clean.shape)
    if flat.device.type != "cpu" or flat.numel() <= _CHUNK:
        return snap_add(flat, rounded_gaussian(grid.scale, flat.numel(), bits), grid.gamma).view(
            clean.shape
        )
    out = torch.empty_like(flat)

    def take(start: int, k: torch.Tensor) -> None:
        snap_add(flat[start : start + len(k)], k, grid.gamma, out=out[start : start + len(k)])

    idx, k_open = _in_chunks(grid.scale, flat.numel(), bits, _MARGIN, take)
    out[idx] = snap_add(flat[idx], k_open, grid.gamma)  # the open draws' coordinates, again
    return out.view(clean.shape)
