"""The Gaussian release: the one function of privkit's single-model mechanisms that adds DP noise
to a value, and the receipt it hands back.

``gaussian_release(clean, std=..., sensitivity=..., source=...)`` returns ``(released, receipt)``:

* **the noise**: ``N(0, std^2)`` on every coordinate of ``clean`` (a tensor, a list or dict of
  tensors making one release, or a numpy array), drawn from ``source``. A seeded stream
  (reproducible mode: a ``torch.Generator`` or a seeded ``numpy.random.Generator``) draws exactly
  as torch and numpy draw, tensor by tensor (a dict in the order of its sorted names), so seeded
  results are bit-identical to the code that drew its own noise before this module existed. The
  release stream (:class:`privkit.mechanisms.dp_random.DpRandom` over AES-CTR, or ChaCha20 on an
  accelerator) puts every released float on the data-independent grid of
  :mod:`privkit.mechanisms.grid_noise`, whose noise covers its own rounding (the floating-point attack does
  not apply);
* **the audit's mutation**: under :func:`privkit.mechanisms.mutations.mutated` the noise drawn is ``std``
  times the mutation's factor, the planted bug an audit must catch; the receipt does not see it
  (it states what the mechanism claims to run, as a buggy mechanism's ledger would);
* **the receipt**: :class:`Receipt`, the dp-accounting event of the release, from the same
  ``std`` and ``sensitivity`` that drew the noise (``GaussianDpEvent(std / sensitivity)``, Poisson
  subsampled at ``sample_rate`` where the mechanism sampled its records). Trainers compose
  receipts into their ledgers (:func:`compose_receipts`) instead of rebuilding events from their
  configuration.

Releases stacked as rows whose records were sampled at unequal Poisson rates (one row per model of
a batched engine) go through :func:`gaussian_release_rows`: one draw for all rows, a receipt per
row at its own rate.

A batched engine that draws its seeded noise a block of steps at a time hands the primitive a
:class:`NormalRows` (the same numbers, one row per release); one that trains many models at once
on a leading model axis hands it a :class:`ModelRows` (each model's stream drawn a block of steps
at a time, seeded or on the grid, one release per model and step). No other module of privkit
draws release noise (``tests/privkit/test_release_primitive.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from privkit.errors import PrivkitError
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_random import DpRandom, is_secret

__all__ = [
    "ModelRows",
    "NormalRows",
    "Receipt",
    "compose_receipts",
    "gaussian_release",
    "gaussian_release_rows",
]


@dataclass(frozen=True)
class Receipt:
    """What one Gaussian release ran, as the accountant reads it.

    Attributes
    ----------
    noise_multiplier : float
        ``std / sensitivity`` of the noise the release claims.
    sensitivity : float
        The L2 sensitivity the noise was calibrated to.
    sample_rate : float or None
        The Poisson rate at which the mechanism sampled its records (``None``: every record, no
        sampling).
    releases : int
        How many releases of this kind the receipt stands for (rows of a matrix released row by
        row; 1 otherwise).
    """

    noise_multiplier: float
    sensitivity: float
    sample_rate: float | None = None
    releases: int = 1

    @property
    def event(self):
        """The dp-accounting event of this receipt."""
        import dp_accounting as dpa

        inner: Any = dpa.GaussianDpEvent(self.noise_multiplier)
        if self.sample_rate is not None:
            inner = dpa.PoissonSampledDpEvent(self.sample_rate, inner)
        return dpa.SelfComposedDpEvent(inner, self.releases) if self.releases > 1 else inner


def compose_receipts(receipts: Sequence[Receipt]):
    """The dp-accounting event of a sequence of releases: consecutive equal receipts as one
    ``SelfComposedDpEvent`` (the shape ``accountants.dpsgd_event`` builds for repeated steps), a
    ``ComposedDpEvent`` of the runs otherwise."""
    import dp_accounting as dpa

    if not receipts:
        raise PrivkitError("compose_receipts needs at least one receipt; found none")
    runs: list[tuple[Receipt, int]] = []
    for r in receipts:
        one = Receipt(r.noise_multiplier, r.sensitivity, r.sample_rate, 1)
        if runs and runs[-1][0] == one:
            runs[-1] = (one, runs[-1][1] + r.releases)
        else:
            runs.append((one, r.releases))
    events = [dpa.SelfComposedDpEvent(one.event, n) if n > 1 else one.event for one, n in runs]
    return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)


def _tensors(clean: Any) -> tuple[list[torch.Tensor], Any]:
    """The release's tensors in draw order and a function rebuilding ``clean``'s structure."""
    if isinstance(clean, torch.Tensor):
        return [clean], lambda out: out[0]
    if isinstance(clean, dict):
        names = sorted(clean)
        return [clean[k] for k in names], lambda out: dict(zip(names, out))
    if isinstance(clean, (list, tuple)):
        return list(clean), list
    raise PrivkitError(
        f"clean must be a tensor, a list or dict of tensors, or a numpy array; found "
        f"{type(clean).__name__}"
    )


class NormalRows:
    """A seeded stream's standard normals for a run of releases of ``width`` numbers each, drawn
    ``block`` releases at a time (one ``(rows, width)`` draw) and handed out one row per release.

    A batched engine draws its noise this way for speed; passing a ``NormalRows`` as the
    ``source`` of :func:`gaussian_release` keeps those bits exactly while every release still goes
    through the primitive (its mutation and its receipt). Reproducible mode only.

    Parameters
    ----------
    source : DpRandom or torch.Generator
        The seeded stream (a :class:`~privkit.mechanisms.dp_random.DpRandom` over the release stream is
        refused).
    width : int
        How many numbers one release takes: each row's length.
    total : int
        The number of releases (rows) the run makes; asking for more raises.
    block : int
        Rows per draw (the last draw takes what is left of ``total``).
    """

    def __init__(self, source: DpRandom | torch.Generator, width: int, total: int, block: int):
        self.source = DpRandom.of(source)
        if not self.source.seeded_torch:
            raise PrivkitError("NormalRows is for a seeded stream; found the release stream")
        self.width, self.left, self.block = int(width), int(total), int(block)
        self._rows: torch.Tensor | None = None
        self._at = 0

    def next_row(self) -> torch.Tensor:
        """The next release's ``width`` standard normals."""
        if self._rows is None or self._at == self._rows.shape[0]:
            if self.left <= 0:
                raise PrivkitError("NormalRows has handed out every release it was sized for")
            self._rows = self.source.randn(min(self.block, self.left), self.width)
            self.left -= self._rows.shape[0]
            self._at = 0
        row = self._rows[self._at]
        self._at += 1
        return row


