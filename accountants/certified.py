"""A PLD epsilon with a rigorous allowance for the floating-point error of its own composition.

dp-accounting composes privacy-loss distributions with FFTs.  An FFT's rounding error is
*absolute*: about ``log2(N) * 2**-52`` of the total mass (1) lands on every bin, whatever that
bin's mass, and a self-composition of ``T`` steps multiplies it by ``T``.  The masses that decide
epsilon at a small delta are far below that floor (1e-12 and less), so the plain composition can
lose them and print an epsilon below the exact one (``privkit budget dpsgd --sample-rate 0.3
--noise-multiplier 1.5 --steps 3000 --delta 1e-12`` gave 152.857 where the exact one is above
153.186).

:func:`certified_epsilon` recomposes the same pessimistic (connect-the-dots) pmfs with an
*exponentially tilted* FFT and a bound on its error:

1. Tilt.  Each step's pmf ``p(l)`` on the grid becomes ``p_theta(l) = p(l) e^(theta l) / M(theta)``
   (``M`` its moment generating function), a distribution centred near the epsilon sought
   (``theta`` minimises the Chernoff exponent ``Lambda(theta) - theta eps``, ``Lambda`` the sum of
   the steps' ``log M``).  The composition of the tilted pmfs is the tilted composition:
   ``r(l) = r_theta(l) e^(Lambda(theta) - theta l)``, so an absolute error in ``r_theta`` becomes,
   in the tail above epsilon, an error relative to that tail's own size.
2. Bound the error.  The composition is ``irfft(prod rfft(p_i)^c_i)`` on ``N`` points, the powers
   by binary powering.  With ``eps_fft = 20 ceil(log2 N) u`` (``u = 2**-52``; Higham, *Accuracy and
   Stability of Numerical Algorithms*, Thm. 24.2, gives about ``6.7 log2(N) u`` for a radix-2 FFT in
   2-norm; the factor 3 covers pocketfft's mixed radices), a complex product's ``sqrt(5) u``
   (Brent, Percival & Zimmermann 2007) and ``|rfft(p)_k| <= sum(p) = 1``, the computed
   ``r_theta`` differs from the exact one by at most (2-norm over the bins)::

       E = G (eps_fft sum_i c_i ||p_i||_2 + (sqrt(5) u T + eps_fft) (1 + eps_fft) min_i ||p_i||_2)

   ``G = prod_i (1 + eps_fft sqrt(N) ||p_i||_2)^c_i`` bounding the spectra's growth.  By
   Cauchy-Schwarz the delta at epsilon then moves by at most
   ``E sqrt(sum_{l > eps} e^(2 (Lambda - theta l)))``, a geometric sum in closed form.
3. Window.  Only the bins from a Chernoff lower end (tilted mass below it < 1e-30) to a Chernoff
   upper end are kept; the untilted mass above the window (a Chernoff bound, at most
   ``1e-10 delta``) is booked at infinity, and what the cyclic FFT wraps around moves non-negative
   mass only, which a pessimistic pmf may carry.
4. Epsilon.  The smallest epsilon whose delta, with the allowance above, the infinity masses and a
   relative ``1e-9 + 2e-13 T`` for the rounding of the steps' own pmfs (built from differences of
   accurate tail functions), is at most the target.  Everything is computed relative to ``delta``
   (log space), so no mass underflows at any delta float64 holds.

Where no allowance fits (the steps' own grids book more than ``delta`` at infinity, an event
privkit has no base pmf for, a window past :data:`~accountants.fast.MAX_PLD_POINTS`), it raises
:class:`PldPrecisionError` saying why; the callers then print RDP's epsilon with that reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import fft, signal

from accountants.pld_grid import MAX_PLD_POINTS, PldGridError

__all__ = ["PldPrecisionError", "certified_epsilon"]

_U = 2.0**-52
_FFT_LEVEL = 20.0  # rounding per radix-2 level of an FFT, in units of u (see the module doc)
_SQRT5 = math.sqrt(5.0)
_REL_BASE = 1e-9  # relative delta given away to the rounding of the final sums
_REL_STEP = 2e-13  # per step: the rounding of a step's pmf (tail-function differences, tilting)
_LOW_TAIL = 1e-30  # tilted mass left below the window (wraps upwards: never unsound)
_HIGH_TAIL = 1e-10  # untilted mass above the window, relative to delta (booked at infinity)
_ORDERS = np.concatenate([[0.0], np.geomspace(1e-3, 2e3, 64)])  # tilts tried, per nat
_BLOCKS = 4096  # blocks of a step's pmf for the upper bounds on its MGF
_EXP_FLOOR = -700.0  # exp() is fast down to here (1e-304); from about -708 it turns 20-200x slower


class PldPrecisionError(PldGridError):
    """privkit cannot certify a PLD epsilon at this delta (the message says why)."""


class _Part:
    """One step's pmf (finite part) on the grid, used ``count`` times."""

    def __init__(self, lower: int, probs: np.ndarray, infinity: float, count: int) -> None:
        keep = np.flatnonzero(probs > 0)
        if not keep.size:
            raise PldPrecisionError("a step's pmf has no finite mass: no certified PLD epsilon")
        self.lower = lower + int(keep[0])
        self.probs = np.asarray(probs[keep[0] : keep[-1] + 1], dtype=float)
        self.infinity = float(infinity)
        self.count = int(count)
        with np.errstate(divide="ignore"):
            self.log_probs = np.log(self.probs)
        self.index = np.arange(self.lower, self.lower + len(self.probs), dtype=float)
        # blocks of bins for upper bounds on the MGF (the window's Chernoff ends need only that):
        # about _BLOCKS blocks, each's mass at its upper (orders > 0) or lower (< 0) end
        size = max(1, -(-len(self.probs) // _BLOCKS))
        starts = np.arange(0, len(self.probs), size)
        with np.errstate(divide="ignore"):
            self.block_log_mass = np.log(np.add.reduceat(self.probs, starts))
        self.block_lo = self.index[starts]
        self.block_hi = self.index[np.minimum(starts + size - 1, len(self.probs) - 1)]

    def log_mgf(self, orders_per_bin: np.ndarray) -> np.ndarray:
        """``log sum_j p_j e^(s j)`` for every order ``s`` (per grid step).  Plain numpy, one order
        at a time in one buffer of the pmf's length (scipy's ``logsumexp`` costs four times as
        much here, and this is most of a certified epsilon's time); each order's value is the
        float the same formula gives on its own."""
        orders_per_bin = np.asarray(orders_per_bin, dtype=float)
        out = np.empty(len(orders_per_bin))
        x = np.empty(len(self.index))
        for i, order in enumerate(orders_per_bin):
            np.multiply(self.index, order, out=x)
            x += self.log_probs
            top = x.max()
            x -= top
            # terms below e^-700 (1e-304) raised to it: the sum holds exp(0) = 1 from the top
            # term, so their total (at most len * 1e-304) cannot change it, and exp runs 20-200x
            # slower near and in the subnormal range (most terms of the high orders)
            np.maximum(x, _EXP_FLOOR, out=x)
            np.exp(x, out=x)
            out[i] = top + np.log(x.sum())
        return out

    def log_mgf_upper(self, orders_per_bin: np.ndarray) -> np.ndarray:
        """An upper bound on :meth:`log_mgf` from the blocks (each block's mass at its end that
        maximises ``e^(s j)``): what Chernoff bounds need, at ``len(probs) / _BLOCKS`` the cost."""
        s = np.asarray(orders_per_bin, dtype=float)[:, None]
        x = self.block_log_mass[None, :] + s * np.where(s >= 0, self.block_hi, self.block_lo)
        top = x.max(axis=1)
        return top + np.log(np.exp(x - top[:, None]).sum(axis=1))


def _lambda(parts: Sequence[_Part], orders: np.ndarray, upper: bool = False) -> np.ndarray:
    """The composition's log MGF at ``orders`` (``upper``: an upper bound, for Chernoff bounds)."""
    if upper:
        return np.sum([p.count * p.log_mgf_upper(orders) for p in parts], axis=0)
    return np.sum([p.count * p.log_mgf(orders) for p in parts], axis=0)


def certified_epsilon(
    directions: Sequence[Sequence[tuple[object, int]]],
    delta: float,
    guess: float | Sequence[float] | None = None,
    *,
    lower: bool = False,
) -> float:
    """A certified upper bound on the exact epsilon at ``delta`` of the composition of pessimistic
    pmfs: ``directions`` holds, per direction of the neighbouring relation, the ``(pmf, count)``
    pairs of its steps (dp-accounting pmfs on one grid); the epsilon is the larger direction's.
    ``guess`` (an epsilon near the answer, e.g. the plain FFT's; one for all directions or one
    per direction) picks the tilt; without it a Chernoff bound does.  :class:`PldPrecisionError` where no certified value exists.

    ``lower=True`` takes optimistic pmfs instead and returns a certified *lower* bound: the largest
    epsilon whose delta, less the allowance (and the mass the cyclic FFT may have wrapped onto it),
    still exceeds ``delta``."""
    guesses = list(guess) if isinstance(guess, Sequence) else [guess] * len(directions)
    if lower and len(directions) > 1 and all(g is not None for g in guesses):
        # any direction's lower end bounds the larger direction's exact epsilon from below: the
        # direction whose plain value is the larger one alone (the other costs as much again)
        top = max(range(len(directions)), key=lambda i: guesses[i])  # type: ignore[arg-type,return-value]
        return _direction(list(directions[top]), delta, guesses[top], lower)
    return max(_direction(list(d), delta, g, lower) for d, g in zip(directions, guesses))


def _direction(
    pairs: list[tuple[object, int]], delta: float, guess: float | None, lower: bool
) -> float:
    if not pairs:
        return 0.0
    dense = [(pmf.to_dense_pmf(), count) for pmf, count in pairs if count > 0]  # type: ignore[attr-defined]
    if not dense:
        return 0.0
    vdi = float(dense[0][0]._discretization)
    parts = [_Part(d._lower_loss, d._probs, d._infinity_mass, c) for d, c in dense]
    steps = sum(p.count for p in parts)
    infinity = -math.expm1(math.fsum(p.count * math.log1p(-p.infinity) for p in parts))
    rel = _REL_BASE + _REL_STEP * steps
    if lower:
        infinity = 0.0  # an optimistic pmf's mass at infinity is dropped (a lowering)
    if infinity >= delta * (1 - rel):
        raise PldPrecisionError(
            f"the PLD grids book {infinity:.3g} of probability at infinity (their truncated "
            f"tails over {steps} steps), more than delta={delta:g}: no certified PLD epsilon"
        )
    orders = _ORDERS * vdi  # per grid step
    # the tilt's choice needs the exact MGF (an upper bound's error grows with steps x order x
    # block width and picks a poorer tilt); the window's Chernoff ends take upper bounds
    lam = _lambda(parts, orders)
    log_delta = math.log(delta)
    # Chernoff: P(L >= x) <= exp(Lambda(s) - s x); the x where that reaches delta
    with np.errstate(divide="ignore", invalid="ignore"):
        chernoff = np.where(orders > 0, (lam - log_delta) / orders, np.inf)
    start = float(np.min(chernoff)) * vdi
    # the tilt for the plain FFT's epsilon (close to the exact one) first, refined once around the
    # certified value; Chernoff's start only where that fails
    has_guess = guess is not None and math.isfinite(guess)
    targets = [guess] if has_guess else [start]
    best, reason = math.inf, ""
    tried: set[int] = set()
    for _ in range(3):
        target = targets.pop(0) if targets else None
        if target is None:
            break
        k = int(np.argmin(lam - orders * (target / vdi)))
        if k in tried:
            continue
        tried.add(k)
        try:
            eps = _tilted(parts, float(orders[k]), lam, orders, delta, infinity, rel, vdi, lower)
        except PldPrecisionError as exc:
            reason = str(exc)
            if has_guess and start not in targets and not math.isfinite(best):
                targets.append(start)
            continue
        best = max(best, eps) if lower and math.isfinite(best) else min(best, eps)
        if eps > 0:  # a zero leaves no tilt to refine (the untilted window is the widest)
            targets.insert(0, eps)
    if not math.isfinite(best):
        raise PldPrecisionError(reason or "no certified PLD epsilon")
    return best


def _tilted(
    parts: list[_Part],
    theta: float,
    lam: np.ndarray,
    orders: np.ndarray,
    delta: float,
    infinity: float,
    rel: float,
    vdi: float,
    lower: bool = False,
) -> float:
    """The certified epsilon (upper, or ``lower``) from one tilt ``theta`` (per grid step)."""
    steps = sum(p.count for p in parts)
    lam_theta = float(_lambda(parts, np.array([theta]))[0])
    lo_all = sum(p.count * p.lower for p in parts)
    hi_all = sum(p.count * (p.lower + len(p.probs) - 1) for p in parts)
    # window: tilted mass below `a` at most _LOW_TAIL (Chernoff with orders theta - s)
    # the window's ends are Chernoff bounds, valid at any order: a quarter of the orders suffices
    # (a slightly wider window costs less than the moment generating functions it would save)
    coarse = orders[::4]
    s = coarse[(coarse > 0) & (coarse < theta)] if theta > 0 else coarse[:0]
    a = lo_all
    if s.size:
        lam_minus = _lambda(parts, theta - s, upper=True)
        a = max(a, math.floor(float(np.max((math.log(_LOW_TAIL) + lam_theta - lam_minus) / s))))
    # untilted mass above `b` at most _HIGH_TAIL * delta: booked at infinity
    pos = orders > 0
    bound_b = np.min((lam[pos] - math.log(_HIGH_TAIL * delta)) / orders[pos])
    b = min(hi_all, math.ceil(float(bound_b)))
    # and tilted mass above `b` at most _LOW_TAIL: what the cyclic FFT wraps around is then
    # negligible (harmless for the upper end, bounded in the allowance of the lower end)
    cpos = coarse[coarse > 0]
    lam_plus = _lambda(parts, theta + cpos, upper=True)
    b_tilted = np.min((lam_plus - lam_theta - math.log(_LOW_TAIL)) / cpos)
    b = min(hi_all, max(b, math.ceil(float(b_tilted))))
    wrapped = 2 * _LOW_TAIL if lower else 0.0
    if b < a:
        b = a
    width = b - a + 1
    if width > 4 * MAX_PLD_POINTS:
        raise PldPrecisionError(
            f"the certified PLD composition needs a window of {width:,} grid points at "
            f"value_discretization_interval={vdi:g}; privkit builds at most {4 * MAX_PLD_POINTS:,}"
        )
    above = (
        0.0
        if b >= hi_all
        else float(np.exp(np.min(lam[pos] - orders[pos] * (b + 1))))  # P(J >= b + 1)
    )
    n = fft.next_fast_len(width, real=True)
    log_eps_fft = _FFT_LEVEL * math.ceil(math.log2(max(n, 2))) * _U
    spectrum = None
    norms = []
    for p in parts:
        tilted = np.exp(p.log_probs + theta * p.index - float(p.log_mgf(np.array([theta]))[0]))
        norms.append(float(np.sqrt(np.sum(tilted * tilted))) * (1 + 1e-10))
        folded = _fold(tilted, n)
        x = fft.rfft(folded, n)
        powered = _power(x, p.count)
        spectrum = powered if spectrum is None else spectrum * powered
        del x, folded, tilted
    assert spectrum is not None
    cyclic = fft.irfft(spectrum, n)
    del spectrum
    window = np.roll(cyclic, -((a - lo_all) % n))[:width]
    del cyclic
    e = log_eps_fft
    growth = math.exp(
        math.fsum(p.count * math.log1p(e * math.sqrt(n) * nm) for p, nm in zip(parts, norms))
    )
    err = (
        growth
        * (1 + 1e-6)
        * (
            e * math.fsum(p.count * nm for p, nm in zip(parts, norms))
            + (_SQRT5 * _U * (steps + len(parts)) + e) * (1 + e) * min(norms)
        )
    )
    # everything relative to delta: f_t = r(l_t) / delta
    idx = np.arange(a, a + width, dtype=float)
    expo = lam_theta - theta * idx - math.log(delta)
    capped = np.flatnonzero(expo > 700.0)  # losses far below epsilon: never used
    first_usable = int(capped[-1]) + 1 if capped.size else 0
    with np.errstate(over="ignore", under="ignore"):
        f = (window if lower else np.maximum(window, 0.0)) * np.exp(np.minimum(expo, 700.0))
    target = 1 + rel if lower else (1 - rel) - (infinity + above) / delta
    if not target > 0:
        raise PldPrecisionError(
            f"the PLD's infinity mass ({infinity + above:.3g}) leaves no room at delta={delta:g}"
        )
    # S_j = sum_{i > j} f_i (1 - e^{-(i - j) vdi}); tails from the top
    rev = f[::-1]
    tail = np.concatenate([np.cumsum(rev)[::-1][1:], [0.0]])  # sum_{i > j} f_i
    decay = math.exp(-vdi)
    weighted = signal.lfilter([0.0, decay], [1.0, -decay], rev)[::-1]  # sum_{i > j} f_i e^{-(i-j)v}
    with np.errstate(invalid="ignore", over="ignore"):
        s_j = tail - weighted
        # allowance: err * sqrt(sum_{i > j} e^{2 expo_i}) = err e^{expo_{j+1}} / sqrt(1 - e^{-2 theta})
        geo = -math.expm1(-2 * theta) if theta > 0 else None
        if geo is None:
            allow = err * np.sqrt(np.arange(width, 0, -1) - 1.0) * np.exp(np.minimum(expo, 700.0))
        else:
            allow = err * np.exp(np.minimum(expo - theta, 700.0)) / math.sqrt(geo)
        if lower:
            allow = allow + wrapped * np.exp(np.minimum(expo - theta, 700.0))
            return _lower_end(s_j, allow, tail, weighted, target, first_usable, a, vdi)
        ok = (s_j + allow) <= target
    ok[:first_usable] = False
    bad = np.flatnonzero(~ok)
    if not bad.size:  # the window's lowest loss already meets delta: the epsilon is at most it
        return max(0.0, a * vdi)
    j = int(bad[-1]) + 1  # every loss from here up meets delta, with the allowance
    if j >= width:
        raise PldPrecisionError(
            f"the FFT error allowance ({err:.3g} per unit of tilted mass) exceeds delta={delta:g} "
            "over the whole window: no certified PLD epsilon"
        )
    # refine between the grid losses j - 1 and j: bins >= j, allowance of loss j - 1
    base = j - 1
    big = float(tail[base])
    small = float(weighted[base])
    room = target - float(allow[base])
    eps = (a + j) * vdi
    if small > 0 and big - room > 0:
        x = math.log((big - room) / small)
        eps = (a + base) * vdi + min(max(x, 0.0), vdi)
    return max(0.0, eps)


def _lower_end(
    s_j: np.ndarray,
    allow: np.ndarray,
    tail: np.ndarray,
    weighted: np.ndarray,
    target: float,
    first_usable: int,
    a: int,
    vdi: float,
) -> float:
    """The largest epsilon whose delta, less its allowance, is above ``target`` (relative)."""
    with np.errstate(invalid="ignore"):
        above = s_j - allow > target
    above[:first_usable] = False
    hits = np.flatnonzero(above)
    if not hits.size:
        return 0.0
    j = int(hits[-1])
    eps = (a + j) * vdi
    room = float(tail[j]) - float(allow[j]) - target
    if room > 0 and float(weighted[j]) > 0:
        x = math.log(room / float(weighted[j])) * (1 - 1e-12)
        eps += min(max(x, 0.0), vdi) * (1 - 1e-9)
    return max(0.0, eps)


def _fold(values: np.ndarray, n: int) -> np.ndarray:
    """``values`` summed modulo ``n`` (a cyclic convolution of period ``n`` sees no difference)."""
    if len(values) <= n:
        return values
    padded = np.zeros(-(-len(values) // n) * n)
    padded[: len(values)] = values
    return padded.reshape(-1, n).sum(axis=0)


def _power(x: np.ndarray, count: int) -> np.ndarray:
    """``x ** count`` by binary powering (relative error at most ``(count - 1) sqrt(5) u``)."""
    result = None
    base = x
    while True:
        if count & 1:
            result = base.copy() if result is None else result * base
        count >>= 1
        if not count:
            break
        base = base * base
    assert result is not None
    return result
