"""An audit's reference clients train their first layer in the span of their records.

A privkit MLP's first layer reads the raw inputs. Under plain SGD (no momentum, no weight decay)
its weights ``W`` (``out x in``) enter a client's round only through ``W x`` for the client's
records ``x``, and every example's gradient ``d x^T`` lies in their span. Split the inputs' space
by an orthonormal basis ``Q`` (``in x r``) of that span. The weights across the span, ``W (I -
QQ^T)``, never meet a record: in a round of T steps they move by ``-lr / B * (z_1 + ... + z_T)
(I - QQ^T)``, with ``z_t`` the step's normals of standard deviation ``sigma * C``, and that sum
has the law of one such normal of T times the variance, projected. The weights in the span, ``W
Q``, train on the records' coordinates ``Q^T x`` exactly as ``W`` trains on ``x``: the same
forward pass, the same per-example gradient norms (``|d| |Q^T x| = |d| |x|``), and each step's
noise ``z_t Q`` has the law of ``r`` independent normals a row, because ``Q``'s columns are
orthonormal. So a reference client (an audit's own model, seeded noise, never released:
docs/auditing-methods.md) trains ``W Q`` over its records' coordinates and takes the summed noise
across the span once, at the end of its round (:class:`Narrowed`): the model it hands back has
the law it would have had with every step's full draw.

Centralised DP-SGD's runs (:class:`UnusedInputs`) hold thousands of records, whose span is every
input they use; an audit's reference runs there train in one stack with the target run, over the
inputs some record of any run uses (the quickstart's MNIST records leave 129 of the 784 pixels at
0), and the target run releases its whole gradient at every step.

Two cases of that split. The inputs that are 0 in every record lie across the span, so a client
trains over the inputs its records use at least (the demo's MNIST clients leave 29-37% of the 784
pixels at 0 in every record). Where a client has fewer records than it uses inputs, it trains in
their span too (``r`` is at most the number of records: the demo's clients hold about 160
records over about 530 inputs), when the round is long enough to pay for it: the rotation costs
three products with ``Q`` and one more draw over every input a round, about two steps' work, and
saves each step's work over the ``kept - r`` inputs it leaves out.

The steps' releases and receipts are unchanged but for their width: each step still releases
the client's whole clipped gradient over the coordinates it trains, with noise of the claimed
scale (an audit's mutation included), and the receipts, which record the noise multiplier, the
sensitivity and the sampling rate, are the ones of the full release. The audited target run and
any client with canaries take every step's full release (:func:`narrowable` leaves them out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from privkit.batched.buffers import kept
from privkit.batched.exact_mlp import _inputs_in_use, mlp_layers
from privkit.batched.many import LocalDp
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.stacked import StackedModels, UnsupportedModelError


def narrowable(job: LocalDp) -> bool:
    """Whether a job may train over its used inputs: a reference model (seeded noise) without
    canaries (a probed client's canaries read its whole release)."""
    return job.fast and job.noise_gen.seeded_torch and job.canaries is None


def first_layers(template: nn.Module, optimizer: str) -> list[str]:
    """The weights (parameter names) of the layers that read the raw inputs, when ``template`` is
    a privkit MLP or a FedKD+DP pair of MLPs trained with plain SGD (the only case where the
    weights across the records' span move by the noise alone); else none."""
    from privkit.trainers.fedkd import MentorMentee

    if optimizer != "sgd":
        return []
    towers = (
        [("mentor.", template.mentor), ("mentee.", template.mentee)]
        if isinstance(template, MentorMentee)
        else [("", template)]
    )
    try:
        return [f"{prefix}{mlp_layers(tower)[0]}.weight" for prefix, tower in towers]
    except UnsupportedModelError:
        return []


@dataclass
class RecordSpan:
    """A client's records over the inputs they use, and (computed when first asked for) an
    orthonormal basis of their span there with the records' coordinates in it."""

    x: torch.Tensor  #: the records as the job holds them (a cache entry is for these only)
    used: torch.Tensor  #: the inputs some record uses, ascending
    order: torch.Tensor  #: every input: the used ones, then the others, each ascending
    _qr: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _coords: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, x: torch.Tensor) -> RecordSpan:
        flat = x.flatten(1)
        need = _inputs_in_use(flat)
        order = torch.argsort((~need).to(torch.uint8), stable=True)
        return cls(x, order[: int(need.sum())], order)

    @property
    def rank(self) -> int:
        """The basis' width: at most the number of records and of used inputs."""
        return min(len(self.x), len(self.used))

    def basis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q, coords)``: ``Q`` (``inputs x rank``) with orthonormal columns whose span holds
        every record, 0 at the inputs no record uses, and the records' coordinates (``n x
        rank``), ``x = coords Q^T``. Householder QR over the used inputs: ``Q``'s columns are
        orthonormal even where records repeat. Kept over every input (a copy into a round's
        stacked bases is then one block; a scatter of rows costs several times more)."""
        if self._qr is None:
            flat = self.x.flatten(1)
            q, r = torch.linalg.qr(flat.index_select(1, self.used).T)  # x^T = Q R: coords R^T
            every = q.new_zeros(flat.shape[1], q.shape[1]).index_copy_(0, self.used, q)
            self._qr = (every, r.T)
        return self._qr

    def coords(self, rank: int) -> torch.Tensor:
        """The records' coordinates in :meth:`basis`, zero-padded to ``rank`` columns (like a
        round's stacked bases, :meth:`SpanCache.bases`), ``(n, rank)``; kept per ``rank``, since
        a client's rounds pad them alike (a fresh pad a round cost 0.3 ms a client)."""
        if rank not in self._coords:
            _, coords = self.basis()
            pad = rank - coords.shape[1]
            self._coords[rank] = coords if pad == 0 else torch.nn.functional.pad(coords, (0, pad))
        return self._coords[rank]


