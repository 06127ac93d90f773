"""Tensors of no example that the model broadcasts over the batch, followed from their source to
where they meet it, under book-keeping ghost clipping.

A relative-position bias is computed from a trainable table and positions alone: T5 looks its
table up on ``(T, T)`` position buckets, permutes the ``(T, T, H)`` result to ``(1, H, T, T)`` and
adds it to every example's attention scores; Swin indexes its bias table by positions, reshapes
it and adds it to every window's scores. Such a tensor holds no example's rows, and the model's
code (``permute([2, 0, 1])`` on a 3-d tensor) does not accept one repeated per example, so neither
of :mod:`privkit.mechanisms.ghost_clipping`'s per-example stand-ins (repeated positions, bare
parameters' stand-ins) gets through its forward.

:class:`BroadcastTrace` (a ``TorchFunctionMode``) follows such a tensor instead, from its source
(the lookup's output, or the bare parameter itself) through the operations applied to it:

* shape operations and conversions (``permute``, ``unsqueeze``, ``view``, ``reshape``, ``to``,
  indexing by positions...) and elementwise operations with numbers or with tensors that hold no
  example either (a causal mask): maps of the source that no example enters, each recorded.
  Which tensors hold examples is told by where they come from (the model's input, the
  stand-ins, and what is computed from them), not by their shapes, so that a table whose length
  is a multiple of the batch size is not taken for the batch;
* the elementwise operation where it meets the batch (an addition to the scores, a product, with
  an operand that holds examples; the result's first dimension ``B k``, the traced operand's 1
  there), or attention's additive mask (``scaled_dot_product_attention`` on the batch's queries,
  keys or values): the traced operand is replaced by its stride-0 repetition over those rows (the
  values the broadcast gives), whose gradient holds row by row what each example sends back, and
  that repetition's autograd edge is taken;
* anything else that makes a tensor requiring a gradient from a traced one (a matrix product, an
  in-place write into it, a concatenation, an index by the batch's tokens), and a traced tensor
  returned as the model's output: :class:`Untraceable`, and ghost clipping leaves the model to
  ``torch.func``. Every path from the source to the loss then runs through a meeting.

Example ``i``'s gradient of the source is then the vector-Jacobian product of the recorded maps,
at the source, applied to the sum of its rows of each meeting's gradient
(:func:`per_example_grads`, ``torch.func.vjp`` under ``vmap``). Ghost clipping's row check covers
the meetings' edges on a model's first pass (each row's gradient must be one example's: rows
that are positions, not examples, are refused), the first pass also checks that the model's
outputs are its own and that each source's per-example gradients add up to its whole gradient
(a path the trace did not see, such as an ``autograd.Function`` whose backward is not its
forward's, breaks it; a source that meets the batch nowhere must not reach the loss), a meeting
where autograd records nothing (within ``no_grad`` or a custom function's forward) is refused,
and the autograd graph's edges into a followed parameter must be the uses the trace saw.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

from privkit.mechanisms.stacked import UnsupportedModelError

__all__ = ["BroadcastTrace", "Source", "Untraceable", "per_example_grads"]

_T = torch.Tensor

#: operations that move, reshape, convert or pick a traced tensor's values (linear maps of it)
_SHAPE_OPS = {
    _T.permute, torch.permute, _T.unsqueeze, torch.unsqueeze, _T.squeeze, torch.squeeze,
    _T.view, _T.reshape, torch.reshape, _T.transpose, torch.transpose, _T.contiguous,
    _T.flatten, torch.flatten, _T.unflatten, _T.to, _T.type_as, _T.float, _T.double,
    _T.half, _T.bfloat16, _T.__getitem__, _T.clone, _T.view_as, _T.reshape_as,
}  # fmt: skip
_SHAPE_OPS |= {_T.mT.__get__, _T.T.__get__}  # type: ignore[attr-defined]  # transposes
#: elementwise operations broadcasting their operands: where a traced tensor meets the batch, or
#: an operation with numbers and tensors of no example (``where``'s condition picks the traced
#: values or the other's)
_ELEMENTWISE = {
    torch.add, _T.add, _T.__add__, _T.__radd__, _T.__iadd__, _T.add_, torch.sub, _T.sub,
    _T.__sub__, _T.__rsub__, torch.mul, _T.mul, _T.__mul__, _T.__rmul__, torch.div, _T.div,
    _T.__truediv__, _T.__rtruediv__, torch.where, _T.where,
}  # fmt: skip
#: attention whose additive mask is a traced tensor: it meets the batch of the queries
_ATTENTION = {torch.nn.functional.scaled_dot_product_attention}
_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
#: additions writing into their first operand (which must not be the traced one)
_IN_PLACE = {_T.__iadd__, _T.add_}


class Untraceable(UnsupportedModelError):
    """A traced tensor is used other than by the operations :class:`BroadcastTrace` follows."""


@dataclass
class _Meeting:
    """Where a traced tensor met the batch: the edge of its repetition over ``rows`` rows, the
    recorded maps from the source to it, and its shape there."""

    edge: Any
    maps: tuple[Callable[[torch.Tensor], torch.Tensor], ...]
    shape: torch.Size


@dataclass
class Source:
    """A traced tensor's origin: the tensor, where it met the batch, and how many operations read
    the tensor itself (each an edge of the autograd graph into it)."""

    tensor: torch.Tensor
    name: str  #: what it is, for messages (a parameter's name, an embedding's output)
    meetings: list[_Meeting] = field(default_factory=list)
    uses: int = 0

    @property
    def edges(self) -> list:
        return [m.edge for m in self.meetings]


def _tensors(*values: Any) -> list[torch.Tensor]:
    """The tensors among ``values`` and in the lists, tuples and dicts among them, one level deep
    (how torch functions take tensors; a full pytree flatten at every operation of a forward pass
    cost a third of a T5 step)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
        elif isinstance(v, dict):
            out.extend(t for t in v.values() if isinstance(t, torch.Tensor))
    return out