class ModelRows:
    """The noise of ``M`` models trained at once, one stream per model: each model's releases of
    ``width`` numbers drawn ``block`` releases at a time (one draw per model and block, into one
    ``(M, block, width)`` buffer) and handed out one step at a time, a row per model.

    The stacked engine (:func:`privkit.batched.batched_sgd.train_many`) passes it as the
    ``source`` of :func:`gaussian_release` with a value stacked on a leading model axis (each
    tensor ``(M, ...)``): model j's row is one release of model j. Seeded streams (reproducible
    mode) draw standard normals, ``randn(rows, width)`` per model and block (a
    :class:`NormalRows`' numbers); release streams (with noise) draw the integers of the data-independent grid
    (:mod:`privkit.mechanisms.grid_noise`, for the grid of the release's noise and sensitivity),
    and the noisy sums lie on it. A model whose releases have run out gets zeros (its row is
    never used: no NaN to mask).

    Parameters
    ----------
    sources : sequence of DpRandom or torch.Generator
        Model j's stream, on the device of the values released; all seeded or all release
        streams.
    width : int
        How many numbers one model's release takes.
    totals : sequence of int
        Model j's number of releases; the steps run until the largest.
    block : int
        Releases (steps) per draw.
    device : torch.device
        Where the buffer lives (the released values' device).
    """

    def __init__(
        self,
        sources: Sequence[DpRandom | torch.Generator],
        width: int,
        totals: Sequence[int],
        block: int,
        device: torch.device | str = "cpu",
    ):
        self.sources = [DpRandom.of(s) for s in sources]
        kinds = {s.seeded_torch for s in self.sources}
        if len(kinds) != 1 or len(totals) != len(self.sources):
            raise PrivkitError(
                "ModelRows needs one stream per model, all seeded or all release streams; found "
                f"{len(self.sources)} streams ({len(kinds)} kinds) for {len(totals)} models"
            )
        self.seeded = kinds.pop()
        self.width, self.block = int(width), int(block)
        self.totals = [int(t) for t in totals]
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None
        self._grid: Any = None
        self._step, self._at, self._rows = 0, 0, 0  # next step; its row in the block; block rows

    def next_rows(self, grid: Any = None) -> torch.Tensor:
        """The next step's ``(M, width)`` noise: standard normals (``grid`` ``None``), or the
        integers of ``grid`` (a :class:`~privkit.mechanisms.grid_noise.Grid`; release streams)."""
        if self._at == self._rows:
            self._draw(grid)
        elif grid != self._grid:
            raise PrivkitError("ModelRows: every release of a block draws on the same grid")
        assert self._buffer is not None
        row = self._buffer[:, self._at]
        self._at += 1
        self._step += 1
        return row

    def _draw(self, grid: Any) -> None:
        from privkit.mechanisms.grid_noise import rounded_gaussian

        start, last = self._step, max(self.totals)
        if start >= last:
            raise PrivkitError("ModelRows has handed out every step it was sized for")
        if self._buffer is None or grid != self._grid:
            dtype = torch.float32 if grid is None else torch.float64  # grid integers: exact
            size = (len(self.sources), min(self.block, last), self.width)
            self._buffer = torch.empty(size, device=self.device, dtype=dtype)
        buffer = self._buffer
        for j, source in enumerate(self.sources):  # one draw per model and block of steps
            rows = max(0, min(self.block, self.totals[j] - start))
            if grid is None:
                source.randn(rows, self.width, out=buffer[j, :rows])
            else:
                buffer[j, :rows] = rounded_gaussian(
                    grid.scale, rows * self.width, source.bits()
                ).view(rows, -1)
            buffer[j, rows:].zero_()
        self._grid, self._at, self._rows = grid, 0, min(self.block, last - start)


