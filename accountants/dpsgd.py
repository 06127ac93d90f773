"""Subsampled Gaussian mechanism (DP-SGD, DP-FedAvg, FedKADP): events and epsilon.

``noise_multiplier`` is, as in opacus and dp-accounting, the noise std divided by the clipping
norm C.  Accounting paths:

- Poisson sampling, add/remove-one neighbours: dp-accounting RDP and PLD, opacus PRV.
- Fixed-size sampling without replacement: dp-accounting supports it only under RDP and only for
  the replace-one relation (Wang, Balle & Kasiviswanathan 2019).  Replacing one example moves the
  clipped-gradient sum by up to 2C, so the event privkit builds carries ``noise_multiplier / 2``
  (std relative to the replace-one sensitivity); the result says so.

PLD uses dp-accounting's pessimistic connect-the-dots discretisation, so its epsilon is an upper
bound.  The default ``value_discretization_interval`` is :data:`PLD_VDI` = 1e-4: on the MNIST
DP-SGD case (q=256/60000, sigma=1.1, 14063 steps) it gives 2.38178 (1e-3 gives 2.39062, a
0.4% looser bound) in about 0.25 s; cost is nearly flat in the number of steps.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass
from fractions import Fraction

import dp_accounting as dpa

from accountants._validate import (
    MAX_STEPS,
    check_choice,
    check_int,
    check_open_unit,
    check_positive,
    check_real,
)
from accountants.fast import PldAccountant, PldGridError, RdpAccountant

__all__ = [
    "PLD_VDI",
    "DpsgdResult",
    "dpsgd_accounting",
    "dpsgd_epsilon",
    "dpsgd_event",
    "neighbouring_relation",
    "new_accountant",
    "prv_bracket",
]

PLD_VDI = 1e-4
"""Default value discretisation interval of privkit's PLD accountants (the epsilon grid step)."""
SAMPLINGS = ("poisson", "without-replacement")
ACCOUNTANTS = ("rdp", "pld", "prv")
NEIGHBOURINGS = ("add_remove", "replace_one")
WOR_NOTE = (
    "sampling without replacement is accounted only by dp-accounting's RDP accountant under the "
    "replace-one neighbouring relation; the event uses noise_multiplier/2 because replacing one "
    "example moves the clipped sum by up to 2 x the clipping norm"
)


def neighbouring_relation(name: str) -> dpa.NeighboringRelation:
    """dp-accounting's enum for ``"add_remove"`` or ``"replace_one"``."""
    check_choice(name, "neighbouring", NEIGHBOURINGS)
    if name == "add_remove":
        return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    return dpa.NeighboringRelation.REPLACE_ONE


def _check_sample_rate(q: float) -> float:
    q = check_real(q, "sample_rate")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1]; found {q!r}")
    return q


def _wor_sizes(sample_rate: float, dataset_size: int | None) -> tuple[int, int]:
    """(dataset size N, batch size B) with B/N == sample_rate."""
    if dataset_size is not None:
        n = check_int(dataset_size, "dataset_size")
        b = round(sample_rate * n)
        if b < 1 or abs(b / n - sample_rate) > 1e-9 * sample_rate:
            raise ValueError(
                f"sample_rate * dataset_size must be an integer batch size; found "
                f"{sample_rate!r} * {n} = {sample_rate * n!r}"
            )
        return n, b
    frac = Fraction(sample_rate).limit_denominator(10**7)
    if abs(float(frac) - sample_rate) > 1e-12 * sample_rate:
        raise ValueError(
            f"sample_rate={sample_rate!r} is not a ratio batch/dataset with dataset <= 1e7; "
            "pass dataset_size"
        )
    return frac.denominator, frac.numerator


def dpsgd_event(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    sampling: str = "poisson",
    *,
    dataset_size: int | None = None,
) -> dpa.DpEvent:
    """The dp-accounting event of ``steps`` subsampled-Gaussian steps.

    Parameters
    ----------
    sample_rate : float
        Poisson sampling probability, or batch/dataset size for sampling without replacement.
    noise_multiplier : float
        Noise std / clipping norm (> 0).
    steps : int
        Number of steps (>= 1).
    sampling : {"poisson", "without-replacement"}
        Sampling scheme.  Without replacement the event is
        ``SampledWithoutReplacementDpEvent(N, B, GaussianDpEvent(noise_multiplier / 2))``, to be
        accounted under replace-one (see module docstring).
    dataset_size : int, optional
        N for sampling without replacement; by default inferred from ``sample_rate`` as a fraction.
    """
    q = _check_sample_rate(sample_rate)
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    steps = check_int(steps, "steps", maximum=MAX_STEPS)
    check_choice(sampling, "sampling", SAMPLINGS)
    if sampling == "poisson":
        inner: dpa.DpEvent = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    else:
        n, b = _wor_sizes(q, dataset_size)
        inner = dpa.SampledWithoutReplacementDpEvent(n, b, dpa.GaussianDpEvent(sigma / 2.0))
    return dpa.SelfComposedDpEvent(inner, steps) if steps > 1 else inner


