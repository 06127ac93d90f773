"""The grid's exact noise one release ahead on a device: no wait for the device inside a step.

:func:`~privkit.mechanisms.grid_noise.rounded_gaussian` decides most draws in bulk on the device,
then reads the few it leaves open (the 0.3% tail, draws near a half-integer) back to the host
and settles them there. Reading them back is a wait for the device: inside a DP-SGD step the
host stops until the forward and backward passes it has queued have run, and the device then
idles while the host queues the rest (on an H200 the release noise took ResNet-18's step from
2.64x SGD with seeded noise to 3.68x). The draws do not depend on the data: this module draws
the next release's integers right after a release, queues the copy of its open draws to the
host (:class:`attacks.transfers.HostCopy`, into page-locked memory; their positions put first
on the device by a stable sort of their flags and cut to a fixed length: no read of a count)
and settles them when that release comes, by which time the copy has long run. The settled integers go back by a queued
copy too; the device writes them into the draw before the release reads it (stream order).

The law is :func:`rounded_gaussian`'s: the same bulk decision and the same settling of the open
draws (on the host, where its tail inverse is measured as the device's), reading the stream in
the same order (a release's extra bits for its settling, then the next release's 53-bit words),
so with a fixed key the integers are :func:`rounded_gaussian`'s, release after release
(``tests/privkit/test_grid_ahead.py``). A release that asks for another scale or length than
the one drawn ahead (another model on the same stream), or whose open draws overflow the buffer,
gets a draw of its own, made then (a draw ahead is kept for each of the last few scales and
lengths; one never used is dropped: secret draws never used leak nothing). It lives with its
stream and is never pickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attacks.transfers import HostCopy, to_device
from privkit.mechanisms.grid_noise import (
    _MARGIN,
    BitSource,
    _undecided,
    bulk_decision,
    rounded_gaussian,
    tail_estimates,
)

__all__ = ["GridAhead"]

#: the buffer of open draws: their expected share (about 0.27%: |z| > 3, and 1.5e-5 near a
#: half-integer), 0.3%, plus a margin of 1024 (a longer list is drawn again, then)
_OPEN_SHARE = 0.003
_OPEN_MARGIN = 1024


def open_capacity(n: int) -> int:
    """How many open draws of ``n`` the buffer copied to the host holds (all, for a short draw)."""
    return min(n, math.ceil(n * _OPEN_SHARE) + _OPEN_MARGIN)


@dataclass
class _Ahead:
    """A draw made ahead: its integers on the device (the open ones not yet settled), and the
    open draws' count, positions, cells and estimates on their way to the host."""

    key: tuple[float, int, float]  # scale, n, margin
    k: torch.Tensor
    copy: HostCopy  # [count, positions, cells, estimates (capacity each)], float64
    stream: torch.cuda.Stream | None  # the CUDA stream it was drawn on

    @classmethod
    def draw(cls, key: tuple[float, int, float], bits: BitSource) -> _Ahead | None:
        """The bulk of ``n`` draws queued, and their open draws' copy; None where no draw can be
        decided in bulk (a scale outside ``[1/6, 2**42]``)."""
        scale, n, margin = key
        if n == 0:
            return None
        u = bits.bits53(n)
        decided = bulk_decision(u, scale, margin, lambda off, limit: ~torch.lt(off, limit))
        if decided is None:
            return None
        k, open_ = decided
        cap = open_capacity(n)
        # the open draws' positions in order, first, without reading their count: a stable sort
        # of the flags (a scatter of every closed draw into one spare slot would make millions of
        # stores to one address)
        where = torch.sort(open_.to(torch.uint8), descending=True, stable=True).indices[:cap]
        count = open_.sum().to(torch.float64).reshape(1)
        cells = u[where]
        # the open draws' estimates on the device too (0.4 ms of the host's time a release, for
        # ResNet-18's 30,000 open draws); positions below 2**53 are exact in float64; past the
        # count, positions, cells and estimates are closed draws'
        estimates = tail_estimates(cells, scale)
        copy = HostCopy(torch.cat([count, where.to(torch.float64), cells, estimates]))
        stream = torch.cuda.current_stream(u.device) if u.device.type == "cuda" else None
        return cls(key, k, copy, stream)

    def settled(self, bits: BitSource) -> torch.Tensor | None:
        """The integers with the open draws settled (:func:`_undecided`, on the host), or None
        where the open draws overflowed the buffer."""
        scale, n, margin = self.key
        cap = open_capacity(n)
        host = self.copy.result()
        count = int(host[0])
        if count > cap:
            return None
        where = host[1 : 1 + count].to(torch.long)
        cells = host[1 + cap : 1 + cap + count]
        estimates = host[1 + 2 * cap : 1 + 2 * cap + count]
        decided = _undecided(cells, scale, bits, margin, estimates)
        device = self.k.device
        if self.stream is not None and self.stream != torch.cuda.current_stream(device):
            # released on another stream than the one it was drawn on: after the draw, and its
            # memory kept until that stream is done with it
            torch.cuda.current_stream(device).wait_stream(self.stream)
            self.k.record_stream(torch.cuda.current_stream(device))
        self.k.index_copy_(0, to_device(where, device), to_device(decided, device))
        return self.k


class GridAhead:
    """:func:`~privkit.mechanisms.grid_noise.rounded_gaussian` draws on a device, each made one
    release ahead (module docstring); one per stream. A draw is kept ahead for each of the last
    :data:`KEPT` scales and lengths released, so that models taking turns on one stream (a
    distillation's pair) each find theirs."""

    KEPT = 4

    def __init__(self) -> None:
        self._next: dict[tuple[float, int, float], _Ahead] = {}

    def take(
        self, scale: float, n: int, bits: BitSource, *, margin: float = _MARGIN
    ) -> torch.Tensor:
        """``n`` integers of the rounded Gaussian of scale ``scale`` (:func:`rounded_gaussian`'s
        law and arguments): the draw made ahead where one was made for these, else one made now;
        then the next such release's draw, ahead."""
        key = (float(scale), int(n), float(margin))
        ahead = self._next.pop(key, None)
        k = ahead.settled(bits) if ahead is not None else None
        if k is None:
            k = rounded_gaussian(scale, n, bits, margin=margin)
        drawn = _Ahead.draw(key, bits)
        if drawn is not None:
            self._next[key] = drawn
            while len(self._next) > self.KEPT:  # the longest unused goes
                del self._next[next(iter(self._next))]
        return k
