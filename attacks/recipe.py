"""Training recipes: how the audited model is trained, so the auditor can train more like it.

A recipe is a callable ``train_fn(x, y, seed) -> model``. The model may be

* a scikit-learn classifier (``predict_proba``; its ``classes_`` are placed on columns 0..C-1),
* a ``torch.nn.Module`` returning logits (opacus' ``GradSampleModule`` included), or
* any callable from inputs to class probabilities, shape (N, C).

The auditor, not the recipe, decides which records each model sees: it calls ``train_fn`` on
subsets of its pool, with seeds of its own. :func:`predict_logits` turns any of the three model
kinds into one interface, (N, C) logits (log-probabilities for the probability models: their
softmax is the model's probabilities, which is all the attacks read).

A :class:`Recipe` may also carry a batched form, ``train_many(x, y, index_sets, seeds) -> models``,
that trains many models at once (e.g. vectorised DP-SGD); it must give the models ``train_fn``
would give on ``x[index_set]``, ``y[index_set]`` with the same seeds (up to float rounding).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attacks.conv_layout import channels_last_inference

#: probabilities are floored here before the log: only exact zeros are affected (float64 cannot
#: represent 1 - p below ~1e-16), and the log stays finite for the attacks' statistics.
PROBABILITY_FLOOR = 1e-30


def _is_torch_module(model: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch model means torch is already imported
    return torch is not None and isinstance(model, torch.nn.Module)


def model_kind(model: Any) -> str:
    """``"sklearn"`` (has ``predict_proba``), ``"torch"`` (a ``torch.nn.Module``) or ``"callable"``."""
    if callable(getattr(model, "predict_proba", None)):
        return "sklearn"
    if _is_torch_module(model):
        return "torch"
    if callable(model):
        return "callable"
    raise ValueError(
        "model must be a scikit-learn classifier (predict_proba), a torch.nn.Module or a "
        f"callable returning class probabilities; found {type(model).__name__}"
    )


def torch_logits(model, x: np.ndarray, *, batch_size: int = 1024, device: Any = None) -> np.ndarray:
    """Logits of a torch module on ``x`` in eval mode, batched, on the module's own device
    (or ``device``); the module's training mode is restored afterwards."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; found {batch_size}")
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    was_training = model.training
    model.to(device).eval()
    out = []
    try:
        with torch.no_grad(), channels_last_inference(model, device):
            for s in range(0, len(x), batch_size):
                xb = torch.as_tensor(
                    np.asarray(x[s : s + batch_size]), dtype=torch.float32, device=device
                )
                out.append(model(xb).float().cpu())
    finally:
        model.train(was_training)
    return torch.cat(out).numpy().astype(np.float64) if out else np.zeros((0, 0))


def _log_probabilities(p: np.ndarray, n: int, n_classes: int | None, what: str) -> np.ndarray:
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != n or (n_classes is not None and p.shape[1] != n_classes):
        want = f"({n}, {n_classes if n_classes is not None else 'C'})"
        raise ValueError(f"{what} must have shape {want}; found {p.shape}")
    if not np.all(np.isfinite(p)) or p.min(initial=0.0) < 0:
        raise ValueError(
            f"{what} must be finite and non-negative; found values in "
            f"[{np.nanmin(p)}, {np.nanmax(p)}]"
        )
    return np.log(np.maximum(p, PROBABILITY_FLOOR))


def _sklearn_probabilities(model, x: np.ndarray, n_classes: int | None) -> np.ndarray:
    p = np.asarray(model.predict_proba(x), dtype=np.float64)
    classes = getattr(model, "classes_", None)
    if classes is None or n_classes is None:
        return p
    # a model trained on a subset may have seen only some classes: put each column in its place
    cls = np.asarray(classes)
    if not np.issubdtype(cls.dtype, np.integer) or cls.min() < 0 or cls.max() >= n_classes:
        raise ValueError(
            f"classes_ must be integer labels in [0, {n_classes}); found {cls.tolist()[:10]}"
        )
    full = np.zeros((len(p), n_classes))
    full[:, cls] = p
    return full


