"""Vectorised training of M small torch models at once (stacked parameters, ``torch.func.vmap``).

The recipe "train one small model with (DP-)SGD" (the centralised / DP-SGD baselines, reference
models for a user's own model) is run for M models in lock-step: parameters stacked with
``torch.func.stack_module_state``, one ``vmap``-ed gradient per step, per-model batches gathered
by index. Each model keeps its own seed (initialisation, batch order, DP noise), and the result is
identical, up to float rounding, to :func:`train_one` run M times (tested).

Algorithm per model: ``epochs`` passes over its own index set in a seeded random order, batches of
``batch_size`` (last partial batch dropped), plain SGD with step ``lr``; with ``clip`` set, DP-SGD:
per-example gradients clipped to L2 norm ``clip``, summed, Gaussian noise of std
``noise_multiplier * clip`` added, divided by ``batch_size`` (fixed-size shuffled batches, not
Poisson sampling: account for it accordingly).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, stack_module_state, vmap

from privkit.models import build_from_spec
from privkit.seeding import seed_torch, torch_generator


@dataclass(frozen=True)
class SGDRecipe:
    """Hyper-parameters of the vectorisable recipe."""

    epochs: int = 5
    batch_size: int = 64
    lr: float = 0.1
    clip: float | None = None
    noise_multiplier: float = 0.0

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"epochs, batch_size must be >= 1 and lr > 0; found {self.epochs}, "
                             f"{self.batch_size}, {self.lr}")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip must be > 0; found {self.clip}")
        if self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0; found {self.noise_multiplier}")


def _init(spec: dict, seed: int) -> torch.nn.Module:
    seed_torch(seed)
    return build_from_spec(spec)


def _batches(n: int, recipe: SGDRecipe, gen: torch.Generator, noise_cb):
    """The loop's batch stream: per epoch a seeded permutation, full batches only."""
    for _ in range(recipe.epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n - recipe.batch_size + 1, recipe.batch_size):
            yield perm[s:s + recipe.batch_size]


def _loss(model, params, x, y):
    return F.cross_entropy(functional_call(model, params, (x,)), y)


def _example_loss(model, params, x, y):
    return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])


def _dp_grad(model, params, xb, yb, recipe: SGDRecipe, gen: torch.Generator) -> dict:
    per = vmap(grad(lambda p, x, y: _example_loss(model, p, x, y)), in_dims=(None, 0, 0))(params, xb, yb)
    return _clip_noise(per, recipe, [gen], single=True)


def _clip_noise(per: dict, recipe: SGDRecipe, gens: list, single: bool) -> dict:
    """Clip per-example grads (leading dims [M,] B), sum, add noise per model, divide by B."""
    lead = 1 if single else 2
    sq = sum(g.flatten(lead).pow(2).sum(-1) for g in per.values())
    factor = (recipe.clip / (sq.sqrt() + 1e-12)).clamp(max=1.0)
    out = {}
    for k, g in per.items():
        shaped = factor.reshape(factor.shape + (1,) * (g.dim() - lead))
        out[k] = (g * shaped).sum(lead - 1)
    std = recipe.noise_multiplier * recipe.clip
    for k in out:  # noise drawn per model, parameter by parameter, from that model's generator
        if std > 0:
            if single:
                out[k] = out[k] + torch.normal(0.0, std, out[k].shape, generator=gens[0])
            else:
                noise = torch.stack([torch.normal(0.0, std, out[k].shape[1:], generator=g) for g in gens])
                out[k] = out[k] + noise
        out[k] = out[k] / recipe.batch_size
    return out


def train_one(spec: dict, x: np.ndarray, y: np.ndarray, index: np.ndarray, recipe: SGDRecipe,
              seed: int) -> dict[str, torch.Tensor]:
    """Reference loop: train one model on ``x[index]``; returns its state dict."""
    model = _init(spec, seed)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    xt, yt = torch.as_tensor(x[index], dtype=torch.float32), torch.as_tensor(y[index], dtype=torch.long)
    gen = torch_generator(seed)
    for b in _batches(len(index), recipe, gen, None):
        if recipe.clip is None:
            g = grad(lambda p: _loss(model, p, xt[b], yt[b]))(params)
        else:
            g = _dp_grad(model, params, xt[b], yt[b], recipe, gen)
        params = {k: params[k] - recipe.lr * g[k] for k in params}
    return params