def _model_rows_release(
    tensors: list[torch.Tensor], std: float, sens: float, rows: ModelRows, dim: int | None
) -> list[torch.Tensor]:
    """Each model's row of the stacked ``tensors`` released with its own stream's next noise."""
    from privkit.mechanisms.grid_noise import Grid, snap_add

    width = sum(t[0].numel() for t in tensors)
    if width != rows.width:
        raise PrivkitError(
            f"a model's release has {width} numbers but ModelRows are {rows.width} wide"
        )
    # seeded, or no noise at all (the stream's normals times 0): standard normals
    grid = None if rows.seeded or std == 0 else Grid.for_release(std, sens, dim or width)
    parts = rows.next_rows(grid).split([t[0].numel() for t in tensors], dim=1)
    if grid is None:
        return [torch.add(t, z.view_as(t), alpha=std) for t, z in zip(tensors, parts)]
    return [snap_add(t, z.view_as(t), grid.gamma) for t, z in zip(tensors, parts)]


def _row_release(tensors: list[torch.Tensor], std: float, rows: NormalRows):
    z = rows.next_row()
    if z.numel() != sum(t.numel() for t in tensors):
        raise PrivkitError(
            f"the release has {sum(t.numel() for t in tensors)} numbers but its NormalRows are "
            f"{z.numel()} wide"
        )
    # in place on the row, which no other release reads: (std * z) + t, bit for bit t + std * z
    parts = z.split([t.numel() for t in tensors])
    return [
        p.mul_(std).view_as(t).add_(t)
        if (p.dtype, p.device) == (t.dtype, t.device)
        else t + std * p.view_as(t)
        for t, p in zip(tensors, parts)
    ]