@dataclass(frozen=True)
class DpsgdResult:
    """Epsilon of a DP-SGD run with the assumptions it rests on."""

    epsilon: float
    delta: float
    accountant: str
    sampling: str
    neighbouring: str
    warnings: tuple[str, ...]


PRV_MAX_POINTS = 20_000_000  # about 3.6 GB at the ~180 bytes per grid point measured for opacus
PRV_BYTES_PER_POINT = 180


def prv_grid_points(
    q: float, sigma: float, steps: int, delta: float, eps_error: float = 0.01
) -> int:
    """Size of the grid opacus's PRV accountant would build (its own domain rule, Gopi et al. 2021)."""
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV

    with warnings.catch_warnings(), _opacus_arithmetic(q, sigma, steps):
        warnings.simplefilter(
            "ignore"
        )  # opacus's RDP-based domain bound warns about its order grid
        domain = PRVAccountant()._get_domain(
            [PoissonSubsampledGaussianPRV(q, sigma)], [steps], eps_error, delta / 1000
        )
    return int(domain.size)


@contextlib.contextmanager
def _opacus_arithmetic(q: float, sigma: float, steps: int):
    """opacus's float errors at extreme inputs (sigma**2 underflowing to 0, a domain past float
    range) as one ValueError naming the inputs."""
    try:
        yield
    except (ArithmeticError, OverflowError) as exc:
        raise ValueError(
            f"accountant prv cannot account noise_multiplier={sigma!r}, sample_rate={q:g}, "
            f"steps={steps}: opacus's arithmetic fails ({type(exc).__name__}: {exc}); use "
            "accountant rdp"
        ) from None


