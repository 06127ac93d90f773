"""Small models written as a feature extractor ``h`` followed by a linear head.

Methods freeze ``features`` and train or privatise ``head`` alone (FedAUX's "+F", FedAUXfdp's DP
heads). No BatchNorm: DP-SGD (per-sample gradients) and vectorised shadow training need layers
whose output for one example does not depend on the others in its batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from privkit.errors import PrivkitError

ARCHITECTURES = ("cnn", "mlp")
"""The architectures :func:`build_model` builds."""


class FeatureClassifier(nn.Module):
    """``head(features(x))``; ``feature_dim`` is the width of ``features``' output.

    Parameters
    ----------
    features : torch.nn.Module
        Maps a batch of inputs to feature vectors of width ``feature_dim``.
    feature_dim : int
        Width of the feature vector.
    num_classes : int
        Number of classes: the linear head maps features to this many logits.
    """

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.features = features
        self.feature_dim = feature_dim
        self.head = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


class UnitNormalize(nn.Module):
    """``(h - center) / ||h - center||`` per example (zero stays zero); ``normalize=True`` in specs.

    ``center`` is a buffer (zeros unless set, e.g. to a mean over public data); no parameters.
    """

    center: torch.Tensor  # the buffer

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("center", torch.zeros(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h - self.center
        norm = h.norm(dim=1, keepdim=True)
        return torch.where(norm > 0, h / norm.clamp_min(1e-30), torch.zeros_like(h))


def _cnn_features(in_shape: tuple[int, int, int], width: int, feature_dim: int) -> nn.Sequential:
    c, h, w = in_shape
    if h < 8 or w < 8:
        raise PrivkitError(f"cnn needs inputs of at least 8x8; found {h}x{w}")
    return nn.Sequential(
        nn.Conv2d(c, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * width * (h // 4) * (w // 4), feature_dim),
        nn.ReLU(),
    )


def _mlp_features(in_shape: tuple[int, int, int], hidden: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = int(torch.tensor(in_shape).prod())
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers)


def build_model(
    arch: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: int = 16,
    feature_dim: int = 128,
    depth: int = 1,
    normalize: bool = False,
) -> FeatureClassifier:
    """Build a model from a spec.

    Parameters
    ----------
    arch : str
        ``"cnn"`` (two conv blocks + dense layer; 1x28x28 and 3x32x32 inputs, any size >= 8x8)
        or ``"mlp"``.
    input_shape : tuple of int
        (C, H, W) of one input.
    num_classes : int
        Number of classes (width of the linear head), >= 2.
    width : int
        Conv channels of the first block (cnn).
    feature_dim : int
        Width of the feature vector h(x) (cnn: dense layer; mlp: hidden width).
    depth : int
        Hidden layers (mlp).
    normalize : bool
        Append ``(h - c) / ||h - c||`` to the features (heads fitted on unit-norm
        features, FedAUXfdp); adds one buffer ``c``, no parameters.
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3:
        raise PrivkitError(f"input_shape must be (C, H, W); found {input_shape}")
    if num_classes < 2:
        raise PrivkitError(f"num_classes must be >= 2; found {num_classes}")
    if arch in ARCHITECTURES:
        feats = (
            _cnn_features(shape, width, feature_dim)
            if arch == "cnn"
            else _mlp_features(shape, feature_dim, depth)
        )
        if normalize:
            feats.append(UnitNormalize(feature_dim))
        return FeatureClassifier(feats, feature_dim, num_classes)
    raise PrivkitError(f"arch must be one of {', '.join(ARCHITECTURES)}; found {arch!r}")


def model_spec(arch: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any) -> dict:
    """A JSON-able spec that :func:`build_from_spec` turns back into the same architecture.

    Parameters
    ----------
    arch : str
        ``"cnn"`` or ``"mlp"`` (see :func:`build_model`).
    input_shape : tuple of int
        (C, H, W) of one input.
    num_classes : int
        Number of classes.
    **kwargs : Any
        The keyword arguments of :func:`build_model` (``width``, ``feature_dim``, ``depth``,
        ``normalize``), stored as given.
    """
    return {
        "arch": arch,
        "input_shape": list(input_shape),
        "num_classes": int(num_classes),
        **kwargs,
    }


def build_from_spec(spec: dict) -> FeatureClassifier:
    """The model a :func:`model_spec` describes, freshly initialised."""
    kwargs = {k: v for k, v in spec.items() if k not in ("arch", "input_shape", "num_classes")}
    return build_model(spec["arch"], tuple(spec["input_shape"]), spec["num_classes"], **kwargs)


def select_device(spec: str = "auto") -> torch.device:
    """``auto`` picks ``cuda`` when available, else ``cpu``; asking for an absent ``cuda`` is an error."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PrivkitError(
                f"device must be auto, cpu or an available cuda device; found {spec!r} "
                "but torch sees no GPU"
            )
        # cudnn's autotuner re-tunes every convolution for each new input shape, and a Poisson
        # batch has a new size nearly every step (6.8 s per DP-SGD step measured on an H200):
        # privkit's runs keep it off
        torch.backends.cudnn.benchmark = False
        return torch.device(spec)
    raise PrivkitError(f"device must be auto, cpu or cuda; found {spec!r}")


__all__ = [
    "ARCHITECTURES",
    "FeatureClassifier",
    "UnitNormalize",
    "build_from_spec",
    "build_model",
    "model_spec",
    "select_device",
]