def _seeded_rows(
    tensors: list[torch.Tensor],
    std: float | torch.Tensor,
    source: DpRandom,
    rows: int,
    out: torch.Tensor | None,
):
    """Seeded noise for ``rows`` releases laid out as column blocks of ``tensors`` (each
    ``(rows, width_k)``): one ``(rows, sum width_k)`` draw (into ``out`` when given), the numbers
    a draw of the concatenated rows takes, scaled and added block by block (no copy of the clean
    values); returns each tensor's released block, a view of the draw."""
    t0 = tensors[0]
    widths = [t.shape[1] for t in tensors]
    shape = (rows, sum(widths))
    if out is None:
        noise = source.randn(shape, dtype=t0.dtype).to(t0.device)
    elif (tuple(out.shape), out.dtype, out.device) != (shape, t0.dtype, t0.device):
        raise PrivkitError(
            f"out must be a {shape} tensor of {t0.dtype} on {t0.device}; found "
            f"{tuple(out.shape)} of {out.dtype} on {out.device}"
        )
    else:
        noise = source.randn(shape, out=out)
    # one scale, or a (rows, 1) column of each row's
    noise.mul_(std.to(noise.device, noise.dtype) if isinstance(std, torch.Tensor) else std)
    blocks = list(noise.split(widths, dim=1))
    torch._foreach_add_(blocks, tensors)
    return blocks


def _torch_release(
    tensors: list[torch.Tensor],
    std: Any,  # a float, or a (rows, 1) tensor of each row's for seeded rows
    source: DpRandom,
    sens: float,
    dim,
    rows: int = 1,
    out: torch.Tensor | None = None,
):
    if out is not None and not (source.seeded_torch and rows > 1 and len(tensors) > 1):
        raise PrivkitError(
            "out takes the draw of several rows over several tensors from a seeded stream; "
            f"found {rows} row(s) over {len(tensors)} tensor(s), seeded={source.seeded_torch}"
        )
    if source.seeded_torch and rows > 1 and len(tensors) > 1:
        if any(t.dim() != 2 or t.shape[0] != rows or t.dtype != tensors[0].dtype for t in tensors):
            raise PrivkitError(
                f"releases={rows} over several tensors needs each of them (releases, width) of one "
                f"dtype; found {[tuple(t.shape) for t in tensors]}"
            )
        return _seeded_rows(tensors, std, source, rows, out)
    if source.seeded_torch or std == 0:
        # (std * z) + t, bit for bit as t + std * z (float addition commutes), in place on the
        # fresh draws: one pass and one buffer less per tensor; each draw per tensor, in order,
        # then the scaling and the addition as multi-tensor operations (on a GPU one launch for
        # every tensor, not one each: the same elementwise arithmetic)
        noise = [source.randn(t.shape, dtype=t.dtype).to(t.device) for t in tensors]
        if noise:  # the multi-tensor operations refuse an empty list
            torch._foreach_mul_(noise, std)
            torch._foreach_add_(noise, tensors)
        return noise
    from privkit.mechanisms.grid_noise import Grid, grid_release

    # one release, one vector: a few long draws instead of one short draw per tensor
    flat = torch.cat([t.reshape(-1) for t in tensors])
    grid = Grid.for_release(std, sens, flat.numel() if dim is None else dim)
    released = grid_release(flat, grid, source.bits(), source.grid_ahead())
    parts, at = [], 0
    for t in tensors:
        parts.append(released[at : at + t.numel()].view_as(t))
        at += t.numel()
    return parts


def _numpy_release(
    clean: np.ndarray, std: float, rng: np.random.Generator, sens: float, dim: int | None
) -> np.ndarray:
    if clean.dtype == np.float16:  # released in float32, rounded back after (as _widened)
        return _numpy_release(clean.astype(np.float32), std, rng, sens, dim).astype(np.float16)
    if not is_secret(rng):  # one draw of the whole shape, as numpy draws it
        return clean + rng.normal(0.0, std, size=clean.shape).astype(clean.dtype, copy=False)
    from privkit.mechanisms.grid_noise import CipherBits, Grid, grid_release

    grid = Grid.for_release(std, sens, clean.size if dim is None else dim)
    value = torch.from_numpy(np.ascontiguousarray(clean))
    return grid_release(value, grid, CipherBits(rng)).numpy()