class SpanCache:
    """The :class:`RecordSpan` of each client a training's rounds have met, kept across its rounds
    (a client's records are one tensor for its whole run, so each span is computed once), and one
    buffer the round's stacked bases are written in (a fresh one of tens of megabytes a round
    costs its page faults, several times its writing)."""

    def __init__(self) -> None:
        self._spans: dict[int, RecordSpan] = {}
        self._scratch: dict = {}

    def spans(self, jobs: Sequence[LocalDp]) -> list[RecordSpan]:
        """Each job's span, computed where this cache does not hold the job's very records."""
        out = []
        for job in jobs:
            span = self._spans.get(id(job.x))
            if span is None or span.x is not job.x:
                span = self._spans[id(job.x)] = RecordSpan.of(job.x)
            out.append(span)
        return out

    def bases(self, spans: Sequence[RecordSpan], rank: int, like: torch.Tensor) -> torch.Tensor:
        """The spans' bases over every input, ``(models, inputs, rank)``: each model's rows at
        the inputs it uses, 0 elsewhere (inputs its records leave at 0) and in the columns past
        its own rank (coordinates no weight is mapped back from). Valid until the next call."""
        out = kept(self._scratch, "bases", (len(spans), len(spans[0].order), rank), like)
        for i, span in enumerate(spans):
            q, _ = span.basis()
            out[i, :, : q.shape[1]].copy_(q)
            out[i, :, q.shape[1] :].zero_()
        return out


def _rotates(steps: int, inputs: int, kept: int, rank: int) -> bool:
    """Whether training in the records' span pays: it costs about two steps' work over every
    input a round (three products with the bases, one more draw) and saves each of the
    ``steps`` steps' work over the ``kept - rank`` used inputs it leaves out."""
    return steps * (kept - rank) > 2 * inputs