def _requires_grad(out: Any) -> bool:
    return any(t.requires_grad for t in _tensors(out))


class BroadcastTrace(TorchFunctionMode):
    """Within the block, the tensors registered by :meth:`source` and what is computed from them
    are followed (see the module docstring) for a batch of ``b`` examples: the batch's own
    tensors are the input registered by :meth:`batch` and whatever an operation computes from one
    of them (what holds an example is told by where it came from, not by its shape)."""

    def __init__(self, b: int) -> None:
        super().__init__()
        self.b = b
        # id -> (tensor, its source, the maps from the source to it); the tensor is held so that
        # its id is not reused while the pass runs
        self._traced: dict[int, tuple[torch.Tensor, Source, tuple]] = {}
        # id -> a weak reference to each tensor computed from the batch: a dead or reused id's
        # reference does not give the tensor back. Marked at every operation of the forward pass:
        # a plain dict of references costs a quarter of a WeakValueDictionary's entries
        self._batch: dict[int, weakref.ref] = {}

    def source(self, tensor: torch.Tensor, name: str) -> Source:
        """Follow ``tensor`` (called ``name`` in messages) from here on."""
        found = Source(tensor, name)
        self._traced[id(tensor)] = (tensor, found, ())
        return found

    def batch(self, tensor: torch.Tensor) -> None:
        """``tensor`` holds the batch's examples (the model's input)."""
        self._batch[id(tensor)] = weakref.ref(tensor)

    def _of(self, t: Any) -> tuple[torch.Tensor, Source, tuple] | None:
        return self._traced.get(id(t)) if isinstance(t, torch.Tensor) else None

    def _holds_examples(self, t: Any) -> bool:
        ref = self._batch.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def escaped(self, out: Any) -> None:
        """:class:`Untraceable` where the model's output is a followed tensor itself: its gradient
        would reach the source other than through a meeting."""
        for t in _tensors(out):
            if self._of(t) is not None:
                raise Untraceable(
                    f"{self._name(t)}, followed to where it meets the batch, is the model's output"
                )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every operation of the forward pass comes here: one pass over its tensors says whether
        # one is followed (rare: the operations of the followed tensors) and whether one holds
        # examples (then so do its results)
        kwargs = kwargs or {}
        leaves = _tensors(*args, kwargs) if kwargs else _tensors(*args)
        traced, batch = self._traced, self._batch
        followed = examples = False
        for t in leaves:
            followed = followed or id(t) in traced
            if not examples:
                ref = batch.get(id(t))
                examples = ref is not None and ref() is t
        out = self._dispatch(func, args, kwargs, leaves) if followed else func(*args, **kwargs)
        if examples:
            for t in (out,) if isinstance(out, torch.Tensor) else _tensors(out):
                batch[id(t)] = weakref.ref(t)
        return out

    def _dispatch(self, func, args: tuple, kwargs: dict, leaves: list) -> Any:
        """An operation reading a followed tensor."""
        hits = [i for i, t in enumerate(leaves) if self._of(t) is not None]
        for i in hits:
            _, source, _ = self._traced[id(leaves[i])]
            source.uses += leaves[i] is source.tensor  # an operation reading the source itself
        if len(hits) == 1 and args and self._of(args[0]) is not None and func in _SHAPE_OPS:
            if any(self._holds_examples(t) for t in leaves):  # indexed by the batch's tokens
                raise Untraceable(
                    f"{self._name(args[0])}, followed to where it meets the batch, is "
                    f"{getattr(func, '__name__', func)} with the batch's values, which ghost "
                    "clipping does not follow"
                )
            return self._follow(
                func(*args, **kwargs), args[0], lambda v: func(v, *args[1:], **kwargs)
            )
        if len(hits) == 1 and func in _ATTENTION:
            return self._attention(func, args, kwargs)
        if len(hits) == 1 and func in _ELEMENTWISE and not kwargs:
            return self._elementwise(func, args)
        out = func(*args, **kwargs)
        if _requires_grad(out):
            raise Untraceable(
                f"{self._name(leaves[hits[0]])}, followed to where it meets the batch, is used by "
                f"{getattr(func, '__name__', func)}, which ghost clipping does not follow"
            )
        return out

    def _name(self, t: torch.Tensor) -> str:
        return self._traced[id(t)][1].name

    def _follow(self, out: Any, parent: torch.Tensor, step: Callable) -> Any:
        """``out`` computed from the traced ``parent`` by the map ``step``: traced too."""
        if isinstance(out, torch.Tensor):
            _, src, maps = self._traced[id(parent)]
            self._traced[id(out)] = (out, src, (*maps, step))
        return out

    def _elementwise(self, func, args: tuple) -> Any:
        """An elementwise operation with a traced operand: with an operand of the batch's, the
        meeting (the traced operand repeated over the batch's rows gives the same values, whatever
        the operation); else the result is traced (the others hold no example)."""
        at = next(i for i, a in enumerate(args) if self._of(a) is not None)
        t = args[at]
        if func in _IN_PLACE and at == 0:
            raise Untraceable(
                f"{self._name(t)}, followed to where it meets the batch, is added to in place, "
                "which ghost clipping does not follow"
            )
        if func in (torch.where, _T.where) and at == 0:
            raise Untraceable(
                f"{self._name(t)}, followed to where it meets the batch, is a condition of where, "
                "which ghost clipping does not follow"
            )

        def put(v: torch.Tensor) -> tuple:
            return (*args[:at], v, *args[at + 1 :])

        if not any(self._holds_examples(a) for a in args):  # no example meets it here
            return self._follow(func(*args), t, lambda v: func(*put(v)))
        shapes = [a.shape for a in args if isinstance(a, torch.Tensor)]
        return func(*put(self._meet(t, torch.broadcast_shapes(*shapes))))

    def _meet(self, t: torch.Tensor, shape: torch.Size | tuple) -> torch.Tensor:
        """``t`` met the batch in a result of ``shape``: repeated over its first dimension, the
        batch's rows (``B k``, example-major: the row check sees it on a model's first pass), the
        meeting recorded."""
        padded = (1,) * (len(shape) - t.dim()) + tuple(t.shape)
        if not shape or padded[0] != 1 or shape[0] % self.b:
            raise Untraceable(
                f"{self._name(t)}, followed to where it meets the batch, meets it on "
                f"{tuple(shape)} where its own shape is {tuple(t.shape)}: not broadcast over the "
                "batch's rows"
            )
        _, src, maps = self._traced[id(t)]
        repeated = t.reshape(padded).expand(shape[0], *padded[1:])
        if repeated.grad_fn is None:  # autograd records nothing here (no_grad, a Function)
            raise Untraceable(
                f"{self._name(t)}, followed to where it meets the batch, meets it where autograd "
                "records no gradient (within no_grad or a custom autograd Function)"
            )
        src.meetings.append(_Meeting(get_gradient_edge(repeated), maps, t.shape))
        return repeated

    def _attention(self, func, args: tuple, kwargs: dict) -> Any:
        """Scaled dot-product attention whose additive mask is traced: it meets the batch in the
        scores (``(B, heads, L, S)``, the mask's broadcast) where the queries, keys or values hold
        the batch's examples."""
        named = dict(zip(_ATTENTION_ARGS, args)) | kwargs
        mask, query = named.get("attn_mask"), named["query"]
        examples = any(self._holds_examples(named[k]) for k in ("query", "key", "value"))
        if mask is None or self._of(mask) is None or mask.dtype == torch.bool or not examples:
            traced = next(t for t in _tensors(*args, kwargs) if self._of(t) is not None)
            raise Untraceable(
                f"{self._name(traced)}, followed to where it meets the batch, enters attention "
                "other than as the additive mask of the batch's scores, which ghost clipping "
                "does not follow"
            )
        scores = (*query.shape[:-1], named["key"].shape[-2])
        repeated = self._meet(mask, torch.broadcast_shapes(scores, mask.shape))
        rest = {k: v for k, v in named.items() if k != "attn_mask"}
        return func(**rest, attn_mask=repeated)