def _available_bytes() -> int | None:
    """Memory the kernel can give without swapping: MemAvailable (free pages plus reclaimable
    cache), not the free pages alone, which a machine whose page cache holds a test suite's
    files reports as a fraction of what it can hand out. None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def _prv_limit() -> int:
    """Grid points allowed: PRV_MAX_POINTS, or less when the machine has less available memory."""
    available = _available_bytes()
    if available is None:
        return PRV_MAX_POINTS
    return int(min(PRV_MAX_POINTS, available / (2 * PRV_BYTES_PER_POINT)))


def prv_bracket(
    q: float, sigma: float, steps: int, delta: float, eps_error: float = 0.01
) -> tuple[float, float, float]:
    """(lower, estimate, upper) epsilon of opacus's PRV accountant (Gopi, Lee & Wutschitz 2021).

    The lower and upper ends are certified (their Thm. 5.5): the true epsilon lies between them.
    Raises ``ValueError`` naming ``steps`` when the PRV grid would not fit in memory.
    """
    # opacus pulls in torch; import lazily so `accountants` itself stays torch-free.
    from opacus.accountants import PRVAccountant

    points = prv_grid_points(q, sigma, steps, delta, eps_error)
    # the certificate's own limit first: it holds on every machine, the memory cap on this one
    rounding = steps * 20 * math.ceil(math.log2(max(points, 2))) * 2.0**-52
    if rounding > delta / 10:
        # PRV composes by FFT in float64: about 20 log2(points) x 2^-52 of the mass lands on the
        # bins per level and step composed (the order of what accountants.certified bounds
        # rigorously). Gopi et al.'s certificate covers discretisation and truncation, not that
        # rounding: where its order reaches a tenth of delta the interval is not certified (at
        # delta 1e-12 and 3000 steps it put a "lower" end above the certified PLD's upper one)
        raise ValueError(
            f"accountant prv is not certified at delta={delta:g} with steps={steps}: its FFT's "
            f"float rounding (of order {rounding:.2g}) passes a tenth of delta; use accountant "
            "pld (certified against its own rounding)"
        )
    limit = _prv_limit()
    if points > limit:
        raise ValueError(
            f"accountant prv needs a grid of {points:,} points (about {points * PRV_BYTES_PER_POINT / 2**30:.1f} "
            f"GiB) at steps={steps}, sample_rate={q:g}; privkit allows {limit:,} on this machine: use "
            "accountant pld (same tightness, memory nearly flat in steps)"
        )
    delta_error = delta / 1000  # opacus's default
    acc = PRVAccountant()
    acc.history = [(sigma, q, steps)]
    with warnings.catch_warnings(), _opacus_arithmetic(q, sigma, steps):
        warnings.simplefilter("ignore")
        dprv = acc._get_dprv(eps_error=eps_error, delta_error=delta_error)
        low, est, up = dprv.compute_epsilon(delta, delta_error, eps_error)
    if not (math.isfinite(low) and math.isfinite(up)) or not low <= up:
        raise ValueError(
            f"accountant prv gave no finite interval ([{low}, {up}]) at noise_multiplier={sigma!r}, "
            f"steps={steps}; use accountant rdp or pld"
        )
    return float(low), float(est), float(up)


def _prv_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    # the upper end of the certified interval, as opacus's get_epsilon returns it (eps_error=0.01)
    return prv_bracket(q, sigma, steps, delta)[2]


def dpsgd_accounting(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    sampling: str = "poisson",
    accountant: str = "rdp",
    *,
    dataset_size: int | None = None,
    value_discretization_interval: float = PLD_VDI,
) -> DpsgdResult:
    """Epsilon at ``delta`` of subsampled-Gaussian steps, with neighbouring relation and caveats.

    Parameters
    ----------
    sample_rate, noise_multiplier, steps, sampling, dataset_size
        As in :func:`dpsgd_event`.
    delta : float
        Target delta in (0, 1).
    accountant : {"rdp", "pld", "prv"}
        dp-accounting RDP (default orders), dp-accounting PLD (pessimistic, upper bound), or
        opacus PRV (upper end of its certified interval; Poisson only).  Where the PLD's grid would
        pass :data:`~accountants.fast.MAX_PLD_POINTS` (epsilon in the thousands on the default grid,
        or steps beyond any grid) the result is RDP's, with ``accountant="rdp"`` and a warning
        saying why.

    Raises
    ------
    ValueError
        On invalid values, or sampling without replacement with an accountant other than rdp.
    """
    delta = check_open_unit(delta, "delta")
    check_choice(accountant, "accountant", ACCOUNTANTS)
    event = dpsgd_event(sample_rate, noise_multiplier, steps, sampling, dataset_size=dataset_size)
    warns: list[str] = []
    if sampling == "without-replacement":
        if accountant != "rdp":
            raise ValueError(
                f"accountant must be rdp for sampling without replacement; found {accountant!r} "
                f"({WOR_NOTE})"
            )
        warns.append(WOR_NOTE)
        rel = "replace_one"
    else:
        rel = "add_remove"
    if accountant == "prv":
        eps = _prv_epsilon(float(sample_rate), float(noise_multiplier), int(steps), delta)
    else:
        try:
            eps = _dpa_epsilon(event, delta, accountant, rel, value_discretization_interval)
        except PldGridError as exc:  # past the PLD's size: RDP's bound, never a smaller number
            warns.append(
                f"pld left out: {exc}; epsilon from rdp instead (an upper bound, not tight)"
            )
            accountant = "rdp"
            eps = _dpa_epsilon(event, delta, accountant, rel)
    return DpsgdResult(eps, delta, accountant, sampling, rel, tuple(warns))


def new_accountant(
    kind: str, relation: str = "add_remove", vdi: float = PLD_VDI
) -> dpa.PrivacyAccountant:
    """An empty dp-accounting RDP or PLD accountant (vectorised subsampled Gaussian, :mod:`accountants.fast`)."""
    rel = neighbouring_relation(relation)
    if kind == "rdp":
        return RdpAccountant(neighboring_relation=rel)
    return PldAccountant(rel, value_discretization_interval=vdi)


def _dpa_epsilon(
    event: dpa.DpEvent, delta: float, accountant: str, rel: str, vdi: float = PLD_VDI
) -> float:
    acc = new_accountant(accountant, rel, vdi)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def dpsgd_epsilon(
    sample_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    sampling: str = "poisson",
    accountant: str = "rdp",
    *,
    dataset_size: int | None = None,
    value_discretization_interval: float = PLD_VDI,
) -> float:
    """Epsilon only; see :func:`dpsgd_accounting` for the neighbouring relation and warnings."""
    return dpsgd_accounting(
        sample_rate,
        noise_multiplier,
        steps,
        delta,
        sampling,
        accountant,
        dataset_size=dataset_size,
        value_discretization_interval=value_discretization_interval,
    ).epsilon
