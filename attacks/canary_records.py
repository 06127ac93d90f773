"""Canary records through the user's own pipeline: drawn by the user's sampler, clipped by the
user's per-example clipping, released with the user's noise.

Gradient canaries injected by the auditor after the loop's clipping (:meth:`GradientCanaries.inject`)
test the noise only: the sampler and the clipping that ran are never exercised, so shuffled batches
accounted as Poisson, a weighted sampler or clipping left off pass unseen. Here each included canary
is a *record* of the data set the user's loader draws from:

1. :func:`records_loader` rebuilds the user's loader over the data set plus the included canaries
   (each canary's input is a copy of a random record, so the model runs on it as on any record),
   with a sampler of the same kind and parameters (opacus' Poisson sampler, ``RandomSampler``,
   ``SequentialSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``), and records which
   indices each batch holds, in the order the batches are consumed.
2. Per batch, :func:`replace_rows` takes the per-example gradients the user computed (torch.func,
   manual, or opacus' ``grad_sample``): a canary's row becomes its Dirac gradient (norm
   ``raw_norm``, larger than the clipping norm, on the canary's own coordinate), and every other
   row is zeroed on the *reserved* coordinates (the canaries' and a set of witness coordinates).
   Zeroing is a fixed, data-independent projection of each record's gradient before clipping: it
   can only lower a record's norm and changes nothing the claim bounds.
3. The user's code clips, sums, adds its noise and releases; the auditor observes the release on
   the reserved coordinates only, where, by step 2, it is exactly the clipped canaries plus the
   noise, whatever the user's clipping did to the other records. The user's own sampler decided
   which canaries joined; the user's own clipping clipped them.

The auditor also records what the sampler drew (per-record counts, batch sizes, records drawn twice
in one batch), which the sampling part of the conformance test checks against the claimed Poisson
law (:mod:`attacks.sampling_law`).

With opacus' ghost clipping no per-example gradient exists: the canary rows' norms are set to
``raw_norm`` before opacus computes its clipping coefficients, their own coefficient is kept
(opacus' clipping of the canary) and set to zero for the second backward (so the canary input's real
gradient never enters), and the clipped canary is added to the summed gradient before the noise; the
other records' clipped sum is subtracted from the release instead of zeroed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

if TYPE_CHECKING:  # pragma: no cover
    from attacks.whitebox import GradientCanaries

__all__ = ["CanaryRecords", "attach_records_to_opacus", "records_loader", "replace_rows"]


class CanaryRecords:
    """The auditor's record of canary records in one loader: which batch held which indices, and
    what the sampler drew over all consumed batches.

    Attributes
    ----------
    base_size : ``N``, the records of the user's data set; canary ``j`` (the ``j``-th included
        canary) has index ``N + j``.
    counts : (N + included,) how many consumed batches held each record.
    batch_sizes : one entry per consumed batch.
    repeats : how many times a record appeared twice in one batch.
    """

    def __init__(self, base_size: int, included_ids: np.ndarray, sources: np.ndarray):
        self.base_size = int(base_size)
        self.included_ids = np.asarray(included_ids, dtype=np.int64)
        self.sources = np.asarray(sources, dtype=np.int64)
        self.queue: deque[np.ndarray] = deque()
        self.counts = np.zeros(self.base_size + self.included_ids.size, dtype=np.int64)
        self.batch_sizes: list[int] = []
        self.repeats = 0

    @property
    def size(self) -> int:
        return int(self.counts.size)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """Consume the oldest recorded batch: (positions of canary rows, their canary ids)."""
        if not self.queue:
            raise RuntimeError(
                "no batch of the canary loader is pending: iterate the loader that "
                "GradientCanaries.records returned (not the original one), one batch per step"
            )
        idx = self.queue.popleft()
        np.add.at(self.counts, idx, 1)
        self.batch_sizes.append(int(idx.size))
        self.repeats += int(idx.size - np.unique(idx).size)
        pos = np.flatnonzero(idx >= self.base_size)
        return pos, self.included_ids[idx[pos] - self.base_size]


class _WithCanaries(Dataset):
    """The user's data set followed by one record per included canary (a copy of a random record:
    only its gradient, which the auditor sets, matters)."""

    def __init__(self, base: Any, state: CanaryRecords):
        self.base, self.state = base, state

    def __len__(self) -> int:
        return self.state.size

    def __getitem__(self, i: int):
        i = int(i)
        if i < self.state.base_size:
            return self.base[i]
        return self.base[int(self.state.sources[i - self.state.base_size])]


class _Recording:
    """A batch sampler that records each batch's indices for :meth:`CanaryRecords.next_batch`.
    DataLoader iterates it in the main process and preserves its order (``in_order``), so the
    batches are consumed in the order they are recorded; a new pass drops batches prefetched and
    never consumed by the last one."""

    def __init__(self, inner: Any, state: CanaryRecords):
        self.inner, self.state = inner, state

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        self.state.queue.clear()
        for batch in self.inner:
            self.state.queue.append(np.asarray(list(batch), dtype=np.int64))
            yield batch


def _sampler_over(sampler: Any, data: _WithCanaries, n: int, extra: int) -> Any:
    """A sampler of the same kind and parameters as ``sampler``, over ``data`` (``n`` records plus
    ``extra`` canaries)."""
    from torch.utils.data import (
        RandomSampler,
        SequentialSampler,
        SubsetRandomSampler,
        WeightedRandomSampler,
    )

    kind = type(sampler)
    if kind is RandomSampler:
        num = sampler._num_samples
        num = None if num is None else num + round(num * extra / n)
        return RandomSampler(
            data, replacement=sampler.replacement, num_samples=num, generator=sampler.generator
        )
    if kind is SequentialSampler:
        return SequentialSampler(data)
    if kind is SubsetRandomSampler:
        indices = list(sampler.indices) + list(range(n, n + extra))
        return SubsetRandomSampler(indices, generator=sampler.generator)
    if kind is WeightedRandomSampler:
        w = torch.as_tensor(sampler.weights, dtype=torch.double)
        # a canary is a typical record: the mean weight
        weights = torch.cat([w, torch.full((extra,), float(w.mean()), dtype=torch.double)])
        num = sampler.num_samples + round(sampler.num_samples * extra / n)
        return WeightedRandomSampler(
            weights.tolist(), num, sampler.replacement, generator=sampler.generator
        )
    raise ValueError(
        "data_loader's sampler must be opacus' Poisson sampler or a torch RandomSampler, "
        "SequentialSampler, SubsetRandomSampler or WeightedRandomSampler for canary records; "
        f"found {kind.__name__}"
    )


def _batch_sampler_over(loader: DataLoader, data: _WithCanaries, n: int, extra: int) -> Any:
    bs: Any = loader.batch_sampler
    name = type(bs).__name__
    if name == "UniformWithReplacementSampler":  # opacus' Poisson sampling
        return type(bs)(num_samples=n + extra, sample_rate=bs.sample_rate, generator=bs.generator)
    if type(bs) is BatchSampler:
        inner = _sampler_over(bs.sampler, data, n, extra)
        return BatchSampler(inner, bs.batch_size, bs.drop_last)
    raise ValueError(
        "data_loader's batch sampler must be opacus' UniformWithReplacementSampler or a torch "
        f"BatchSampler for canary records; found {name}"
    )


def records_loader(loader: DataLoader, canaries: GradientCanaries) -> DataLoader:
    """``loader`` rebuilt over its data set plus ``canaries``' included records (see the module
    docstring); the returned loader is the one to iterate. Sets ``canaries.records_state``."""
    if not isinstance(loader, DataLoader):
        raise ValueError(f"data_loader must be a torch DataLoader; found {type(loader).__name__}")
    if canaries.kind != "dirac":
        raise ValueError(
            f"canary records need kind='dirac' canaries (one reserved coordinate each); found "
            f"{canaries.kind!r}"
        )
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]  # map-style: TypeError otherwise
    except TypeError:
        raise ValueError(
            "data_loader must iterate a map-style data set (with len); found an iterable one"
        ) from None
    if n < 1:
        raise ValueError(f"data_loader's data set must hold records; found {n}")
    ids = canaries.included_ids
    state = canaries.records_state
    if state is None or state.base_size != n:  # a loader rebuilt per round keeps its record
        if canaries.steps:
            raise RuntimeError(
                "canary records must join the loader before the first observed release "
                f"(or a rebuilt loader over the same {state.base_size if state else '?'} records); "
                f"found {n} records after {canaries.steps} releases"
            )
        state = CanaryRecords(n, ids, canaries.record_sources(n))
    data = _WithCanaries(loader.dataset, state)
    batches = _Recording(_batch_sampler_over(loader, data, n, ids.size), state)
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
    }
    if loader.num_workers > 0:
        kwargs.update(
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            multiprocessing_context=loader.multiprocessing_context,
        )
    canaries.records_state = state
    return DataLoader(data, batch_sampler=batches, **kwargs)


def _tensors(per_example: Any) -> list[torch.Tensor]:
    if isinstance(per_example, torch.Tensor):
        return [per_example]
    if isinstance(per_example, dict):
        return list(per_example.values())
    if isinstance(per_example, (list, tuple)):
        return list(per_example)
    raise ValueError(
        "per-example gradients must be a tensor, a list/tuple or a dict of tensors with the "
        f"batch first; found {type(per_example).__name__}"
    )


def replace_rows(per_example: Any, canaries: GradientCanaries) -> Any:
    """Set this batch's canary rows to their Dirac gradients and zero every other row on the
    reserved coordinates (in place; returns ``per_example``). ``per_example``: a tensor, a
    list/tuple or a dict of tensors, each ``(B, *parameter shape)``, in the parameters' order."""
    state: CanaryRecords | None = canaries.records_state
    if state is None:
        raise RuntimeError("call GradientCanaries.records(loader) before replacing rows")
    tensors = _tensors(per_example)
    sizes = [int(t[0].numel()) if t.shape[0] else int(np.prod(t.shape[1:])) for t in tensors]
    if sum(sizes) != canaries.dim:
        raise ValueError(
            f"per-example gradients must have dim = {canaries.dim} entries per example; found "
            f"{sum(sizes)}"
        )
    rows = {int(t.shape[0]) for t in tensors}
    if len(rows) != 1:
        raise ValueError(f"every per-example tensor must have the same batch size; found {rows}")
    pos, ids = state.next_batch()
    if state.batch_sizes[-1] != rows.pop():
        raise ValueError(
            f"the per-example gradients have {tensors[0].shape[0]} rows but the batch the loader "
            f"gave has {state.batch_sizes[-1]}: pass the gradients of the loader's batch, in order"
        )
    reserved = canaries.reserved_coordinates
    start = 0
    for t, size in zip(tensors, sizes):
        flat = (
            t.detach().view(t.shape[0], -1)
            if t.is_contiguous()
            else t.detach().reshape(t.shape[0], -1)
        )
        local = reserved[(reserved >= start) & (reserved < start + size)] - start
        if local.size:
            flat[:, torch.as_tensor(local)] = 0
        if pos.size:
            flat[torch.as_tensor(pos)] = 0
            coords = canaries.coordinates_of(ids)
            hit = (coords >= start) & (coords < start + size)
            if hit.any():
                flat[torch.as_tensor(pos[hit]), torch.as_tensor(coords[hit] - start)] = (
                    canaries.raw_norm
                )
        if not t.is_contiguous():
            t.detach().copy_(flat.view_as(t))
        start += size
    canaries.count_appearances(ids)
    return per_example


