"""Self-supervised pretraining of the feature extractor h0 on the public/auxiliary data (server side).

FedAUX Sec. 3.3 / App. C (preparation phase P1): contrastive representation learning (SimCLR,
NT-Xent loss) on the unlabelled auxiliary data at the server, Adam 1e-3. Only public data is used,
so h0 costs the clients no privacy. The recipe follows ``leftthomas/SimCLR`` (temperature 0.5,
projection head ``feature_dim -> feature_dim (ReLU) -> proj_dim``), sized for CPU: a few epochs of
batched tensor augmentations (random affine crop/rotation/scale, brightness/contrast jitter,
Gaussian noise, cut-out; horizontal flips for colour images), no torchvision.

h0 is cached per (public data, architecture, pretraining config, seed) within a process, so the
"+P" variants of several methods (and their shadow models, which share the public data) reuse it.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privkit.errors import PrivkitError
from privkit.methods.pretrain import PretrainConfig
from privkit.progress import progress_bar
from privkit.seeding import derive_seed, seed_torch, torch_generator
from privkit.trainers.common import (
    as_tensor,
    make_optimizer,
    minibatches,
    new_model,
    resolve_device,
)


# ----------------------------------------------------------------------------- augmentation
def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One random view of each image in ``x`` (N, C, H, W) in [0, 1]; deterministic in ``gen``."""
    n, c = x.shape[0], x.shape[1]
    dev = x.device

    def u(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return (lo + (hi - lo) * torch.rand(*shape, generator=gen)).to(dev)

    angle = u(-15, 15, n) * math.pi / 180
    scale = u(0.85, 1.15, n)
    tx, ty = u(-0.15, 0.15, n), u(-0.15, 0.15, n)
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    if c == 3:  # horizontal flips only make sense for natural images, not digits
        flip = (torch.rand(n, generator=gen) < 0.5).to(dev)
        theta[flip, :, 0] = -theta[flip, :, 0]
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")
    out = out * u(0.6, 1.4, n, 1, 1, 1) + u(-0.2, 0.2, n, 1, 1, 1)
    out = out + 0.05 * torch.randn(out.shape, generator=gen).to(dev)
    # cut-out: zero one random square (a quarter of the side) in half of the images
    h, w = x.shape[2], x.shape[3]
    side = max(1, h // 4)
    cy = (torch.rand(n, generator=gen) * (h - side)).long()
    cx = (torch.rand(n, generator=gen) * (w - side)).long()
    keep = torch.rand(n, generator=gen) < 0.5
    rows = torch.arange(h)[None, :]
    cols = torch.arange(w)[None, :]
    mask_r = (rows >= cy[:, None]) & (rows < cy[:, None] + side)
    mask_c = (cols >= cx[:, None]) & (cols < cx[:, None] + side)
    mask = (mask_r[:, :, None] & mask_c[:, None, :]) & ~keep[:, None, None]
    out = out.masked_fill(mask[:, None].to(dev), 0.0)
    return out.clamp(0.0, 1.0)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's normalised temperature-scaled cross-entropy over the 2N views of a batch."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    sim = z @ z.T / temperature
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, target)


# ----------------------------------------------------------------------------- pretraining
_CACHE: dict[str, tuple[dict[str, torch.Tensor], dict]] = {}


def _cache_key(federation, config: PretrainConfig, seed: int, x_idx: np.ndarray) -> str:
    fields = {
        k: getattr(config, k)
        for k in (
            "arch",
            "width",
            "feature_dim",
            "pretrain_data",
            "pretrain_epochs",
            "pretrain_batch_size",
            "pretrain_lr",
            "pretrain_temperature",
            "pretrain_proj_dim",
        )
    }
    digest = hashlib.sha256(np.ascontiguousarray(x_idx).tobytes()).hexdigest()[:16]
    return json.dumps(
        {
            "public": federation.public.name,
            "idx": digest,
            "shape": federation.input_shape,
            "classes": federation.num_classes,
            "seed": int(seed),
            **fields,
        },
        sort_keys=True,
    )


def pretrain_h0(
    federation, config: PretrainConfig, seed: int, *, progress: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """SimCLR-pretrained feature extractor weights (``model.features`` state dict) and run info.

    Parameters
    ----------
    federation : the federation whose public data (``config.pretrain_data`` part) is used.
    config : a :class:`PretrainConfig` (architecture and pretraining fields).
    seed : the trainer seed; the model init and augmentations use seeds derived from it (from
        ``config.pretrain_seed`` instead when that is set).

    Returns
    -------
    (state, info) : ``state`` loads into ``model.features`` of any model built by
        :func:`privkit.trainers.common.new_model` with this config; ``info`` records the data size,
        the final NT-Xent loss and whether the result came from the cache.
    """
    part = config.pretrain_data
    idx = {
        "all": federation.public_indices,
        "negative": federation.negative,
        "distill": federation.distill,
    }[part]
    if len(idx) < 2:
        raise PrivkitError(
            f"pretraining needs at least 2 public examples in {part!r}; found {len(idx)}"
        )
    if config.pretrain_seed is not None:
        seed = config.pretrain_seed
    key = _cache_key(federation, config, seed, idx)
    if key in _CACHE:
        state, info = _CACHE[key]
        return {k: v.clone() for k, v in state.items()}, {**info, "cached": True}
    device = resolve_device(config)
    pseed = derive_seed(seed, "pretrain")
    model, _ = new_model(federation, config, pseed)
    features = model.features.to(device)
    d = config.feature_dim
    seed_torch(derive_seed(seed, "pretrain-projection"))
    proj = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, config.pretrain_proj_dim)).to(
        device
    )
    opt = make_optimizer(
        list(features.parameters()) + list(proj.parameters()),
        "adam",
        config.pretrain_lr,
        weight_decay=1e-6,
    )
    x = as_tensor(federation.public.x[idx], device, torch.float32)
    gen = torch_generator(derive_seed(seed, "pretrain-batches"))
    aug_gen = torch_generator(derive_seed(seed, "pretrain-augment"))
    bs = min(config.pretrain_batch_size, len(x))
    last = float("nan")

    with progress_bar(progress) as bar:
        task = bar.add_task("pretrain h0 (SimCLR)", total=config.pretrain_epochs)
        for _ in range(config.pretrain_epochs):
            total, count = 0.0, 0
            for b in minibatches(len(x), bs, gen, drop_last=True):
                xb = x[b.to(device)]
                loss = nt_xent(
                    proj(features(augment(xb, aug_gen))),
                    proj(features(augment(xb, aug_gen))),
                    config.pretrain_temperature,
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(b)
                count += len(b)
            last = total / max(count, 1)
            bar.advance(task)
    state = {k: v.detach().cpu().clone() for k, v in features.state_dict().items()}
    info = {
        "data": part,
        "size": len(idx),
        "epochs": config.pretrain_epochs,
        "final_loss": last,
        "cached": False,
    }
    _CACHE[key] = (state, info)
    return {k: v.clone() for k, v in state.items()}, info


def clear_cache() -> None:
    """Forget every cached h0 (tests; memory)."""
    _CACHE.clear()


def init_model(
    federation, config: PretrainConfig, seed: int, *, progress: bool = False, **overrides
) -> tuple[nn.Module, dict, dict]:
    """The method's initial model: random (seeded), or with h0 when ``config.pretrain``.

    With ``config.freeze`` the feature extractor's parameters are frozen (``requires_grad=False``).
    Returns ``(model, spec, info)``; ``info`` is the pretraining info (empty without pretraining).
    """
    model, spec = new_model(federation, config, derive_seed(seed, "init"), **overrides)
    info: dict = {}
    if config.pretrain:
        state, info = pretrain_h0(federation, config, seed, progress=progress)
        model.features.load_state_dict(state)
    if config.freeze:
        for p in model.features.parameters():
            p.requires_grad_(False)
    return model, spec, info


__all__ = ["PretrainConfig", "augment", "clear_cache", "init_model", "nt_xent", "pretrain_h0"]