def per_example_grads(
    source: Source, grads: list[torch.Tensor | None], b: int
) -> torch.Tensor | None:
    """Each example's gradient of ``source``'s tensor, ``(b, *shape)``, from the gradients of its
    meetings' edges (in order; ``None``: that meeting did not reach the loss). Meetings of one
    traced tensor (T5's bias, added in every layer) share their maps: their cotangents are summed
    first, one vector-Jacobian product for all of them."""
    # id of the maps (one tuple per traced tensor) -> (maps, the summed per-example cotangent)
    summed: dict[int, tuple[tuple, torch.Tensor]] = {}
    for meeting, g in zip(source.meetings, grads, strict=True):
        if g is None:
            continue
        cotangent = g.reshape(b, -1, *g.shape[1:]).sum(1).reshape(b, *meeting.shape)
        if id(meeting.maps) in summed:
            cotangent = summed[id(meeting.maps)][1] + cotangent
        summed[id(meeting.maps)] = (meeting.maps, cotangent)
    total: torch.Tensor | None = None
    base = source.tensor.detach()
    for steps, cotangent in summed.values():

        def maps(v: torch.Tensor, steps=steps) -> torch.Tensor:
            for step in steps:
                v = step(v)
            return v

        vjp = torch.func.vjp(maps, base)[1]
        (part,) = torch.func.vmap(vjp)(cotangent)
        total = part if total is None else operator.add(total, part)
    return total
