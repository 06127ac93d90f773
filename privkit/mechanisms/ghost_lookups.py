"""An embedding subclass with a forward of its own under book-keeping ghost clipping: its table
lookups, seen where they happen.

HF transformers scales its word embeddings in a subclass (Gemma's, BART's, mBART's, Pegasus'
``...ScaledWordEmbedding``: ``super().forward(ids) * embed_scale``) and offsets its learned
positions in another (OPT's and BART's ``...LearnedPositionalEmbedding``:
``super().forward(positions + offset)``). A hook on the module sees its input and its output,
which are not the lookup's: the gradient the ghost norm needs is that of the lookup's output,
before the scale. So for such a module :mod:`privkit.mechanisms.ghost_clipping` takes, for the
pass, every ``F.embedding`` call on the module's weight (the lookup ``nn.Embedding.forward``
makes, or one the subclass makes itself) through a ``TorchFunctionMode`` (:class:`Lookups`): its
indices and its output are the layer's input and output. A subclass reading its weight any other
way adds an edge into the weight that no lookup accounts for, and ghost clipping's count of the
autograd graph's edges refuses the model; the row check holds for these layers as for all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["Lookups", "Report", "overrides_forward"]


def overrides_forward(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` of a subclass with a forward of its own."""
    return isinstance(module, torch.nn.Embedding) and (
        type(module).forward is not torch.nn.Embedding.forward
    )


#: ``report(indices, output)``: what a seen lookup gives instead of its output (``None``: its output)
Report = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


class Lookups(TorchFunctionMode):
    """Within it, each ``F.embedding`` call on a weight of ``seen`` (by ``id``, with the layer's
    padding row) is reported as ``report(indices, output)``, whose answer (a tensor, or ``None``
    for the output itself) is the call's result; a call with ``max_norm``, ``scale_grad_by_freq``
    or another padding row (each changes the lookup's gradient) raises ``refuse(why)``."""

    def __init__(
        self,
        seen: dict[int, tuple[int | None, Report]],
        refuse: Callable[[str], Exception],
    ):
        super().__init__()
        self.seen, self.refuse = seen, refuse

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not F.embedding:
            return out
        names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq")
        call = dict(zip(names, args, strict=False)) | kwargs
        weight = call["weight"]
        if id(weight) not in self.seen:
            return out
        padding, report = self.seen[id(weight)]
        if call.get("max_norm") is not None or call.get("scale_grad_by_freq"):
            raise self.refuse("an embedding lookup with max_norm or scale_grad_by_freq")
        given = call.get("padding_idx")
        if given is not None and given < 0:  # as F.embedding reads it
            given += weight.shape[0]
        if given != padding:  # the rows the lookup leaves without gradient are the layer's
            raise self.refuse(f"an embedding lookup with padding_idx {given}, not {padding}")
        answer = report(call["input"], out)
        return out if answer is None else answer
