"""Training M small torch models at once with (DP-)SGD: privkit's batched training recipe.

The recipe "train one small model with (DP-)SGD" (the centralised and DP-SGD methods, reference
models for a user's own model, audit shadows) runs for M models in lock-step: parameters stacked
on a model axis (:class:`privkit.mechanisms.stacked.StackedModels`), one forward and one backward
pass per step for all M, per-example clipping from each layer's inputs and output gradients (no
per-example weight gradients of linear layers are formed), noise for all M added at once. No
Python loop over models runs inside a step.

Algorithm per model (:func:`train_one` is the plain reference loop; :func:`train_many` gives the
same weights up to float rounding, tested):

* batches: ``sampling="shuffle"``: per epoch a permutation of the model's records from its batch
  generator, cut into batches of ``batch_size`` (last partial batch dropped unless
  ``drop_last=False``); ``sampling="poisson"``: each record joins each batch independently with
  probability ``q = 1 / ceil(n / batch_size)``, for ``epochs * ceil(n / batch_size)`` steps (what
  opacus' ``DPDataLoader`` and :class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep` do, and what the
  subsampled-Gaussian accountant assumes).
* gradient: mean cross-entropy; with ``clip`` set (DP-SGD): per-example gradients clipped to L2
  norm ``clip``, summed, Gaussian noise of std ``noise_multiplier * clip`` added, divided by the
  batch size (shuffle) or the expected batch size ``q n`` (Poisson; also without DP).
* update: SGD or Adam (torch's defaults) with step ``lr``.

Randomness per model from its seed: initialisation (``seed``), batches (``derive_seed(seed,
"batches")``) and noise (``derive_seed(seed, "noise")``); with ``reproducible=False`` (release mode,
:func:`privkit.seeding.noise_generator`) batches and noise come from a secret AES-CTR stream instead. Poisson masks and noise are drawn in
blocks of :data:`BLOCK` steps (``mask(K, n)``, ``randn(K, parameters)`` from the model's stream,
``K = min(BLOCK, steps left)``), so that the M models' draws happen once per block rather than once
per step, and the loop draws exactly the same numbers. Every release goes through privkit's
release primitive (:func:`privkit.mechanisms.gaussian_release`: :class:`~privkit.mechanisms.
gaussian.NormalRows` in the loop, :class:`~privkit.mechanisms.gaussian.ModelRows` for the stacked
models). In release mode the noisy sums lie on the data-independent grid of
:mod:`privkit.mechanisms.grid_noise` (the block holds the grid's integer draws).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.gaussian import ModelRows, gaussian_release
from privkit.mechanisms.stacked import StackedModels
from privkit.models import build_from_spec
from privkit.seeding import noise_generator, seed_torch

__all__ = [
    "SGDRecipe",
    "batched_recipe",
    "load_states",
    "reference_models",
    "train_many",
    "train_one",
]

BLOCK = 16  # steps whose Poisson masks and noise are drawn at once (part of the stream definition)


@dataclass(frozen=True)
class SGDRecipe:
    """Hyper-parameters of the batched recipe (see the module docstring for the algorithm).

    Parameters
    ----------
    epochs : int
        Passes over each model's records (``>= 1``, default 5); with Poisson sampling the model
        takes ``epochs * ceil(n / batch_size)`` steps.
    batch_size : int
        Records per batch (``>= 1``, default 64); with Poisson sampling it sets the sampling rate
        ``q = 1 / ceil(n / batch_size)`` (expected batch size ``q n``).
    lr : float
        The optimiser's step size (``> 0``, default 0.1).
    clip : float or None
        Per-example L2 clip norm (``> 0``), which makes the recipe DP-SGD; ``None`` (default):
        no clipping and no noise, the gradient of the mean cross-entropy.
    noise_multiplier : float
        Noise std in units of ``clip`` (``>= 0``, default 0.0): Gaussian noise of std
        ``noise_multiplier * clip`` on each step's sum of clipped gradients; needs ``clip``.
    sampling : {"shuffle", "poisson"}
        ``"shuffle"`` (default): a permutation per epoch cut into batches; ``"poisson"``: each
        record joins each batch independently with probability ``q`` (what the accountant assumes).
    optimizer : {"sgd", "adam"}
        The update rule, with torch's defaults (default ``"sgd"``).
    drop_last : bool
        Shuffle sampling only: drop each epoch's last partial batch (default ``True``); Poisson
        sampling ignores it.
    """

    epochs: int = 5
    batch_size: int = 64
    lr: float = 0.1
    clip: float | None = None
    noise_multiplier: float = 0.0
    sampling: Literal["shuffle", "poisson"] = "shuffle"
    optimizer: Literal["sgd", "adam"] = "sgd"
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"epochs, batch_size must be >= 1 and lr > 0; found {self.epochs}, "
                f"{self.batch_size}, {self.lr}"
            )
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip must be > 0; found {self.clip}")
        if self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0; found {self.noise_multiplier}")
        if self.noise_multiplier > 0 and self.clip is None:
            raise ValueError(
                f"noise_multiplier needs clip (the noise std is noise_multiplier * clip); "
                f"found noise_multiplier={self.noise_multiplier}, clip=None"
            )
        if self.sampling not in ("shuffle", "poisson"):
            raise ValueError(f"sampling must be shuffle or poisson; found {self.sampling!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam; found {self.optimizer!r}")

    def batches_per_epoch(self, n: int) -> int:
        if self.sampling == "poisson" or not self.drop_last:
            return math.ceil(n / self.batch_size)
        return n // self.batch_size

    def steps(self, n: int) -> int:
        """Optimiser steps a model trained on ``n`` records takes."""
        return self.epochs * self.batches_per_epoch(n)

    def sample_rate(self, n: int) -> float:
        """Poisson sampling rate ``q`` for ``n`` records."""
        return 1.0 / max(1, self.batches_per_epoch(n))


def _init(spec: dict, seed: int) -> torch.nn.Module:
    seed_torch(seed)
    return build_from_spec(spec)


def _generators(seed: int, device: torch.device, reproducible: bool) -> tuple[DpRandom, DpRandom]:
    """(batch generator on the CPU, noise generator on ``device``) of one model: the sampling the
    accountant amplifies on and the noise, both secret in release mode."""
    return (
        noise_generator(seed, "batches", reproducible=reproducible),
        noise_generator(seed, "noise", reproducible=reproducible, device=device),
    )


# -- the reference loop ---------------------------------------------------------------------------


def _one_batches(n: int, recipe: SGDRecipe, gen: DpRandom):
    """One model's batches (local indices), step by step, as the stream definition says."""
    if recipe.sampling == "shuffle":
        per = recipe.batches_per_epoch(n)
        for _ in range(recipe.epochs):
            perm = gen.randperm(n)
            for s in range(per):
                yield perm[s * recipe.batch_size : (s + 1) * recipe.batch_size]
        return
    q, steps = recipe.sample_rate(n), recipe.steps(n)
    for start in range(0, steps, BLOCK):
        for row in gen.mask(min(BLOCK, steps - start), n, rate=q):
            yield torch.nonzero(row).flatten()