def _opacus_hooks(optimizer: Any, canaries: GradientCanaries, params: list) -> None:
    original = optimizer.clip_and_accumulate

    def clip_and_accumulate() -> None:
        chunks = [
            p.grad_sample if isinstance(p.grad_sample, list) else [p.grad_sample] for p in params
        ]
        for j in range(len(chunks[0])):
            replace_rows([c[j] for c in chunks], canaries)
        original()

    optimizer.clip_and_accumulate = clip_and_accumulate


def _opacus_ghost(optimizer: Any, canaries: GradientCanaries, module: Any, params: list) -> dict:
    state = canaries.records_state
    assert state is not None  # records_loader set it
    pending: dict = {"rows": None, "added": []}
    norm_sample, clipping_coef = module.get_norm_sample, module.get_clipping_coef

    def get_norm_sample() -> torch.Tensor:
        norms = norm_sample().clone()
        pos, ids = state.next_batch()
        canaries.count_appearances(ids)
        norms[torch.as_tensor(pos, dtype=torch.long)] = canaries.raw_norm
        pending["rows"] = (pos, ids)
        module.per_sample_gradient_norms = norms
        return norms

    def get_clipping_coef() -> torch.Tensor:
        coef = clipping_coef().clone()  # calls get_norm_sample above: opacus clips the canaries
        pos, ids = pending["rows"]
        index = torch.as_tensor(pos, dtype=torch.long)
        pending["added"].append((ids, (coef[index] * canaries.raw_norm).detach().cpu().numpy()))
        coef[index] = 0  # the canary inputs' real gradients never enter the sum
        return coef

    module.get_norm_sample, module.get_clipping_coef = get_norm_sample, get_clipping_coef
    add_noise = optimizer.add_noise

    def add_noise_with_canaries() -> None:
        from attacks.sparse_add import add_in_place

        weights = np.zeros(canaries.n)
        for ids, w in pending["added"]:
            np.add.at(weights, ids, w)
        pending["added"] = []
        hit = np.flatnonzero(weights)  # the sampled canaries' coordinates only
        summed = [p.summed_grad for p in params]
        restore = add_in_place(
            summed, torch.as_tensor(canaries.coordinates_of(hit)), torch.as_tensor(weights[hit])
        )
        add_noise()
        restore()  # summed_grad is the clean sum again, observed against after the scaling
        pending["clean"] = [s.detach() for s in summed]

    optimizer.add_noise = add_noise_with_canaries
    return pending


