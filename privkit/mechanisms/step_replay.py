"""A DP-SGD step's clipped sum traced once per batch size and replayed: the host's work of a step
cut to the operations themselves.

On a GPU a DP-SGD step of a small or medium model waits on its host: Python, module hooks and
torch's dispatch of a few hundred operations (ResNet-18's seeded step took 39.7 ms on an H200
whose kernels ran 24.8 ms of it). :class:`StepReplay` records the clipped sum
(:func:`privkit.mechanisms.dp_sgd_step.clipped_gradient_sum`: the forward pass with its hooks,
the backward pass, the per-example norms and the clipped sum) as the ATen operations it ran
(``torch.fx.experimental.proxy_tensor.make_fx``, real tensors) and replays them on later batches
of the same size: the hooks, the layer analysis and the module calls run once per size. A trace
is replayed by TorchScript's interpreter where it can be scripted
(:mod:`privkit.mechanisms.scripted_trace`: the same operations without a Python call each), else
as the trace's Python code. The noise, the receipt, the canaries and the optimiser step stay as
they are (the release primitive is not replayed).

Poisson batches change size at nearly every step, so each batch is padded to one of a few sizes
(:func:`padded_size`: by default at most 12.5% more rows, eight sizes an octave), its extra
rows copies of its first ones with loss weight 0: their gradient is 0 and adds exactly nothing
(``clipped_gradient_sum(weights=...)``), and the real rows' values are the unpadded batch's.
jax_privacy pads its batches likewise, to a multiple of a size with padding examples whose
gradients are zeroed (``batch_selection.pad_to_multiple_of``), so that a compiled step serves
them.

What a replay assumes, and what is checked:

* **the model computes the same operations at every step of a size**: Python control flow that
  depends on anything but the inputs' shapes is fixed at the trace (as for CUDA graphs and
  ``torch.compile``). A trace is taken again where the model's parameters or buffers (identity,
  storage, shape, dtype, ``requires_grad``), any module's ``training`` flag, the inputs' shapes
  and dtypes, the loss function (its code and what it closes over), the clip norm or autocast
  change.
* **no value of the batch leaves the trace as a Python number**: a model or loss that reads one
  (``.item()``, ``bool()``, ``.tolist()``, ``.numpy()``) would carry the traced batch's values
  into every later step as a constant, a dependence on those records no clipping bounds. Such a
  trace is refused (``make_fx`` refuses the scalar reads; the others are refused while tracing)
  and the size runs unreplayed, with a :class:`ReplayRefusedWarning` naming the reason. (While
  a recording runs, those three reads are refused in the whole process: another thread that
  makes one then fails.)
* **the replay computes what the step computes**: the first replay of each trace is checked
  against the unreplayed step on the same batch (the random state forked, so dropout draws
  alike), within float rounding, both as scripted and as Python; a scripted trace that differs
  runs as Python from then on, and a mismatch of both refuses the trace.

Because the clipping is part of what is replayed, every record's contribution to the replayed
sum is clipped to ``clip_norm`` whatever the model computes: the privacy of a step does not rest
on the assumptions above, only its fidelity to the model's code. The replay runs with autocast
off (its casts are recorded in the trace) and float32 products at float32's precision
(:func:`privkit.mechanisms.clip_precision.full_precision`): the norms' arithmetic as the
unreplayed step's.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from privkit.errors import PrivkitError
from privkit.mechanisms.ghost_parameters import RandomState
from privkit.mechanisms.scripted_trace import ScriptedTrace, run_unoptimised, scripted

__all__ = ["ReplayRefusedWarning", "StepReplay", "padded_size"]


#: non-empty once a trace was taken in this process (the first pays one-time costs: torch's
#: tracer and TorchScript warming up, 1-1.5 s against 0.2-0.5 s for a later one on this CPU)
_TRACED_IN_PROCESS: list[bool] = []


class ReplayRefusedWarning(UserWarning):
    """A batch size of a DP-SGD step runs unreplayed: its trace was refused (the reason is
    named). The step is computed as without :class:`StepReplay`."""


class _DataRead(RuntimeError):
    """A tensor's values read into Python while the clipped sum was being traced."""