def train_one(
    spec: dict,
    x: np.ndarray,
    y: np.ndarray,
    index: np.ndarray,
    recipe: SGDRecipe,
    seed: int,
    *,
    reproducible: bool = True,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Reference loop: train one model on ``x[index]`` on ``device``; returns its parameters (on
    the CPU).

    Per-example gradients come from ``torch.func`` (:func:`~privkit.mechanisms.dp_sgd_step.
    per_sample_gradients`), formed one by one as opacus also forms them: an implementation
    independent of :func:`train_many`'s stacked layers.

    Parameters
    ----------
    spec : dict
        The model's architecture spec (:func:`privkit.models.build_from_spec`).
    x : numpy.ndarray
        All records' features, ``(N, ...)``, converted to float32.
    y : numpy.ndarray
        All records' integer class labels, ``(N,)``.
    index : numpy.ndarray
        The positions in ``x``/``y`` of the records the model trains on (``n`` of them).
    recipe : SGDRecipe
        The hyper-parameters (epochs, batching, clipping, noise, optimiser).
    seed : int
        The model's seed: its initialisation, and its batch (``"batches"``) and noise
        (``"noise"``) streams derived from it in reproducible mode.
    reproducible : bool
        ``True`` (default): batches and noise from seeded generators, equal to :func:`train_many`'s
        up to float rounding; ``False``: release mode, secret AES-CTR streams that ignore ``seed``
        (noisy sums on the grid of :mod:`privkit.mechanisms.grid_noise`).
    device : str or torch.device
        Where the model trains (default ``"cpu"``); the returned parameters are on the CPU.
    """
    from privkit.mechanisms.dp_sgd_step import clip_per_sample, per_sample_gradients
    from privkit.mechanisms.gaussian import NormalRows, gaussian_release

    dev = torch.device(device)
    model = _init(spec, seed).to(dev)
    names = [k for k, _ in model.named_parameters()]
    opt = (torch.optim.SGD if recipe.optimizer == "sgd" else torch.optim.Adam)(
        model.parameters(), lr=recipe.lr
    )
    xt = torch.as_tensor(x[index], dtype=torch.float32, device=dev)
    yt = torch.as_tensor(y[index], dtype=torch.long, device=dev)
    n = len(index)
    steps = recipe.steps(n)
    batch_gen, noise_gen = _generators(seed, dev, reproducible)
    n_params = sum(p.numel() for p in model.parameters())
    std = (recipe.noise_multiplier * recipe.clip) if recipe.clip is not None else 0.0
    rows = NormalRows(noise_gen, n_params, steps, BLOCK) if noise_gen.seeded_torch else None
    for b in _one_batches(n, recipe, batch_gen):
        b = b.to(dev)
        norm = recipe.sample_rate(n) * n if recipe.sampling == "poisson" else max(len(b), 1)
        if recipe.clip is None:
            loss = F.cross_entropy(model(xt[b]), yt[b], reduction="sum") / norm if len(b) else None
            grads = (
                torch.autograd.grad(loss, list(model.parameters()))
                if loss is not None
                else [torch.zeros_like(p) for p in model.parameters()]
            )
            g = dict(zip(names, grads))
        else:
            if len(b):
                per = per_sample_gradients(
                    model, xt[b], yt[b], lambda lo, ta, _a: F.cross_entropy(lo, ta)
                )
                g = {k: v.sum(0) for k, v in clip_per_sample(per, recipe.clip)[0].items()}
            else:  # an empty Poisson batch releases noise only
                g = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
            # seeded: a block of steps' noise drawn at once (NormalRows), one row per release;
            # release mode: the noisy sum on the grid (grid_noise). The receipt is not kept: the
            # models trained here (reference models, shadows) carry no ledger
            released, _ = gaussian_release(
                [g[k] for k in names],
                std=std,
                sensitivity=recipe.clip,
                source=rows if rows is not None else noise_gen,
                mutate=False,
            )
            g = {k: v / norm for k, v in zip(names, released)}
        for k, p in model.named_parameters():
            p.grad = g[k].detach()
        opt.step()
    return {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


# -- the batched path -----------------------------------------------------------------------------


class _Schedule:
    """The M models' batches for a block of steps, as padded index tensors (no per-step loops)."""

    def __init__(
        self,
        indices: list[np.ndarray],
        recipe: SGDRecipe,
        gens: list[DpRandom],
        device: torch.device,
    ):
        self.recipe, self.gens, self.device = recipe, gens, device
        self.sizes = [len(ix) for ix in indices]
        self.steps = torch.tensor([recipe.steps(n) for n in self.sizes])
        n_max = max(self.sizes)
        self.table = torch.zeros(len(indices), max(n_max, 1), dtype=torch.long)
        for j, ix in enumerate(indices):
            self.table[j, : len(ix)] = torch.as_tensor(np.asarray(ix), dtype=torch.long)
        self._epoch: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * len(indices)

    def _epoch_batches(self, j: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model j's batches in epoch e (positions into its index set, padded) and their weights;
        epochs are drawn in order, one permutation each, as the loop draws them."""
        cached = self._epoch[j]
        if cached is None or cached[0] != e:
            r, n = self.recipe, self.sizes[j]
            per = r.batches_per_epoch(n)
            perm = self.gens[j].randperm(n)[: per * r.batch_size]
            pos = torch.zeros(per * r.batch_size, dtype=torch.long)
            w = torch.zeros(per * r.batch_size)
            pos[: len(perm)], w[: len(perm)] = perm, 1.0
            cached = (e, pos.view(per, r.batch_size), w.view(per, r.batch_size))
            self._epoch[j] = cached
        return cached[1], cached[2]

    def _shuffle_block(self, start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, m = self.recipe, len(self.sizes)
        pos = torch.zeros(m, k, r.batch_size, dtype=torch.long)
        w = torch.zeros(m, k, r.batch_size)
        for j, n in enumerate(self.sizes):  # once per model and block: slices of its epochs
            per, end = r.batches_per_epoch(n), min(start + k, int(self.steps[j]))
            t = start
            while t < end:
                e, s = divmod(t, per)
                stop = min(end, (e + 1) * per)
                ep, ew = self._epoch_batches(j, e)
                pos[j, t - start : stop - start], w[j, t - start : stop - start] = (
                    ep[s : s + stop - t],
                    ew[s : s + stop - t],
                )
                t = stop
        return pos, w

    def block(self, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For steps ``start .. start + BLOCK``: global record indices ``(M, K, B)``, example
        weights ``(M, K, B)`` (0 pads), which models are still training ``(M, K)``, and each
        model's batch size ``(M, K)`` on the CPU (its examples come first, then the pads)."""
        k = min(BLOCK, int(self.steps.max()) - start)
        active = (torch.arange(start, start + k)[None, :] < self.steps[:, None]).float()
        if self.recipe.sampling == "shuffle":
            pos, w = self._shuffle_block(start, k)
        else:
            pos, w = self._poisson_block(start)
            pos, w = pos[:, :k], w[:, :k]
        w = w * active[..., None]
        glob = torch.gather(self.table, 1, pos.reshape(len(self.sizes), -1)).view(pos.shape)
        return glob.to(self.device), w.to(self.device), active.to(self.device), (w > 0).sum(-1)

    def rows(self, start: int) -> list[int]:
        """Per model, the steps of the block starting at ``start`` it still takes (its draw size)."""
        return [max(0, min(BLOCK, int(s) - start)) for s in self.steps]

    def _poisson_block(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        m, n_max = len(self.sizes), self.table.shape[1]
        masks = torch.zeros(m, BLOCK, n_max, dtype=torch.bool)
        for j, (n, rows) in enumerate(
            zip(self.sizes, self.rows(start))
        ):  # once per model and block
            if rows > 0:
                masks[j, :rows, :n] = self.gens[j].mask(rows, n, rate=self.recipe.sample_rate(n))
        counts = masks.sum(-1)
        width = max(1, int(counts.max()))
        # selected positions first, in increasing order (a stable sort of "not selected")
        pos = torch.sort((~masks).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
        w = (torch.arange(width)[None, None, :] < counts[..., None]).float()
        return pos, w


class _StackedOptimizer:
    """SGD or Adam (torch's update rules and defaults) on stacked parameters; a model whose
    ``active`` entry is 0 is left unchanged (its batches have run out)."""

    def __init__(self, params: dict[str, torch.Tensor], recipe: SGDRecipe):
        self.recipe = recipe
        if recipe.optimizer == "adam":
            self.m1 = {k: torch.zeros_like(v) for k, v in params.items()}
            self.m2 = {k: torch.zeros_like(v) for k, v in params.items()}
            first = next(iter(params.values()))
            # step counts and bias corrections in float64, as torch.optim.Adam computes them
            self.count = torch.zeros(first.shape[0], dtype=torch.float64, device=first.device)

    def step(
        self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], active: torch.Tensor
    ) -> None:
        lr = self.recipe.lr
        with torch.no_grad():
            if self.recipe.optimizer == "sgd":
                for k, p in params.items():
                    p.addcmul_(grads[k], _expand(active, p), value=-lr)
                return
            b1, b2, eps = 0.9, 0.999, 1e-8
            self.count += active
            step = self.count.clamp(min=1)
            size = (lr / (1 - b1**step)).float()  # (M,)
            bc2 = (1 - b2**step).sqrt().float()
            for k, p in params.items():
                a = _expand(active, p).bool()
                g = grads[k]
                self.m1[k] = torch.where(a, self.m1[k].lerp(g, 1 - b1), self.m1[k])
                self.m2[k] = torch.where(a, self.m2[k] * b2 + (1 - b2) * g * g, self.m2[k])
                denom = self.m2[k].sqrt() / _expand(bc2, p) + eps
                p.sub_(torch.where(a, _expand(size, p) * self.m1[k] / denom, torch.zeros_like(p)))


def _expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape((-1,) + (1,) * (like.dim() - 1))


def train_many(
    spec: dict,
    x: np.ndarray,
    y: np.ndarray,
    indices: list[np.ndarray],
    recipe: SGDRecipe,
    seeds: list[int],
    device: str | torch.device = "cpu",
    chunk_size: int | None = None,
    *,
    reproducible: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Train ``len(indices)`` models at once, model j on ``x[indices[j]]`` with seed ``seeds[j]``.

    Models with fewer steps than others sit idle (no update) once their stream ends, so each
    follows exactly the loop's schedule. ``chunk_size`` trains the models in groups of that size
    (same result; bounds memory). Returns each model's parameters (on the CPU).

    Parameters
    ----------
    spec : dict
        The models' common architecture spec (:func:`privkit.models.build_from_spec`).
    x : numpy.ndarray
        All records' features, ``(N, ...)``, shared by the models, converted to float32.
    y : numpy.ndarray
        All records' integer class labels, ``(N,)``.
    indices : list of numpy.ndarray
        Model j's record positions in ``x``/``y``, one non-empty index set per model (``M`` in
        all); their sizes may differ.
    recipe : SGDRecipe
        The hyper-parameters, the same for every model.
    seeds : list of int
        One seed per model (``len(indices)`` of them): its initialisation, and in reproducible
        mode its batch and noise streams, as :func:`train_one` uses ``seed``.
    device : str or torch.device
        Where the stacked models train (default ``"cpu"``); the returned parameters are on the CPU.
    chunk_size : int or None
        Train the models in groups of at most this many (``>= 1``): the same weights, less memory;
        ``None`` (default): all ``M`` at once.
    reproducible : bool
        ``True`` (default): each model's batches and noise from its seeded generators, equal to
        :func:`train_one`'s up to float rounding; ``False``: release mode, secret AES-CTR streams
        that ignore the seeds (the noisy sums on the grid of :mod:`privkit.mechanisms.grid_noise`).
    """
    if len(indices) != len(seeds) or not indices:
        raise ValueError(
            f"indices and seeds must be non-empty and equally long; found {len(indices)} and {len(seeds)}"
        )
    if any(len(ix) == 0 for ix in indices):
        raise ValueError("every model needs at least one record; found an empty index set")
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; found {chunk_size}")
        out: list[dict[str, torch.Tensor]] = []
        for s in range(0, len(seeds), chunk_size):
            out += train_many(
                spec,
                x,
                y,
                indices[s : s + chunk_size],
                recipe,
                seeds[s : s + chunk_size],
                device,
                reproducible=reproducible,
            )
        return out
    dev = torch.device(device)
    m = len(seeds)
    models = [_init(spec, s) for s in seeds]
    names = [k for k, _ in models[0].named_parameters()]
    params = {
        k: torch.stack([dict(mod.named_parameters())[k].detach() for mod in models]).to(dev)
        for k in names
    }
    buffers = {
        k: torch.stack([dict(mod.named_buffers())[k] for mod in models]).to(dev)
        for k, _ in models[0].named_buffers()
    }
    stacked = StackedModels(copy.deepcopy(models[0]), m)
    gens = [_generators(s, dev, reproducible) for s in seeds]
    schedule = _Schedule(indices, recipe, [g[0] for g in gens], dev)
    xt = torch.as_tensor(x, dtype=torch.float32, device=dev)
    yt = torch.as_tensor(y, dtype=torch.long, device=dev)
    sizes = torch.tensor([len(ix) for ix in indices], dtype=torch.float32, device=dev)
    poisson = recipe.sampling == "poisson"
    expected = sizes * torch.tensor([recipe.sample_rate(len(ix)) for ix in indices], device=dev)
    numels = [params[k][0].numel() for k in names]
    std = recipe.noise_multiplier * recipe.clip if recipe.clip is not None else 0.0
    opt = _StackedOptimizer(params, recipe)
    t_max = int(schedule.steps.max())
    # each model's noise drawn a block of steps at a time from its own stream, every step's
    # release through the primitive (seeded normals; in release mode the grid's integers, the
    # noisy sums on the grid of privkit.mechanisms.grid_noise)
    noise = (
        ModelRows([g[1] for g in gens], sum(numels), schedule.steps.tolist(), BLOCK, dev)
        if recipe.clip is not None
        else None
    )
    for start in range(0, t_max, BLOCK):
        glob, w, active, counts = schedule.block(start)
        for t in range(glob.shape[1]):
            norm = expected if poisson else w[:, t].sum(1).clamp(min=1)
            width = max(1, int(counts[:, t].max()))  # columns beyond it are pads in every model
            b = glob[:, t, :width]
            # gathered example-major: a chunk of it is already the (B, M*C, H, W) layout of convolutions
            xb, yb, wb = xt[b.T].transpose(0, 1), yt[b], w[:, t, :width]
            if recipe.clip is None or noise is None:
                g = _mean_gradient(stacked, params, buffers, xb, yb, wb, norm)
            else:
                g = _private_gradient(
                    stacked, params, buffers, xb, yb, wb, recipe.clip, counts[:, t].tolist()
                )
                # one release per model: its clipped sum and its stream's noise of this step (its
                # receipt not kept: the models trained here carry no ledger)
                released, _ = gaussian_release(
                    [g[k] for k in names],
                    std=std,
                    sensitivity=recipe.clip,
                    source=noise,
                    dim=sum(numels),
                    mutate=False,
                )
                g = {k: v.div_(_expand(norm, v)) for k, v in zip(names, released)}
            opt.step(params, g, active[:, t])
    return [{k: v[j].detach().cpu().clone() for k, v in params.items()} for j in range(m)]


def _mean_gradient(stacked, params, buffers, xb, yb, wb, norm) -> dict[str, torch.Tensor]:
    """Per model the gradient of its summed batch loss divided by ``norm[m]`` (models are
    independent, so one backward pass of the total gives every model's own gradient), summed over
    chunks of examples as the clipped sums are (activations that stay in cache)."""
    p = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    step = stacked.chunk_size(xb)
    total: list[torch.Tensor] = []
    for start in range(0, xb.shape[1], step):
        s = slice(start, start + step)
        logits, _ = stacked.forward(p, buffers, xb[:, s])
        y, w = yb[:, s], wb[:, s]
        losses = (
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
            ).view_as(w)
            * w
        )
        grads = torch.autograd.grad((losses.sum(1) / norm).sum(), list(p.values()))
        total = list(grads) if not total else [t.add_(g) for t, g in zip(total, grads)]
    return dict(zip(p, total))


def _private_gradient(
    stacked, params, buffers, xb, yb, wb, clip: float, counts: list[int]
) -> dict[str, torch.Tensor]:
    """Per model the sum of its examples' clipped gradients (no noise yet); model m's examples
    are its first ``counts[m]``."""

    def losses(logits: torch.Tensor, models: torch.Tensor, s: slice) -> torch.Tensor:
        y, w = yb[models, s], wb[models, s]
        return (
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
            ).view_as(w)
            * w
        )

    return stacked.clipped_sums(params, buffers, xb, losses, clip, counts=counts)[0]


def load_states(spec: dict, states: list[dict[str, torch.Tensor]]) -> list[torch.nn.Module]:
    """Models built from ``spec`` with the given parameter dicts."""
    out = []
    for st in states:
        m = build_from_spec(spec)
        m.load_state_dict(st, strict=False)
        out.append(m)
    return out


def reference_models(
    spec: dict,
    x: np.ndarray,
    y: np.ndarray,
    *,
    n_models: int,
    recipe: SGDRecipe,
    seed: int = 0,
    device: str = "cpu",
    query: np.ndarray | None = None,
):
    """LiRA reference models for a user's own model: M models on halves of ``(x, y)`` (mask with
    each example in exactly half), trained at once; returns ``(logits (M, N, C), keep (M, N))``.

    Parameters
    ----------
    spec : dict
        The architecture spec of the user's model (:func:`privkit.models.build_from_spec`).
    x : numpy.ndarray
        The candidate records' features, ``(N, ...)``.
    y : numpy.ndarray
        Their integer class labels, ``(N,)``.
    n_models : int
        ``M``, the number of reference models: an even number ``>= 2``, so that each record is
        in exactly ``M / 2`` training sets.
    recipe : SGDRecipe
        How each reference model trains (it should match how the user's model was trained).
    seed : int
        Seeds the membership mask ``keep`` and the models' own seeds (default 0); the models train
        in reproducible mode.
    device : str
        Where the models train and are queried (default ``"cpu"``).
    query : numpy.ndarray or None
        The examples whose logits are returned, ``(Q, ...)``, giving ``logits`` of shape
        ``(M, Q, C)``; ``None`` (default): ``x`` itself (``Q = N``).
    """
    from attacks.experiment import membership_mask
    from attacks.recipe import torch_logits
    from privkit.seeding import child_seeds

    keep = membership_mask(n_models, len(y), seed)
    states = train_many(
        spec,
        x,
        y,
        [np.nonzero(k)[0] for k in keep],
        recipe,
        child_seeds(seed, n_models, "reference-models"),
        device=device,
    )
    q = x if query is None else query
    logits = np.stack([torch_logits(m, q, device=device) for m in load_states(spec, states)])
    return logits, keep


def _fit_one(
    spec: dict, recipe: SGDRecipe, x: np.ndarray, y: np.ndarray, seed: int
) -> torch.nn.Module:
    return load_states(spec, [train_one(spec, x, y, np.arange(len(y)), recipe, seed)])[0]


def _fit_many(
    spec: dict,
    recipe: SGDRecipe,
    x: np.ndarray,
    y: np.ndarray,
    index_sets: list,
    seeds: list,
    device: str = "cpu",
) -> list[torch.nn.Module]:
    return load_states(spec, train_many(spec, x, y, index_sets, recipe, seeds, device=device))


def batched_recipe(spec: dict, recipe: SGDRecipe, device: str = "cpu"):
    """The (DP-)SGD recipe as an audit-layer :class:`attacks.Recipe`: ``train_fn`` is
    :func:`train_one`, the batched form :func:`train_many` (same models up to float rounding).

    Parameters
    ----------
    spec : dict
        The architecture spec of every model the recipe trains
        (:func:`privkit.models.build_from_spec`); its ``arch`` names the recipe.
    recipe : SGDRecipe
        The hyper-parameters; with ``clip`` set the recipe is named ``dp-sgd``.
    device : str
        Where the batched form (:func:`train_many`) trains (default ``"cpu"``); ``train_fn``
        (:func:`train_one`) trains on the CPU. Both train in reproducible mode.
    """
    from functools import partial

    from attacks.recipe import Recipe

    return Recipe(
        partial(_fit_one, spec, recipe),
        train_many=partial(_fit_many, spec, recipe, device=device),
        name=f"{'dp-' if recipe.clip is not None else ''}sgd {spec.get('arch', 'model')}",
    )