def gaussian_release(
    clean: Any,
    *,
    std: float,
    sensitivity: float,
    source: DpRandom | torch.Generator | np.random.Generator | NormalRows | ModelRows,
    sample_rate: float | None = None,
    dim: int | None = None,
    releases: int = 1,
    mutate: bool = True,
) -> tuple[Any, Receipt]:
    """Release ``clean`` with ``N(0, std^2)`` noise on every coordinate; return it and its receipt.

    Parameters
    ----------
    clean : torch.Tensor, list or dict of torch.Tensor, or numpy.ndarray
        The pre-noise value of one release (a dict: one release over all its tensors, drawn in the
        order of its sorted names; a list: in its order), or ``releases`` releases stacked (rows;
        a list or dict of ``(releases, width)`` tensors: each release is a row of their
        concatenation, seeded noise drawn as for that concatenation). Half-precision values
        (bfloat16, float16) are released in float32 and rounded back to their dtype after.
    std : float
        The noise standard deviation the mechanism claims (``>= 0``; an audit's mutation scales
        what is drawn, not the receipt).
    sensitivity : float
        The L2 sensitivity of one release (``> 0``): the receipt's multiplier is
        ``std / sensitivity``, and in release mode the grid's noise covers its rounding at it.
    source : DpRandom, torch.Generator, numpy.random.Generator, NormalRows or ModelRows
        The noise stream: seeded (reproducible mode) or the release stream; a :class:`NormalRows`
        (a seeded stream drawn a block of releases at a time) hands this release one row; a
        :class:`ModelRows` (one stream per model) makes ``clean``, stacked on a leading model
        axis, one release per model, each with its model's next row (the receipt is each
        model's).
    sample_rate : float, optional
        The Poisson rate at which the mechanism sampled the records in ``clean`` (the receipt's
        subsampling); ``None`` for an unsampled release.
    dim : int, optional
        The number of coordinates of one release, where ``clean`` holds several (rows); default
        all of ``clean``.
    releases : int
        How many releases ``clean`` holds (rows released row by row; 1 otherwise).
    mutate : bool
        Whether an active audit mutation scales the noise drawn here; ``False`` where the caller
        has already drawn its ``std`` through the mutation (the batched engines and opacus' noise
        multiplier scale it once, for every model or step).

    Returns
    -------
    (released, Receipt)
        The released value in ``clean``'s structure, dtype and device, and its receipt.
    """
    _check([std], sensitivity, [sample_rate], releases)
    receipt = Receipt(std / sensitivity, float(sensitivity), sample_rate, releases)
    return _with_noise(clean, std, sensitivity, source, dim, releases, mutate), receipt


def _check(
    stds: Sequence[float], sensitivity: float, rates: Sequence[float | None], releases: int
) -> None:
    # each value once: a batched engine's step releases rows of 16 or more models
    for std in stds:
        if not (std >= 0 and math.isfinite(std)):
            raise PrivkitError(f"std must be a finite number >= 0; found {std}")
    if not (sensitivity > 0 and math.isfinite(sensitivity)):
        raise PrivkitError(f"sensitivity must be a finite number > 0; found {sensitivity}")
    for rate in rates:
        if rate is not None and not 0 < rate <= 1:
            raise PrivkitError(f"sample_rate must be in (0, 1]; found {rate}")
    if not isinstance(releases, int) or releases < 1:
        raise PrivkitError(f"releases must be an integer >= 1; found {releases!r}")


def _with_noise(
    clean: Any,
    std: Any,  # a float; a (rows, 1) tensor of each row's for seeded rows (gaussian_release_rows)
    sensitivity: float,
    source,
    dim,
    releases: int,
    mutate: bool,
    out: torch.Tensor | None = None,
):
    """``clean`` with its noise, drawn from ``source`` (the releases' validated arguments)."""
    # the audit's planted bug (a factor of 1.0 outside audits)
    drawn = std * mutations.active().noise_factor if mutate else std
    if isinstance(clean, np.ndarray):
        if not isinstance(source, np.random.Generator):
            raise PrivkitError(
                f"a numpy release needs a numpy Generator source; found {type(source).__name__}"
            )
        return _numpy_release(clean, drawn, source, sensitivity, dim)
    tensors, rebuild = _tensors(clean)
    dtypes = [t.dtype for t in tensors]
    tensors = [_widened(t) for t in tensors]
    if isinstance(source, NormalRows):
        released = _row_release(tensors, drawn, source)
    elif isinstance(source, ModelRows):
        released = _model_rows_release(tensors, drawn, sensitivity, source, dim)
    else:
        if isinstance(source, np.random.Generator):
            source = DpRandom(source)
        released = _torch_release(
            tensors, drawn, DpRandom.of(source), sensitivity, dim, releases, out
        )
    return rebuild([r if r.dtype == d else r.to(d) for r, d in zip(released, dtypes, strict=True)])