def padded_size(b: int, per_octave: int = 8) -> int:
    """The size a batch of ``b`` records is padded to: ``b`` rounded up to a multiple of
    ``2 ** floor(log2 b) / per_octave`` (``b`` itself below ``2 per_octave``): fewer than
    ``b / per_octave`` rows more, and ``per_octave`` sizes an octave (the default: at most 12.5%
    more rows; a Poisson batch of 64 expected records takes six to eight sizes).

    Parameters
    ----------
    b : int
        The batch's records.
    per_octave : int
        Sizes from one power of two to the next (a power of two).
    """
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise PrivkitError(f"per_octave must be a power of two; found {per_octave}")
    if b < 2 * per_octave:
        return b
    step = 1 << (b.bit_length() - per_octave.bit_length())
    return -(-b // step) * step


@dataclass
class _Trace:
    graph: torch.fx.GraphModule
    names: list[str]  # the trainable parameters' names, in the graph's output order
    scripted: ScriptedTrace | None = None  # the graph run by TorchScript's interpreter
    checked: bool = False  # its first replay compared with the step itself

    def runners(self) -> list[Callable]:
        """How the trace can run, the fastest first."""
        return [r for r in (self.scripted, self.graph) if r is not None]


class StepReplay:
    """Replays a DP-SGD step's clipped sum by batch size (module docstring). Pass one to
    :meth:`privkit.mechanisms.dp_sgd_step.DpSgdStep.apply` (``replay=``) at every step of a
    training; it keeps its traces for the model it is used with.

    Parameters
    ----------
    pad : bool
        Pad each batch to :func:`padded_size` (a trace per padded size) rather than trace every
        size a Poisson batch takes.
    sizes_per_octave : int
        :func:`padded_size`'s ``per_octave``: fewer sizes (fewer recordings) for more padded
        rows (a power of two; 8: at most 12.5% more rows).
    max_traces : int
        Traces kept (the least recently used dropped beyond).
    script : bool
        Run each trace by TorchScript's interpreter where it can be scripted
        (:mod:`privkit.mechanisms.scripted_trace`: the same operations, without a Python call
        each), else as the trace's Python code.
    patience : float
        When a batch size is traced: once its unreplayed steps have cost ``patience`` times what
        a trace costs, beyond what their replays would have (both measured as the training
        runs; the first size is traced at its second step, before any trace has been timed).
        1 is the rule of renting skis until the rent paid equals the price: a size's steps then
        cost at most about twice what they would with foresight of how often it comes, and a
        rare size of a Poisson batch's tail is not traced at all. 0: every size at its second
        step.

    Attributes
    ----------
    traced, replayed, unreplayed : int
        Steps that took a trace, replayed one, ran unreplayed (a size's first step, a trace's
        checked first replay, a refused trace, an empty batch).
    scripted : int
        Traces run by TorchScript's interpreter (of ``traced``).
    refused : dict of str to str
        Why a trace was refused, by the batch shape it was refused for.
    """

    def __init__(
        self,
        pad: bool = True,
        sizes_per_octave: int = 8,
        max_traces: int = 16,
        script: bool = True,
        patience: float = 1.0,
    ) -> None:
        if max_traces < 1:
            raise PrivkitError(f"max_traces must be >= 1; found {max_traces}")
        if not patience >= 0:
            raise PrivkitError(f"patience must be >= 0; found {patience}")
        padded_size(1, sizes_per_octave)  # a bad value refused here, not at the first step
        self.pad, self.sizes_per_octave, self.max_traces = pad, sizes_per_octave, max_traces
        self.script, self.patience = script, float(patience)
        self.traced = self.replayed = self.unreplayed = self.scripted = 0
        # seconds and steps: of unreplayed and of replayed steps, and the latest trace's seconds
        self._eager, self._replays = [0.0, 0], [0.0, 0]
        self._trace_seconds = 0.0
        self.refused: dict[str, str] = {}
        self._traces: OrderedDict[Hashable, _Trace] = OrderedDict()
        # the sizes whose first step ran, and those refused: by their keys' hashes and weak
        # identities (_Identity), not the keys themselves, which hold what the loss closes over:
        # a loss over a new tensor at every step would keep a batch's worth of them alive
        self._seen: OrderedDict[int, _Identity] = OrderedDict()
        self._refused_keys: dict[int, _Identity] = {}

    def __repr__(self) -> str:
        return (
            f"StepReplay(pad={self.pad}, sizes_per_octave={self.sizes_per_octave}, "
            f"max_traces={self.max_traces}, script={self.script}, traced={self.traced}, "
            f"scripted={self.scripted}, replayed={self.replayed}, unreplayed={self.unreplayed}, "
            f"refused={self.refused})"
        )

    def clipped_sum(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        loss_fn: Callable,
        clip_norm: float,
        aux: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """:func:`~privkit.mechanisms.dp_sgd_step.clipped_gradient_sum` of the batch, replayed
        where a trace of its padded size is at hand (the same values up to float rounding).

        Parameters
        ----------
        model : torch.nn.Module
            The model; the sum is over its trainable parameters (``requires_grad``).
        x : torch.Tensor
            The batch's inputs, one record per row.
        y : torch.Tensor
            The batch's targets.
        loss_fn : PerSampleLoss
            ``loss_fn(logits (1, C), target (1,), aux (1, ...) or None)``: one record's loss. A
            trace is kept for its code and what it closes over (a lambda written in the loop
            finds its trace at every step; one that closes over a new tensor each step does not).
        clip_norm : float
            The L2 clipping norm of each record's gradient (``inf``: no clipping).
        aux : torch.Tensor, optional
            A per-record tensor passed to ``loss_fn``.

        Returns
        -------
        dict of str to torch.Tensor
            The clipped sum of each trainable parameter, by name.
        """
        from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum

        if x.shape[0] == 0:
            self.unreplayed += 1
            return clipped_gradient_sum(model, x, y, loss_fn, clip_norm, aux)
        b = x.shape[0]
        size = padded_size(b, self.sizes_per_octave) if self.pad else b
        batch = _padded(x, y, aux, size)
        key = _key(model, batch, loss_fn, clip_norm)
        trace = self._traces.get(key)
        # the trainable parameters' names: a trace's own (its key fixes them), else read
        names = (
            trace.names
            if trace is not None
            else [k for k, p in model.named_parameters() if p.requires_grad]
        )

        def step(xp, yp, ap, w) -> list[torch.Tensor]:
            total = clipped_gradient_sum(model, xp, yp, loss_fn, clip_norm, ap, w)
            return [total[k] for k in names]

        start = time.perf_counter()
        if trace is not None:
            self._traces.move_to_end(key)
            outs = self._replay(trace, key, batch, step, clip_norm)
        elif _Identity.among(self._refused_keys, key):
            self.unreplayed += 1
            outs = step(*batch)
        elif _Identity.among(self._seen, key) and self._due(self._seen[hash(key)]):
            outs = self._trace(key, batch, step, names)
            if _TRACED_IN_PROCESS:  # the first trace in a process pays torch's one-time costs
                self._trace_seconds = time.perf_counter() - start
            else:
                _TRACED_IN_PROCESS.append(True)
        else:
            # a size's first step runs as it is: a model's first-step checks (its rows, its
            # layers' layouts) are made there, not recorded in the trace
            seen = self._remember(key)
            self.unreplayed += 1
            outs = step(*batch)
            seen.paid += self._saving(time.perf_counter() - start)
        return dict(zip(names, outs, strict=True))

    def _remember(self, key: Hashable) -> _Identity:
        """The size's record among those seen (a new one where the key is new)."""
        kept = self._seen.get(hash(key))
        if kept is None or not kept.same(key):
            kept = self._seen[hash(key)] = _Identity(key)
        self._seen.move_to_end(hash(key))
        while len(self._seen) > 4 * self.max_traces:
            self._seen.popitem(last=False)
        return kept

    def _saving(self, seconds: float) -> float:
        """What an unreplayed step of ``seconds`` would have saved replayed (the replayed steps'
        mean time over the unreplayed ones'; all of it before any step was replayed)."""
        self._eager[0] += seconds
        self._eager[1] += 1
        if not self._replays[1]:
            return seconds
        ratio = (self._replays[0] / self._replays[1]) / (self._eager[0] / self._eager[1])
        return seconds * max(0.0, 1.0 - ratio)

    def _due(self, seen: _Identity) -> bool:
        """Whether a size seen before is traced now (``patience``)."""
        return seen.paid >= self.patience * self._trace_seconds

    def _trace(
        self, key: Hashable, batch: tuple, step: Callable, names: list[str]
    ) -> list[torch.Tensor]:
        """This step computed while recording its operations (real tensors: the recorded step's
        values are this step's result)."""
        from torch.fx.experimental.proxy_tensor import make_fx

        box: list[list[torch.Tensor]] = []

        def recorded(*batch):
            box.append(step(*batch))
            return box[-1]

        state = RandomState(batch[0].device)
        try:
            with _no_data_reads(), _without_value_metadata():
                graph = make_fx(recorded, tracing_mode="real")(*batch)
        except Exception as why:  # whatever stops the trace: this size runs unreplayed
            # (the random state as the trace found it; what the half-run pass did to the model's
            # buffers, a running statistic, stays: DP-SGD's models keep none per batch)
            state.restore()
            self._refuse(key, batch[0], f"{type(why).__name__}: {why}")
            self.unreplayed += 1
            return step(*batch)
        trace = _Trace(graph, names, scripted(graph, batch) if self.script else None)
        self._traces[key] = trace
        while len(self._traces) > self.max_traces:
            self._traces.popitem(last=False)
        self.traced += 1
        self.scripted += trace.scripted is not None
        return box[-1]

    def _replay(
        self, trace: _Trace, key: Hashable, batch: tuple, step: Callable, clip_norm: float
    ) -> list[torch.Tensor]:
        """The trace run on ``batch``; its first run checked against the step itself (the
        scripted trace and the graph both: the first that computes what the step computes is
        kept)."""
        from privkit.mechanisms.clip_precision import full_precision

        device = batch[0].device

        def run(runner: Callable) -> list[torch.Tensor]:
            with torch.no_grad(), full_precision(device), run_unoptimised():
                return list(runner(*batch))

        if trace.checked:
            self.replayed += 1
            start = time.perf_counter()
            outs = run(trace.scripted or trace.graph)  # the fastest it has
            self._replays[0] += time.perf_counter() - start
            self._replays[1] += 1
            return outs
        runs: list[list[torch.Tensor] | None] = []
        for runner in trace.runners():
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                try:  # the random state as the step finds it: dropout alike
                    runs.append(run(runner))
                except Exception:  # a trace that records but does not run (torch.func's
                    runs.append(None)  # vmap of an LSTM): as one that differs
        outs = step(*batch)
        trace.checked = True
        unit = clip_norm if math.isfinite(clip_norm) else 1.0
        alike = [
            r is not None and all(_close(a, b, unit) for a, b in zip(r, outs, strict=True))
            for r in runs
        ]
        if trace.scripted is not None and not alike[0]:
            trace.scripted, alike = None, alike[1:]
            self.scripted -= 1
        if not alike[0]:
            del self._traces[key]
            self._refuse(key, batch[0], "its replay differed from the step on the same batch")
        self.unreplayed += 1
        return outs

    def _refuse(self, key: Hashable, x: torch.Tensor, reason: str) -> None:
        self._refused_keys[hash(key)] = _Identity(key)
        shape = f"batch of {x.shape[0]} x {tuple(x.shape[1:])}"
        self.refused[shape] = reason[:300]
        warnings.warn(
            f"DP-SGD step not replayed for a {shape} ({reason[:200]}); computed as without "
            "StepReplay",
            ReplayRefusedWarning,
            stacklevel=5,
        )


class _Identity:
    """A key without holding it: its leaves, each object among them by a weak reference (a
    tensor, a function, a model) and each plain value (a number, a shape, a dtype, code) as it
    is. Another key is the same only where its objects are the very ones, still alive: an
    object's identity reused after it was freed matches nothing."""

    def __init__(self, key: Hashable) -> None:
        self.leaves = tuple(_weak(leaf) for leaf in _leaves(key))
        self.paid = 0.0  # seconds its unreplayed steps would have saved replayed (patience)

    def same(self, key: Hashable) -> bool:
        leaves = tuple(_leaves(key))
        return len(leaves) == len(self.leaves) and all(
            kept() is leaf if isinstance(kept, weakref.ref) else kept == leaf
            for kept, leaf in zip(self.leaves, leaves, strict=True)
        )

    @staticmethod
    def among(kept: dict, key: Hashable) -> bool:
        """Whether ``key`` is one of ``kept``'s (a dict of hashes to identities)."""
        identity = kept.get(hash(key))
        return identity is not None and identity.same(key)


def _leaves(key) -> Iterator:
    for item in key:
        if isinstance(item, tuple):
            yield from _leaves(item)
        else:
            yield item


def _weak(leaf):
    try:
        return weakref.ref(leaf)
    except TypeError:  # a number, a dtype, code: kept as it is
        return leaf


def _padded(x, y, aux, size: int):
    """The batch padded to ``size`` rows by copies of its first rows, and the rows' weights
    (1 for the batch's, 0 for the copies)."""
    b = x.shape[0]
    w = torch.ones(size, dtype=torch.float32, device=x.device)
    if size == b:
        return x, y, aux, w
    w[b:] = 0.0
    rows = torch.arange(size, device=x.device) % b

    def pad(t):
        return None if t is None else torch.cat([t, t.index_select(0, rows[b:])])

    return pad(x), pad(y), pad(aux), w


def _key(model: nn.Module, batch: tuple, loss_fn: Callable, clip_norm: float) -> tuple:
    """What a trace is valid for (module docstring)."""
    from privkit.mechanisms.clip_precision import autocast_on

    state: list = []
    for m in model.modules():
        state.append(m.training)
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                state.append((id(t), _storage(t), t.shape, t.dtype, t.requires_grad))
    device = batch[0].device
    shapes = tuple(None if t is None else (t.shape, t.dtype, t.device) for t in batch)
    cast = torch.get_autocast_dtype(device.type) if autocast_on(device) else None
    loss = _loss_key(loss_fn)
    return (id(model), tuple(state), shapes, cast, loss, clip_norm, torch.is_grad_enabled())


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s values live (a tensor given new storage, ``p.data = ...``, is traced anew);
    ``None`` for a tensor without one (a subclass, a sparse tensor): its identity alone."""
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


def _loss_key(loss_fn: Callable) -> Hashable:
    """What a trace keeps of the loss function: its code, what it closes over, its defaults and
    the object a bound method is bound to (held, so that no identity is reused), so that a lambda
    written inside the training loop, a new object at every step, finds its trace; the function
    itself where those are not hashable."""
    code = getattr(loss_fn, "__code__", None)
    if code is None:
        return loss_fn
    try:
        cells = tuple(c.cell_contents for c in loss_fn.__closure__ or ())
        key = (
            code,
            cells,
            loss_fn.__defaults__,
            tuple(sorted((loss_fn.__kwdefaults__ or {}).items())),
            getattr(loss_fn, "__self__", None),
        )
        hash(key)
    except (TypeError, ValueError):  # an unhashable capture, an empty cell
        return loss_fn
    return key


def _close(a: torch.Tensor, b: torch.Tensor, unit: float) -> bool:
    """Equal up to float rounding: within 1e-4 of the larger's magnitude, or 1e-6 clip norms
    (a GPU's atomic additions need not repeat their order)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.numel():
        return True
    a, b = a.double(), b.double()
    if not torch.equal(a.isfinite(), b.isfinite()):
        return False
    tol = max(1e-4 * float(b.abs().max()), 1e-6 * unit)
    return bool(((a - b).abs() <= tol).all())


@contextlib.contextmanager
def _no_data_reads() -> Iterator[None]:
    """``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.__array__`` refused while inside: a trace
    would keep the values they read as constants (``make_fx`` itself refuses ``.item()`` and
    ``bool()`` of a traced tensor)."""
    kept = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "__array__")}

    def refused(name: str):
        def read(self, *args, **kwargs):
            raise _DataRead(f"Tensor.{name}() read a tensor's values into Python")

        return read

    try:
        for name in kept:
            setattr(torch.Tensor, name, refused(name))
        yield
    finally:
        for name, method in kept.items():
            setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def _without_value_metadata() -> Iterator[None]:
    """``make_fx`` without its metadata of each real tensor value while inside. In real mode it
    records, for every operation's output, a fake tensor made in a fake-tensor mode of its own
    (whose construction extracts a stack trace): 60-75% of a trace's time here, and nothing a
    replay reads. Where torch's tracer no longer has that function, the trace keeps it."""
    from torch.fx.experimental import proxy_tensor

    kept = getattr(proxy_tensor, "extract_val", None)
    if kept is None:
        yield
        return

    def extract_val(val, include_real: bool = False):
        if isinstance(val, torch.Tensor) and not proxy_tensor.is_fake(val):
            return None
        return kept(val, include_real)

    proxy_tensor.extract_val = extract_val
    try:
        yield
    finally:
        proxy_tensor.extract_val = kept
