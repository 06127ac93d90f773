"""A recorded trace of ATen operations run by TorchScript's interpreter rather than as Python.

A ``torch.fx.GraphModule`` recorded by ``make_fx`` runs as generated Python code: one Python call
of an ``OpOverload`` per operation, a few microseconds each before torch's dispatcher is reached.
For a DP-SGD step of a small or medium model those calls are most of what a replayed step costs
its host (:mod:`privkit.mechanisms.step_replay`). TorchScript's interpreter runs the same
operations from C++: :func:`scripted` compiles a trace's code as a TorchScript function of the
trace's tensors (the parameters passed by reference, not copied: an optimiser's in-place update
is seen) and of its inputs. The code is compiled from its text by TorchScript's own parser
(``torch.jit.CompilationUnit``): 0.05-0.07 s for a trace of 700-2,000 operations, against
0.16-0.38 s for ``torch.jit.script`` of the graph module, whose Python front end reads and
tokenises the generated source (the same compiled operations, bit for bit).

The operations are the trace's own, in its order: each ``OpOverload`` is named by its overload
packet (TorchScript names no overload) and TorchScript's schema matching picks the overload for
the arguments recorded, which on privkit's benchmark models gave the trace's floats bit for bit
(``tests/privkit/test_scripted_trace.py``). The function runs with TorchScript's graph
optimisations off (:func:`run_unoptimised`): the profiling executor would otherwise rewrite the
graph after its first runs (fusions), so that a run checked once would not be the run repeated.

TorchScript is deprecated from torch 2.13 (it still works there); where torch no longer offers
it, or a trace holds something TorchScript cannot compile, :func:`scripted` answers ``None`` and
the trace runs as Python.
"""

from __future__ import annotations

import contextlib
import operator
import re
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["ScriptedTrace", "run_unoptimised", "scripted"]


class ScriptedTrace:
    """A trace compiled by TorchScript: a function of the trace's tensors (its parameters and
    constants, passed by reference) and of its inputs (``None`` inputs, which the trace never
    reads and TorchScript cannot type as tensors, are left out of the call)."""

    def __init__(self, function: Callable, constants: list[torch.Tensor], kept: list[int]) -> None:
        self.function, self.constants, self.kept = function, constants, kept

    def __call__(self, *inputs):
        return self.function(self.constants, *(inputs[i] for i in self.kept))


def scripted(graph: torch.fx.GraphModule, inputs: tuple) -> ScriptedTrace | None:
    """``graph`` (recorded on ``inputs``, one placeholder each) compiled as a
    :class:`ScriptedTrace`, or ``None`` where it cannot be (the reason does not matter: the trace
    then runs as the graph's Python code)."""
    unit = getattr(getattr(torch, "jit", None), "CompilationUnit", None)
    if unit is None:
        return None
    copy = _by_packets(graph, inputs)
    if copy is None:
        return None
    names = sorted({str(n.target) for n in copy.nodes if n.op == "get_attr"})
    code = copy.python_code(root_module="self")
    try:
        with warnings.catch_warnings():  # TorchScript's deprecation: not the user's concern
            warnings.simplefilter("ignore")
            compiled = unit()
            compiled.define(_source(code.src, names), rcb=code.globals.get)
        constants = [operator.attrgetter(name)(graph) for name in names]
    except Exception:  # whatever TorchScript cannot compile: the trace runs as Python
        return None
    kept = [i for i, v in enumerate(inputs) if v is not None]
    return ScriptedTrace(compiled.forward, constants, kept)


def _by_packets(graph: torch.fx.GraphModule, inputs: tuple) -> torch.fx.Graph | None:
    """A copy of the trace's graph with each operation named by its overload packet and without
    the placeholders of ``None`` inputs (``None`` where an input does not match a placeholder, a
    ``None`` input is read, or the graph calls a module)."""
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(graph.graph, {}))
    holders = [n for n in copy.nodes if n.op == "placeholder"]
    if len(holders) != len(inputs) or any(n.op == "call_module" for n in copy.nodes):
        return None
    for node, value in zip(holders, inputs, strict=True):
        if value is None:
            if node.users:
                return None
            copy.erase_node(node)
    for node in copy.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = node.target.overloadpacket
    return copy


def _source(src: str, names: list[str]) -> str:
    """The graph's Python code as a TorchScript function: its module's tensors read from a list
    argument, and without the statements that free each value after its last use (TorchScript's
    interpreter frees a value at its last use itself; its parser takes no ``;``)."""
    index = {name: i for i, name in enumerate(names)}
    src = re.sub(r"self\.([\w.]+)", lambda m: f"constants[{index[m.group(1)]}]", src)
    src = src.replace("def forward(self, ", "def forward(constants: List[Tensor], ", 1)
    return re.sub(r";\s+[\w\s=]+= None$", "", src, flags=re.M)


@contextlib.contextmanager
def run_unoptimised() -> Iterator[None]:
    """TorchScript's graph optimisations off in this thread while inside (a no-op where torch
    has no TorchScript)."""
    off = getattr(getattr(torch, "jit", None), "optimized_execution", None)
    with off(False) if off is not None else contextlib.nullcontext():
        yield
