"""A layer subclass with a forward of its own under book-keeping ghost clipping: its functional
calls, seen where they happen.

HF transformers scales its word embeddings in a subclass (Gemma's, BART's, mBART's, Pegasus'
``...ScaledWordEmbedding``: ``super().forward(ids) * embed_scale``), offsets its learned
positions in another (OPT's and BART's ``...LearnedPositionalEmbedding``:
``super().forward(positions + offset)``), and runs ConvNeXt's LayerNorm on permuted channels
(``ConvNextLayerNorm``). A hook on such a module sees its input and its output, which are not the
layer's: ghost clipping needs the input and the output gradient of the computation that reads the
weight. So for a subclass of ``nn.Embedding``, ``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm`` or
``nn.GroupNorm`` with a forward of its own, :mod:`privkit.mechanisms.ghost_clipping` takes, for
the pass, every call of the layer's functional form (``F.embedding``, ``F.linear``,
``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``) on the module's weight, through a
``TorchFunctionMode`` (:class:`FunctionalCalls`): the call's input and output are the layer's.
The call's other arguments must be the module's (its bias, padding row, normalised shape, groups,
epsilon), else the model is refused: ghost clipping computes with the module's. A subclass
reading its weight any other way adds an edge into the weight that no call accounts for, and
ghost clipping's count of the autograd graph's edges refuses the model; the row check holds for
these layers as for all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["BASES", "FunctionalCalls", "Report", "overrides_forward"]

#: each layer class a subclass may override: its functional form, the form's arguments in order,
#: and the defaults of those the module's own forward passes
BASES: dict[type[nn.Module], tuple[Callable, tuple[str, ...], dict]] = {
    nn.Embedding: (
        F.embedding,
        ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq"),
        {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False},
    ),
    nn.Linear: (F.linear, ("input", "weight", "bias"), {"bias": None}),
    nn.LayerNorm: (
        F.layer_norm,
        ("input", "normalized_shape", "weight", "bias", "eps"),
        {"bias": None, "eps": 1e-5},
    ),
    nn.RMSNorm: (F.rms_norm, ("input", "normalized_shape", "weight", "eps"), {"eps": None}),
    nn.GroupNorm: (
        F.group_norm,
        ("input", "num_groups", "weight", "bias", "eps"),
        {"bias": None, "eps": 1e-5},
    ),
}
_FORMS = {func: (base, names, defaults) for base, (func, names, defaults) in BASES.items()}

#: ``report(input, output)``: what a seen call gives instead of its output (``None``: its output)
Report = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def overrides_forward(module: nn.Module) -> bool:
    """Whether ``module`` is a subclass of a layer of :data:`BASES` with a forward of its own."""
    base = next((b for b in BASES if isinstance(module, b)), None)
    return base is not None and type(module).forward is not base.forward


def _own(module: nn.Module, key: str):
    """The module's own value of a functional argument ``key`` (a marker no call's value equals
    where the module has none)."""
    value: Any = getattr(module, key, _NONE_OF_ITS_OWN)
    return tuple(value) if key == "normalized_shape" else value


#: the value of an argument the module has no attribute for
_NONE_OF_ITS_OWN = object()


def _disagreement(module: nn.Module, call: dict, defaults: dict) -> str | None:
    """Why a functional call on ``module``'s weight does not compute the module's layer (an
    argument other than the module's own), or ``None``."""
    call = defaults | call
    if isinstance(module, nn.Embedding):
        if call["max_norm"] is not None or call["scale_grad_by_freq"]:
            return f"{type(module).__name__} looks up with max_norm or scale_grad_by_freq"
        if call["padding_idx"] is not None and call["padding_idx"] < 0:  # as F.embedding reads it
            call["padding_idx"] += module.num_embeddings
    for key, value in call.items():
        if key in ("input", "weight", "norm_type", "max_norm", "scale_grad_by_freq", "sparse"):
            # (a sparse gradient has the dense one's values: ghost clipping's sums are dense)
            continue
        value = tuple(value) if key == "normalized_shape" else value
        own = _own(module, key)
        same = value is own if key == "bias" else value == own
        if not same:
            shown = "another tensor" if key == "bias" else value
            return f"{type(module).__name__}'s call takes {key} {shown}, not its own {own!r:.40}"
    return None


class FunctionalCalls(TorchFunctionMode):
    """Within it, each call of a :data:`BASES` functional form on a weight of ``seen`` (by
    ``id``, with its module) is reported as ``report(input, output)``, whose answer (a tensor, or
    ``None`` for the output itself) is the call's result; a call whose other arguments are not
    the module's raises ``refuse(why)``."""

    def __init__(
        self, seen: dict[int, tuple[nn.Module, Report]], refuse: Callable[[str], Exception]
    ):
        super().__init__()
        self.seen, self.refuse = seen, refuse

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        form = _FORMS.get(func)
        if form is None:
            return out
        base, names, defaults = form
        call = dict(zip(names, args, strict=False)) | kwargs
        weight = call.get("weight")
        if weight is None or id(weight) not in self.seen:
            return out
        module, report = self.seen[id(weight)]
        if not isinstance(module, base):  # another layer's form on a shared weight (a tied head)
            return out
        why = _disagreement(module, call, defaults)
        if why is not None:
            raise self.refuse(why)
        answer = report(call["input"], out)
        return out if answer is None else answer