@dataclass
class Narrowed:
    """The jobs' first-layer weights in a narrower space, and the jobs' records in the same
    coordinates: with a ``basis``, each job's records' span; without one, the inputs its records
    use (padded to the longest). :meth:`widen` puts the trained weights back in place and gives
    the others their noise."""

    weights: list[str]  #: the names of the weights that read the inputs
    params: dict[str, torch.Tensor]  #: the stacked parameters, those weights narrowed
    jobs: list[LocalDp]  #: the jobs, their records narrowed (the same receipts lists)
    #: (models, inputs, rank): per model an orthonormal basis of its records' span (zero-padded,
    #: :meth:`SpanCache.bases`); None where the weights train over the kept inputs themselves
    basis: torch.Tensor | None = None
    #: without a basis, (models, inputs): per model its kept inputs first, then the others
    order: torch.Tensor | None = None
    kept: int = 0  #: without a basis, the inputs kept per model

    @classmethod
    def of(
        cls,
        weights: list[str],
        params: dict[str, torch.Tensor],
        jobs: Sequence[LocalDp],
        *,
        steps: int = 1,
        spans: SpanCache | None = None,
    ) -> Narrowed | None:
        """The narrowing of ``jobs`` (every one :func:`narrowable`) whose stacked parameters are
        ``params``, for a round of ``steps`` steps (``spans``: a cache kept across a training's
        rounds); None where there is no trained weight to narrow or it would train over every
        input."""
        if not weights or any(name not in params for name in weights):  # none, or frozen
            return None
        cache = SpanCache() if spans is None else spans
        spans_ = cache.spans(jobs)
        inputs = len(spans_[0].order)
        kept = max(len(s.used) for s in spans_)
        rank = max(s.rank for s in spans_)
        narrow = dict(params)
        if _rotates(steps, inputs, kept, rank):
            basis = cache.bases(spans_, rank, params[weights[0]])
            for name in weights:
                narrow[name] = torch.bmm(params[name], basis)
            xs = [s.coords(rank) for s in spans_]
            return cls(list(weights), narrow, _with_records(jobs, xs), basis=basis)
        if kept == inputs:
            return None
        order = torch.stack([s.order for s in spans_]).to(params[weights[0]].device)
        cols = order[:, :kept]
        for name in weights:
            w = params[name]  # (models, out, in)
            narrow[name] = torch.gather(w, 2, cols[:, None, :].expand(-1, w.shape[1], -1))
        xs = [_over(j.x, c) for j, c in zip(jobs, cols)]
        return cls(list(weights), narrow, _with_records(jobs, xs), order=order, kept=kept)

    def widen(
        self, full: dict[str, torch.Tensor], steps: int, lr: float
    ) -> dict[str, torch.Tensor]:
        """``full`` (the stacked parameters before the round) with the trained narrowed
        parameters in place, and each model's weights outside what it trained moved by the sum
        of ``steps`` steps' noise there, divided by the expected batch size and times ``lr``."""
        out = {k: v for k, v in self.params.items() if k not in self.weights}
        for name in self.weights:
            w = full[name]
            if self.basis is not None:
                out[name] = self._in_span(w, self.params[name], steps, lr)
                continue
            assert self.order is not None
            at = self.order[:, None, :].expand(-1, w.shape[1], -1)
            moved = self._moved(w.shape[1], w.shape[2] - self.kept, steps, lr, w)
            w = w.scatter(2, at[..., : self.kept], self.params[name])
            out[name] = w.scatter_add_(2, at[..., self.kept :], moved)
        return out

    def _in_span(
        self, full: torch.Tensor, trained: torch.Tensor, steps: int, lr: float
    ) -> torch.Tensor:
        """One weight after the round (``full``: before it; ``trained``: its part in each model's
        records' span after it): every input's weights moved by the summed noise, then their
        part in the span replaced by the trained one, ``start + (trained - start Q) Q^T``."""
        assert self.basis is not None
        start = self._moved(full.shape[1], full.shape[2], steps, lr, full).add_(full)
        diff = torch.baddbmm(trained, start, self.basis, alpha=-1.0)
        return start.baddbmm_(diff, self.basis.transpose(1, 2))

    def _moved(
        self, outs: int, width: int, steps: int, lr: float, like: torch.Tensor
    ) -> torch.Tensor:
        """Per model ``(outs, width)`` weights' displacement by a round's summed noise: SGD
        subtracts ``lr / B`` times each step's noise (``B`` the expected batch size)."""
        noise = self._summed_noise(outs, width, steps, like)
        scale = torch.tensor(
            [-lr / j.step.expected_batch_size for j in self.jobs], device=noise.device
        )
        return noise.mul_(scale.to(noise.dtype).view(-1, 1, 1))

    def _summed_noise(self, outs: int, width: int, steps: int, like: torch.Tensor) -> torch.Tensor:
        """Per model ``(outs, width)`` normals, the sum of ``steps`` steps' noise at its step's
        scale (:func:`summed_noise`), in one draw from the first job's noise stream."""
        stds = [j.step.noise_multiplier * j.step.clip_norm for j in self.jobs]
        noise = summed_noise(self.jobs[0].noise_gen, (outs, width), stds, steps, like.dtype)
        return noise.to(like.device)