def attach_records_to_opacus(
    optimizer: Any, canaries: GradientCanaries, data_loader: DataLoader, module: Any = None
) -> DataLoader:
    """Canary records in what ``data_loader`` samples and through opacus' per-sample clipping of
    ``optimizer`` (hooks or, with ``module``, ghost clipping); each step's release is observed after
    opacus' noise and normalisation. Returns the loader to iterate."""
    from opacus.optimizers import DPOptimizerFastGradientClipping

    params = list(optimizer.params)
    loader = records_loader(data_loader, canaries)
    ghost = isinstance(optimizer, DPOptimizerFastGradientClipping)
    pending: dict = {}
    if ghost:
        if module is None or not hasattr(module, "get_clipping_coef"):
            raise ValueError(
                "module must be the GradSampleModuleFastGradientClipping make_private returned "
                f"for ghost clipping; found {type(module).__name__}"
            )
        pending = _opacus_ghost(optimizer, canaries, module, params)
    else:
        _opacus_hooks(optimizer, canaries, params)
    scale_grad = optimizer.scale_grad

    def scale_and_observe() -> None:
        mean = optimizer.loss_reduction == "mean"
        factor = optimizer.expected_batch_size * optimizer.accumulated_iterations if mean else 1
        scale_grad()
        canaries.observe(
            [p.grad for p in params], clean=pending.pop("clean", None), scale=float(factor)
        )

    optimizer.scale_grad = scale_and_observe
    return loader


def watch_optimizer(
    optimizer: torch.optim.Optimizer,
    canaries: GradientCanaries,
    params: Sequence[torch.Tensor] | None = None,
    scale: float = 1.0,
) -> Any:
    """Observe every step's release from ``optimizer``'s gradients just before it steps:
    ``p.grad * scale`` for ``params`` (default: the optimizer's, in order). Returns the hook's
    handle."""
    ps = (
        list(params)
        if params is not None
        else [p for g in optimizer.param_groups for p in g["params"]]
    )

    def hook(opt, args, kwargs) -> None:
        grads = [p.grad for p in ps]
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing:
            raise RuntimeError(f"parameter {missing[0]} has no gradient at the optimizer step")
        canaries.observe([g for g in grads if g is not None], scale=scale)

    return optimizer.register_step_pre_hook(hook)
