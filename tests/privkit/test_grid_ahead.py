"""The grid's draws made one release ahead (privkit.mechanisms.grid_ahead) are rounded_gaussian's.

With a fixed-key ChaCha20 stream (on the CPU here; on a GPU with PRIVKIT_TEST_DEVICE=cuda in
test_on_device.py), release after release the integers equal those rounded_gaussian draws from a
twin stream in order: the law is the same draw for draw, not merely in distribution. A buffer
that overflows, or a release of another scale or length, draws then; the draws made ahead are
never pickled.
"""

import pickle

import numpy as np
import pytest
import torch

from privkit.mechanisms import grid_ahead
from privkit.mechanisms.device_random import ChaChaStream
from privkit.mechanisms.dp_random import DpRandom, aes_generator
from privkit.mechanisms.gaussian import gaussian_release
from privkit.mechanisms.grid_ahead import GridAhead
from privkit.mechanisms.grid_noise import (
    Grid,
    WordBits,
    rounded_gaussian,
    snap_add,
    tail_estimates,
)

SCALE = Grid.for_release(1.0, 1.0, 20_000).scale  # the scale of a release at multiplier 1


def _twins(key: int = 5) -> tuple[WordBits, WordBits]:
    return WordBits(ChaChaStream("cpu", key=key)), WordBits(ChaChaStream("cpu", key=key))


@pytest.mark.parametrize(
    "scale, margin",
    [(SCALE, None), (1000.0, 2.0**-20)],  # a release's scale; many draws near a half-integer
    ids=["release-scale", "settled-draws"],
)
def test_draws_made_ahead_are_rounded_gaussians_draws_in_order(scale, margin):
    kw = {} if margin is None else {"margin": margin}
    bits, twin = _twins()
    ahead = GridAhead()
    for _ in range(4):
        got = ahead.take(scale, 20_000, bits, **kw)
        want = rounded_gaussian(scale, 20_000, twin, **kw)
        assert torch.equal(got, want)
    assert list(ahead._next) == [(scale, 20_000, margin or grid_ahead._MARGIN)]


def test_open_draws_are_compacted_in_order():
    """The copy to the host holds every open draw's position, in order, and its cell."""
    bits = WordBits(ChaChaStream("cpu", key=3))
    drawn = grid_ahead._Ahead.draw((1000.0, 5000, 2.0**-20), bits)
    assert drawn is not None
    u = WordBits(ChaChaStream("cpu", key=3)).bits53(5000)
    a = torch.special.ndtri(u * 2.0**-53 + 2.0**-54) * 1000.0
    host = drawn.copy.result()
    count = int(host[0])
    where = host[1 : 1 + count].long()
    assert 20 < count < grid_ahead.open_capacity(5000)
    assert torch.equal(where, where.sort().values) and len(set(where.tolist())) == count
    cap = grid_ahead.open_capacity(5000)
    assert torch.equal(host[1 + cap :][:count], u[where])
    assert torch.equal(host[1 + 2 * cap :][:count], tail_estimates(u[where], 1000.0))
    # what is left closed is the bulk's decision: the estimate within the limit of its integer
    closed = torch.ones(5000, dtype=torch.bool)
    closed[where] = False
    assert (a[closed] - drawn.k[closed]).abs().max() < 0.5


def test_an_overflowing_buffer_draws_again(monkeypatch):
    """More open draws than the buffer holds: that release draws anew (the draw ahead dropped,
    its bits unused), as a twin stream that skips them."""
    monkeypatch.setattr(grid_ahead, "_OPEN_SHARE", 0.0)
    monkeypatch.setattr(grid_ahead, "_OPEN_MARGIN", 3)  # about 54 open of 20,000: overflows
    bits, twin = _twins()
    ahead = GridAhead()
    for step in range(3):
        got = ahead.take(SCALE, 20_000, bits)
        if step:
            twin.bits53(20_000)  # the draw made ahead, dropped
        assert torch.equal(got, rounded_gaussian(SCALE, 20_000, twin))


def test_releases_taking_turns_each_find_their_draw():
    """Two lengths released in turn each use the draw made ahead for them; past KEPT lengths the
    longest unused draw is dropped."""
    bits, twin = _twins()
    ahead = GridAhead()
    first = [ahead.take(SCALE, n, bits) for n in (3000, 4000)]
    again = [ahead.take(SCALE, n, bits) for n in (3000, 4000)]
    want = {n: [rounded_gaussian(SCALE, n, twin) for _ in range(2)] for n in (3000, 4000)}
    assert torch.equal(first[0], want[3000][0]) and torch.equal(first[1], want[4000][0])
    assert torch.equal(again[0], want[3000][1]) and torch.equal(again[1], want[4000][1])
    for n in range(5000, 5000 + GridAhead.KEPT + 2):
        ahead.take(SCALE, n, bits)
    assert (
        len(ahead._next) == GridAhead.KEPT and (SCALE, 3000, grid_ahead._MARGIN) not in ahead._next
    )


def test_a_device_stream_releases_with_its_draws_ahead_and_never_pickles_them():
    """``gaussian_release`` on a device stream (forced on the CPU here) takes the draws ahead:
    the grid release of the twin stream, release after release; a pickled stream carries none;
    a CPU stream has none."""
    clean = torch.linspace(-1, 1, 3000)
    source = DpRandom(aes_generator(key=1), "cpu", normals=ChaChaStream("cpu", key=8))
    twin = WordBits(ChaChaStream("cpu", key=8))
    grid = Grid.for_release(1.0, 1.0, 3000)
    for _ in range(3):
        got, _ = gaussian_release(clean, std=1.0, sensitivity=1.0, source=source)
        want = snap_add(clean, rounded_gaussian(grid.scale, 3000, twin), grid.gamma)
        assert torch.equal(got, want)
    assert source.grid_ahead() is not None and source.grid_ahead()._next
    back = pickle.loads(pickle.dumps(source))
    assert back._ahead is None
    assert DpRandom(aes_generator(key=1)).grid_ahead() is None


def test_no_draw_is_made_ahead_where_none_can_be_decided_in_bulk():
    bits, twin = _twins()
    ahead = GridAhead()
    got = ahead.take(0.1, 500, bits)  # a scale below 1/6: every draw on its own
    assert torch.equal(got, rounded_gaussian(0.1, 500, twin)) and not ahead._next
    assert grid_ahead._Ahead.draw((SCALE, 0, grid_ahead._MARGIN), bits) is None


def test_the_integers_drawn_ahead_have_the_rounded_gaussian_moments():
    """Over 400,000 draws made ahead: mean 0 and variance scale^2 + 1/12 within four standard
    errors (a check of the wiring on top of the equality with rounded_gaussian above)."""
    bits = WordBits(ChaChaStream("cpu", key=11))
    ahead = GridAhead()
    k = torch.cat([ahead.take(50.0, 100_000, bits) for _ in range(4)]).numpy()
    n, var = k.size, 50.0**2 + 1 / 12
    assert abs(k.mean()) < 4 * np.sqrt(var / n)
    assert abs(k.var() / var - 1) < 4 * np.sqrt(2 / n)