def _widened(t: torch.Tensor) -> torch.Tensor:
    """A half-precision tensor in float32 for its release
    (:func:`privkit.mechanisms.clip_precision.compute_dtype`); others as they are. Noise drawn and
    added in bfloat16 is the floating-point attack at its worst: a release from 0 lands off the
    ``2**-8`` grid near zero 47% of the time, a release from 1 never (1 plus the noise is rounded
    onto that grid there), and release mode's grid cannot be held in 8 bits. The float32 release
    rounded back to the tensor's dtype is post-processing."""
    from privkit.mechanisms.clip_precision import compute_dtype

    return t.to(compute_dtype(t.dtype)) if t.is_floating_point() else t


def gaussian_release_rows(
    clean: Any,
    *,
    std: float | Sequence[float],
    sensitivity: float,
    source: DpRandom | torch.Generator,
    sample_rates: Sequence[float | None],
    dim: int | None = None,
    mutate: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[Any, list[Receipt]]:
    """``len(sample_rates)`` releases stacked as rows, release ``r`` of records Poisson-sampled at
    ``sample_rates[r]``: their noise as :func:`gaussian_release` draws ``releases=len(sample_rates)``
    rows (the same numbers and arithmetic, one draw and one pass for all rows), and one receipt
    per row, at its own rate.

    A batched engine's rows are separate mechanisms (one per model) whose clients differ in size,
    so their rates differ; releasing them one row at a time gave the same numbers with a call,
    a receipt and two small operations per tensor for every row.

    Parameters
    ----------
    clean : torch.Tensor, list or dict of torch.Tensor
        The rows, as :func:`gaussian_release` takes ``releases`` rows: a tensor ``(rows, width)``
        or a list or dict of ``(rows, width_k)`` tensors (each row a release of their
        concatenation).
    std, sensitivity, source, dim, mutate
        As for :func:`gaussian_release`: the noise, the claimed sensitivity of one row, the
        stream, the coordinates of one row, and whether an audit's mutation scales the noise.
        ``std`` may also give each row its own scale (one per row; each row's receipt at its
        own): rows of a list or dict of several ``(rows, width_k)`` tensors from a seeded torch
        stream, the draw the same as for one scale and each row scaled by its own.
    sample_rates : Sequence[float or None]
        Each row's Poisson rate (each in ``(0, 1]``; ``None``: that row's records unsampled).
    out : torch.Tensor, optional
        A ``(rows, width)`` tensor of the rows' dtype and device the noise is drawn into (the
        same numbers), for a list or dict of several tensors and a seeded stream: the released
        rows are views of it, valid until it is written again. A caller releasing every step
        keeps one: a fresh draw of tens of MB is fresh pages from the system each time.

    Returns
    -------
    (released, list of Receipt)
        The released rows in ``clean``'s structure and each row's receipt, in row order.
    """
    rates = list(sample_rates)
    if not rates:
        raise PrivkitError("sample_rates must name one rate per row; found none")
    stds = [float(v) for v in std] if isinstance(std, Sequence) else [float(std)] * len(rates)
    if len(stds) != len(rates):
        raise PrivkitError(
            f"std must give one scale per row; found {len(stds)} for {len(rates)} rows"
        )
    _check(stds, sensitivity, rates, len(rates))
    receipts = [
        Receipt(v / sensitivity, float(sensitivity), sample_rate=rate)
        for v, rate in zip(stds, rates)
    ]
    scale: float | torch.Tensor = stds[0]
    if len(set(stds)) > 1:  # a scale per row: a (rows, 1) column the seeded rows' draw is scaled by
        seeded = isinstance(source, torch.Generator) or (
            isinstance(source, DpRandom) and source.seeded_torch
        )
        several = isinstance(clean, (dict, list, tuple)) and len(clean) > 1
        if not (seeded and several):
            raise PrivkitError(
                "a noise scale per row needs several (rows, width) tensors and a seeded torch "
                f"stream; found {type(clean).__name__} from {type(source).__name__}"
            )
        scale = torch.tensor(stds)[:, None]
    released = _with_noise(clean, scale, sensitivity, source, dim, len(rates), mutate, out)
    return released, receipts