def summed_noise(
    source: DpRandom, shape: tuple[int, ...], stds: Sequence[float], steps: int, dtype
) -> torch.Tensor:
    """Per model ``shape`` normals, the sum of ``steps`` steps' noise of standard deviation
    ``stds[model]`` (``sqrt(steps)`` times it), an audit's mutation applied as the release
    primitive applies it, in one ``(len(stds), *shape)`` draw from ``source``. Not a release of
    its own: these are the untrained coordinates' share of the steps' releases, whose receipts
    the steps hold."""
    factor = mutations.active().noise_factor  # the primitive's (1.0 outside audits)
    scale = torch.tensor([math.sqrt(steps) * s * factor for s in stds], dtype=dtype)
    noise = source.randn((len(stds), *shape), dtype=dtype)
    return noise.mul_(scale.to(noise.device).view(-1, *([1] * len(shape))))


# The share of unused inputs below which the stack is left whole. A run that releases its whole
# gradient pays two copies of its first layer's gradient a step (110 us for MNIST's 784 x 64
# weights, against 16 us for its plain update); a narrower step saves the unused share of each
# run's step (about 0.5 ms a run: the quickstart audit's 17 runs take 9 ms a step). At 10% that
# pays off from about three runs per releasing run, which an audit's 16 reference runs exceed.
MIN_UNUSED_SHARE = 0.1