def predict_logits(
    model: Any, x: np.ndarray, n_classes: int | None = None, *, batch_size: int = 1024
) -> np.ndarray:
    """(N, C) logits of any supported model on ``x`` (float64).

    Parameters
    ----------
    model : scikit-learn classifier, torch module (logits) or callable (probabilities).
    x : inputs, in the form the model takes.
    n_classes : C; scikit-learn outputs are spread over C columns by ``classes_``, and every output
        is checked to have C columns.
    """
    kind = model_kind(model)
    if kind == "torch":
        z = torch_logits(model, x, batch_size=batch_size)
        if n_classes is not None and len(x) and z.shape[-1] != n_classes:
            raise ValueError(f"model logits must have {n_classes} columns; found shape {z.shape}")
        return z
    if kind == "sklearn":
        return _log_probabilities(
            _sklearn_probabilities(model, x, n_classes), len(x), n_classes, "predict_proba output"
        )
    return _log_probabilities(model(x), len(x), n_classes, "model(x) probabilities")


class Recipe:
    """A training recipe with an optional batched form.

    Parameters
    ----------
    train_fn : ``train_fn(x, y, seed) -> model`` (see the module docstring for model kinds).
    train_many : optional ``train_many(x, y, index_sets, seeds) -> list of models``, model j
        trained on ``x[index_sets[j]]`` with ``seeds[j]``, as ``train_fn`` would.
    name : label for reports (default: the function's name).

    Notes
    -----
    Subclasses may override :meth:`fit`, :meth:`logits` and :meth:`details` (privkit's federated
    recipes return a whole training run and report its accounting through ``details``). A recipe
    that runs in worker processes must be picklable (module-level functions).
    """

    def __init__(
        self,
        train_fn: Callable[..., Any],
        *,
        train_many: Callable[..., Sequence[Any]] | None = None,
        name: str | None = None,
    ):
        if not callable(train_fn):
            raise ValueError(
                f"train_fn must be callable train_fn(x, y, seed) -> model; found {train_fn!r}"
            )
        if train_many is not None and not callable(train_many):
            raise ValueError(f"train_many must be callable or None; found {train_many!r}")
        self.train_fn = train_fn
        self.train_many = train_many
        self.name = name or getattr(train_fn, "__qualname__", type(train_fn).__name__)

    @property
    def batched(self) -> bool:
        return self.train_many is not None

    def fit(self, x: np.ndarray, y: np.ndarray, seed: int) -> Any:
        """One model on ``(x, y)``."""
        return self.train_fn(x, y, seed)

    def fit_many(
        self, x: np.ndarray, y: np.ndarray, index_sets: Sequence[np.ndarray], seeds: Sequence[int]
    ) -> list[Any]:
        """Model j on ``x[index_sets[j]]`` with ``seeds[j]``: the batched form when there is one."""
        if self.train_many is None:
            return [self.fit(x[ix], y[ix], s) for ix, s in zip(index_sets, seeds)]
        models = list(self.train_many(x, y, list(index_sets), list(seeds)))
        if len(models) != len(seeds):
            raise ValueError(
                f"train_many must return one model per index set ({len(seeds)}); "
                f"found {len(models)}"
            )
        return models

    def logits(self, model: Any, x: np.ndarray, n_classes: int | None = None) -> np.ndarray:
        """(N, C) logits of a model this recipe trained (:func:`predict_logits`)."""
        return predict_logits(model, x, n_classes)

    def details(self, model: Any) -> dict:
        """Picklable facts about a trained model to return with its outputs (none by default)."""
        return {}

    def __repr__(self) -> str:
        return f"Recipe({self.name}{', batched' if self.batched else ''})"


def as_recipe(recipe: Any) -> Recipe:
    """A :class:`Recipe` as is; a callable ``train_fn(x, y, seed)`` wrapped in one."""
    if isinstance(recipe, Recipe):
        return recipe
    if callable(recipe):
        return Recipe(recipe)
    raise ValueError(
        "recipe must be a callable train_fn(x, y, seed) -> model or an attacks.Recipe; "
        f"found {type(recipe).__name__}"
    )
