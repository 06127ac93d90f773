"""Which training objects :func:`privkit.check.check_training` reads, and their names in its messages.

Recognition goes by the libraries in an object's class hierarchy: torch, opacus and Flower are
imported only when an object of theirs is present.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KINDS", "classify", "flatten"]

KINDS = {
    "engine": "opacus PrivacyEngine",
    "optimizer": "opacus DPOptimizer",
    "loader": "torch DataLoader (opacus DPDataLoader included)",
    "model": "torch nn.Module (opacus GradSampleModule included)",
    "local_dp": "Flower LocalDpMod (or a privkit.flower.recorded mod)",
    "client_app": "Flower ClientApp",
    "strategy": "Flower strategy (flwr.serverapp.strategy.Strategy)",
    # read but not checked on their own
    "sampler": "torch Sampler (read through the DataLoader that draws from it)",
    "plain_optimizer": "torch optimizer (adds no noise; the DPOptimizer is what is checked)",
}
"""Kind -> what it is. The last two are recognised but have nothing to check on their own."""


def _roots(obj: Any) -> set[str]:
    return {(cls.__module__ or "").split(".")[0] for cls in type(obj).__mro__}


def classify(obj: Any) -> str | None:
    """The kind (a key of :data:`KINDS`) of a training object, or None for anything else.

    Parameters
    ----------
    obj : object
        Any object; torch, opacus and Flower are imported only if its class derives from theirs.

    Returns
    -------
    str or None
    """
    if isinstance(obj, type):
        return None
    roots = _roots(obj)
    if callable(obj) and getattr(obj, "dp_mod", None) is not None:
        return "local_dp"  # privkit.flower.recorded(LocalDpMod(...))
    if "opacus" in roots:
        from opacus import PrivacyEngine
        from opacus.optimizers import DPOptimizer

        if isinstance(obj, PrivacyEngine):
            return "engine"
        if isinstance(obj, DPOptimizer):
            return "optimizer"
    if roots & {"torch", "opacus"}:
        import torch
        from torch.utils.data import DataLoader, Sampler

        for kind, cls in (
            ("loader", DataLoader),
            ("model", torch.nn.Module),
            ("sampler", Sampler),
            ("plain_optimizer", torch.optim.Optimizer),
        ):
            if isinstance(obj, cls):
                return kind
    if "flwr" in roots:
        from flwr.clientapp import ClientApp
        from flwr.clientapp.mod import LocalDpMod
        from flwr.serverapp.strategy import Strategy

        for kind, flwr_cls in (
            ("local_dp", LocalDpMod),
            ("client_app", ClientApp),
            ("strategy", Strategy),
        ):
            if isinstance(obj, flwr_cls):
                return kind
    return None


def flatten(objects: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """``(name, object)`` pairs: tuples and lists are opened, dicts give their keys as names.

    Parameters
    ----------
    objects : tuple
        What :func:`privkit.check.check_training` was given.

    Returns
    -------
    list of (str, object)
        Objects at the top level are named by their type (``DataLoader``, ``DataLoader#2`` for a
        second one), items of a list ``parent[i]``; every object appears once (by identity).
    """
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    counts: dict[str, int] = {}

    def visit(name: str | None, obj: Any) -> None:
        if isinstance(obj, dict):
            for key, value in obj.items():
                visit(str(key), value)
            return
        if isinstance(obj, (tuple, list)):
            for i, value in enumerate(obj):
                visit(None if name is None else f"{name}[{i}]", value)
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if name is None:
            base = type(obj).__name__
            counts[base] = counts.get(base, 0) + 1
            name = base if counts[base] == 1 else f"{base}#{counts[base]}"
        out.append((name, obj))

    for obj in objects:
        visit(None, obj)
    return out