class UnusedInputs:
    """Centralised DP-SGD's stacked runs (:mod:`privkit.batched.many_dpsgd`) over the inputs some
    record of any run uses: the first layer's weight ``weight`` narrowed to the used inputs
    ``used`` in the stacked parameters, its other columns (``unused``) held in :attr:`aside`
    ``(models, out, len(unused))``.

    The audit's target run trains in the same stack as its reference runs. It releases its whole
    gradient at every step (:meth:`whole`: the unused columns' sums 0) and its unused columns
    take their part of that release (:meth:`step`), so its releases are unchanged. A seeded
    reference run draws the used coordinates' noise at every step and its unused columns' noise
    of all its steps after its last one (:meth:`lumped_noise`). The columns are left unused by
    the runs' test records too, so no evaluation reads them in between.
    """

    def __init__(self, weight: str, used: torch.Tensor, unused: torch.Tensor, width: int):
        self.weight, self.used, self.unused, self.width = weight, used, unused, width
        self.aside = torch.empty(0)

    @classmethod
    def find(
        cls,
        net: StackedModels,
        names: Sequence[str],
        records: Sequence[torch.Tensor],
        tests: Sequence[torch.Tensor],
    ) -> UnusedInputs | None:
        """The inputs 0 in every one of ``records`` and ``tests`` (each ``(n, ...)``), where the
        first layer is linear on the input and trained, and at least :data:`MIN_UNUSED_SHARE` of
        its inputs are unused; else None."""
        if not net.linear_on_input or not records:
            return None
        weight = f"{net.parametrised[0]}.weight"
        if weight not in names:
            return None
        width = math.prod(records[0].shape[1:])
        in_use = torch.zeros(width, dtype=torch.bool, device=records[0].device)
        for x in (*records, *tests):
            in_use |= _inputs_in_use(x.reshape(len(x), width))
        unused = (~in_use).nonzero().flatten()
        if len(unused) < MIN_UNUSED_SHARE * width:
            return None
        return cls(weight, in_use.nonzero().flatten(), unused, width)

    def narrow(self, params: dict[str, torch.Tensor]) -> None:
        """``params``' first-layer weight ``(models, out, width)`` narrowed to the used inputs
        (in place in the dict), its unused columns kept in :attr:`aside`."""
        w = params[self.weight]
        self.aside = w.index_select(2, self.unused)
        params[self.weight] = w.index_select(2, self.used)

    def records(self, x: torch.Tensor) -> torch.Tensor:
        """Records ``(n, ...)`` flattened, their used inputs only."""
        return x.reshape(len(x), -1).index_select(1, self.used)

    def whole(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One model's sums with the first layer's over every input, 0 at the unused ones (what
        its release releases)."""
        narrow = sums[self.weight]
        full = narrow.new_zeros(narrow.shape[0], self.width)
        full.index_copy_(1, self.used, narrow)
        return {**sums, self.weight: full}

    def step(
        self,
        params: dict[str, torch.Tensor],
        j: int,
        noisy: dict[str, torch.Tensor],
        expected: torch.Tensor,
        lr: float,
    ) -> None:
        """Model ``j``'s SGD step from a release of its whole gradient (:meth:`whole`), as the
        batched runs step (``params += -lr * (noisy / expected)``): the used columns in
        ``params``, the others aside."""
        for k, v in noisy.items():
            if k == self.weight:
                params[k][j].add_(v.index_select(1, self.used) / expected, alpha=-lr)
                self.aside[j].add_(v.index_select(1, self.unused) / expected, alpha=-lr)
            else:
                params[k][j].add_(v / expected, alpha=-lr)

    def lumped_noise(
        self,
        rows: Sequence[int],
        steps: int,
        *,
        std: float,
        source: DpRandom,
        expected: torch.Tensor,
        lr: float,
    ) -> None:
        """The unused columns' noise of ``steps`` steps for the seeded reference models ``rows``
        (one noise scale ``std``, drawn from their group's ``source``): one draw of ``sqrt(steps)``
        times a step's, each row's step ``-lr * (noise / expected[row])`` as each step's. An
        audit's mutation of the noise scales it as it scales every step's (in the release
        primitive). It is no release of its own: the steps' receipts stand for these
        coordinates too."""
        noise = summed_noise(
            source, self.aside.shape[1:], [std] * len(rows), steps, self.aside.dtype
        )
        for row, j in enumerate(rows):
            self.aside[j] -= lr * (noise[row] / expected[row])

    def weights(self, params: dict[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
        """Model ``j``'s parameters, its first layer over every input."""
        out = {k: v[j] for k, v in params.items()}
        out[self.weight] = self._joined(params[self.weight][j : j + 1], self.aside[j : j + 1])[0]
        return out

    def restore(self, params: dict[str, torch.Tensor]) -> None:
        """``params``' first layer over every input again (in place in the dict)."""
        params[self.weight] = self._joined(params[self.weight], self.aside)

    def _joined(self, used: torch.Tensor, aside: torch.Tensor) -> torch.Tensor:
        full = used.new_empty(*used.shape[:2], self.width)
        full.index_copy_(2, self.used, used)
        full.index_copy_(2, self.unused, aside)
        return full


def _over(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Records ``x`` at the inputs ``cols``, ``(n, len(cols))``."""
    return x.flatten(1).index_select(1, cols.to(x.device))


def _with_records(jobs: Sequence[LocalDp], xs: Sequence[torch.Tensor]) -> list[LocalDp]:
    """The jobs with their records ``xs`` (the same receipts lists: a narrowed job's receipts are
    its job's)."""
    return [replace(j, x=x, receipts=j.receipts) for j, x in zip(jobs, xs)]


def train_over_used_inputs(
    weights: list[str],
    params: dict[str, torch.Tensor],
    jobs: list[LocalDp],
    train: Callable[[dict[str, torch.Tensor], list[LocalDp]], None],
    *,
    steps: int,
    lr: float,
    spans: SpanCache | None = None,
) -> dict[str, torch.Tensor]:
    """``train(params, jobs)`` (a round's ``steps`` local SGD steps at ``lr``, in place on the
    stacked parameters) over the jobs' used inputs or their records' span where ``weights``
    narrow (:class:`Narrowed`; ``spans``: a :class:`SpanCache` kept across the rounds), else
    as given; the stacked parameters after the round."""
    narrowed = Narrowed.of(weights, params, jobs, steps=steps, spans=spans)
    if narrowed is None:
        train(params, jobs)
        return params
    train(narrowed.params, narrowed.jobs)
    return narrowed.widen(params, steps, lr)


__all__ = [
    "MIN_UNUSED_SHARE",
    "Narrowed",
    "RecordSpan",
    "SpanCache",
    "UnusedInputs",
    "first_layers",
    "narrowable",
    "summed_noise",
    "train_over_used_inputs",
]
