"""A recorded trace of ATen operations run by TorchScript's interpreter rather than as Python.

A ``torch.fx.GraphModule`` recorded by ``make_fx`` runs as generated Python code: one Python call
of an ``OpOverload`` per operation, a few microseconds each before torch's dispatcher is reached.
For a DP-SGD step of a small or medium model those calls are most of what a replayed step costs
its host (:mod:`privkit.mechanisms.step_replay`). TorchScript's interpreter runs the same
operations from C++: :func:`scripted` turns a trace into a TorchScript module over the same
tensors (the parameters are shared, not copied: an optimiser's in-place update is seen).

The operations are the trace's own, in its order: each ``OpOverload`` is named by its overload
packet (TorchScript names no overload) and TorchScript's schema matching picks the overload for
the arguments recorded, which on privkit's benchmark models gave the trace's floats bit for bit
(``tests/privkit/test_scripted_trace.py``). The module runs with TorchScript's graph
optimisations off (:func:`run_unoptimised`): the profiling executor would otherwise rewrite the
graph after its first runs (fusions), so that a run checked once would not be the run repeated.

``torch.jit.script`` is deprecated from torch 2.13 (it still works there); where torch no longer
offers it, or a trace holds something TorchScript cannot type, :func:`scripted` answers ``None``
and the trace runs as Python.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["ScriptedTrace", "run_unoptimised", "scripted"]


class ScriptedTrace:
    """A trace's TorchScript module, called with the trace's inputs (``None`` inputs, which the
    trace never reads and TorchScript cannot type as tensors, are left out of the call)."""

    def __init__(self, module: Callable, kept: list[int]) -> None:
        self.module, self.kept = module, kept

    def __call__(self, *inputs):
        return self.module(*(inputs[i] for i in self.kept))


def scripted(graph: torch.fx.GraphModule, inputs: tuple) -> ScriptedTrace | None:
    """``graph`` (recorded on ``inputs``, one placeholder each) as a :class:`ScriptedTrace`, or
    ``None`` where it cannot be scripted (the reason does not matter: the trace then runs as the
    graph's Python code)."""
    script = getattr(getattr(torch, "jit", None), "script", None)
    if script is None:
        return None
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph.graph, {}))
    holders = [n for n in copy.nodes if n.op == "placeholder"]
    if len(holders) != len(inputs):
        return None
    for node, value in zip(holders, inputs, strict=True):
        if value is None:
            if node.users:
                return None
            copy.erase_node(node)
    for node in copy.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket
    try:
        with warnings.catch_warnings():  # its deprecation, its notes on types: not the user's
            warnings.simplefilter("ignore")
            module = script(torch.fx.GraphModule(graph, copy))
    except Exception:  # whatever TorchScript cannot compile: the trace runs as Python
        return None
    return ScriptedTrace(module, [i for i, v in enumerate(inputs) if v is not None])


@contextlib.contextmanager
def run_unoptimised() -> Iterator[None]:
    """TorchScript's graph optimisations off in this thread while inside (a no-op where torch
    has no TorchScript)."""
    off = getattr(getattr(torch, "jit", None), "optimized_execution", None)
    with off(False) if off is not None else contextlib.nullcontext():
        yield