def train_many(spec: dict, x: np.ndarray, y: np.ndarray, indices: list[np.ndarray], recipe: SGDRecipe,
               seeds: list[int], device: str | torch.device = "cpu",
               chunk_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Train ``len(indices)`` models at once, model j on ``x[indices[j]]`` with seed ``seeds[j]``.

    Models with fewer batches than others sit idle (zero update) once their stream ends, so each
    follows exactly the loop's schedule. ``chunk_size`` trains the models in groups of that size
    (same result; bounds memory: DP-SGD holds M x batch per-example gradients).
    """
    if len(indices) != len(seeds) or not indices:
        raise ValueError(f"indices and seeds must be non-empty and equally long; found {len(indices)} and {len(seeds)}")
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; found {chunk_size}")
        out: list[dict[str, torch.Tensor]] = []
        for s in range(0, len(seeds), chunk_size):
            out += train_many(spec, x, y, indices[s:s + chunk_size], recipe, seeds[s:s + chunk_size], device)
        return out
    dev = torch.device(device)
    models = [_init(spec, s) for s in seeds]
    params, _ = stack_module_state(models)
    params = {k: v.detach().to(dev) for k, v in params.items()}
    base = copy.deepcopy(models[0]).to("meta")
    xt = torch.as_tensor(x, dtype=torch.float32, device=dev)
    yt = torch.as_tensor(y, dtype=torch.long, device=dev)
    gens = [torch_generator(s) for s in seeds]
    streams = [_batches(len(ix), recipe, g, None) for ix, g in zip(indices, gens)]
    ix_t = [torch.as_tensor(np.asarray(ix), dtype=torch.long) for ix in indices]
    dummy = torch.zeros(recipe.batch_size, dtype=torch.long)

    def model_loss(p, xb, yb):
        return F.cross_entropy(functional_call(base, p, (xb,)), yb)

    per_model_grad = vmap(grad(model_loss))
    per_example = vmap(vmap(grad(lambda p, xe, ye: model_loss(p, xe[None], ye[None])), in_dims=(None, 0, 0)))
    while True:
        batches, active = [], []
        for j, st in enumerate(streams):
            b = next(st, None)
            active.append(b is not None)
            batches.append(ix_t[j][b] if b is not None else dummy)
        if not any(active):
            break
        idx = torch.stack(batches).to(dev)
        xb, yb = xt[idx], yt[idx]
        if recipe.clip is None:
            g = per_model_grad(params, xb, yb)
        else:
            per = per_example(params, xb, yb)
            # only active models draw noise, so each generator's stream matches the loop
            act = [j for j, a in enumerate(active) if a]
            g = _clip_noise({k: v[act] for k, v in per.items()}, recipe, [gens[j] for j in act], single=False)
            full = {k: torch.zeros_like(params[k]) for k in params}
            for k in full:
                full[k][act] = g[k]
            g = full
        on = torch.tensor(active, dtype=torch.float32, device=dev)
        params = {k: params[k] - recipe.lr * g[k] * on.reshape((-1,) + (1,) * (params[k].dim() - 1))
                  for k in params}
    return [{k: v[j].detach().cpu() for k, v in params.items()} for j in range(len(seeds))]


def load_states(spec: dict, states: list[dict[str, torch.Tensor]]) -> list[torch.nn.Module]:
    """Models built from ``spec`` with the given parameter dicts."""
    out = []
    for st in states:
        m = build_from_spec(spec)
        m.load_state_dict(st, strict=False)
        out.append(m)
    return out


def reference_models(spec: dict, x: np.ndarray, y: np.ndarray, *, n_models: int, recipe: SGDRecipe,
                     seed: int = 0, device: str = "cpu", query: np.ndarray | None = None):
    """LiRA reference models for a user's own model: M models on halves of ``(x, y)`` (mask with
    each example in exactly half), trained at once; returns ``(logits (M, N, C), keep (M, N))``."""
    from attacks.experiment import membership_mask
    from attacks.recipe import torch_logits
    from privkit.seeding import child_seeds

    keep = membership_mask(n_models, len(y), seed)
    states = train_many(spec, x, y, [np.nonzero(k)[0] for k in keep], recipe,
                        child_seeds(seed, n_models, "reference-models"), device=device)
    q = x if query is None else query
    logits = np.stack([torch_logits(m, q, device=device) for m in load_states(spec, states)])
    return logits, keep


def _fit_one(spec: dict, recipe: SGDRecipe, x: np.ndarray, y: np.ndarray, seed: int) -> torch.nn.Module:
    return load_states(spec, [train_one(spec, x, y, np.arange(len(y)), recipe, seed)])[0]


def _fit_many(spec: dict, recipe: SGDRecipe, x: np.ndarray, y: np.ndarray, index_sets: list,
              seeds: list, device: str = "cpu") -> list[torch.nn.Module]:
    return load_states(spec, train_many(spec, x, y, index_sets, recipe, seeds, device=device))


def batched_recipe(spec: dict, recipe: SGDRecipe, device: str = "cpu"):
    """The (DP-)SGD recipe as an audit-layer :class:`attacks.Recipe`: ``train_fn`` is
    :func:`train_one`, the batched form :func:`train_many` (same models up to float rounding)."""
    from functools import partial

    from attacks.recipe import Recipe

    return Recipe(partial(_fit_one, spec, recipe), train_many=partial(_fit_many, spec, recipe, device=device),
                  name=f"{'dp-' if recipe.clip is not None else ''}sgd {spec.get('arch', 'model')}")
