"""A replay's trace run by TorchScript's interpreter (``privkit.mechanisms.scripted_trace``).

Pinned against the trace run as its Python code (the reference): the scripted trace computes the
same floats bit for bit on every model of ``benchmarks/dpsgd_step.py`` and at every run (beyond
the runs after which TorchScript's profiling executor would rewrite a graph), sees an optimiser's
in-place updates of the parameters, leaves out the ``None`` inputs; where TorchScript cannot
script a trace, or torch has no TorchScript, the trace runs as Python; a scripted trace that
differs from the step at its check runs as Python from then on.
"""

import warnings

import pytest
import torch

from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum
from privkit.mechanisms.scripted_trace import run_unoptimised, scripted
from privkit.mechanisms.step_replay import ReplayRefusedWarning, StepReplay
from tests.privkit.test_step_replay import CLIP, MODELS, _max_diff, _model, _per_example_loss


def _traced(model, x, y, **kwargs) -> StepReplay:
    """A replay that has taken its trace of the batch (a size's first step, then the recording)."""
    replay = StepReplay(pad=False, patience=0, **kwargs)
    for _ in range(2):
        replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    assert replay.traced == 1
    return replay


def _runs(runner, batch) -> list[torch.Tensor]:
    with torch.no_grad(), run_unoptimised():
        return list(runner(*batch))


@pytest.mark.parametrize("name", MODELS)
def test_a_scripted_trace_computes_the_traces_floats(name):
    model, x, y = _model(name)
    (trace,) = _traced(model, x, y)._traces.values()
    assert trace.scripted is not None
    g = torch.Generator().manual_seed(1)
    other = x[torch.randperm(x.shape[0], generator=g)]  # another batch of the size
    batch = (other, y, None, torch.ones(x.shape[0]))
    want = _runs(trace.graph, batch)
    for _ in range(6):  # past TorchScript's profiling runs: every run the same operations
        got = _runs(trace.scripted, batch)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with torch.no_grad():  # an optimiser's step in place: the script reads the same tensors
        for p in model.parameters():
            p.mul_(0.9)
    after = _runs(trace.scripted, batch)
    assert all(torch.equal(a, b) for a, b in zip(after, _runs(trace.graph, batch), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(after, want, strict=True))


def test_the_replay_runs_the_scripted_trace():
    model, x, y = _model("lstm", 16)
    replay = _traced(model, x, y)
    (trace,) = replay._traces.values()
    calls = []
    function = trace.scripted.function
    trace.scripted.function = lambda *a: calls.append(1) or function(*a)
    for _ in range(3):
        got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
        assert _max_diff(got, clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)) == 0
    assert len(calls) == 3 and replay.replayed == 2 and replay.scripted == 1


def test_without_torchscript_the_trace_runs_as_python(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise RuntimeError("cannot script this")

    monkeypatch.setattr(torch.jit, "CompilationUnit", refuse)
    model, x, y = _model("transformer", 16)
    replay = _traced(model, x, y)
    monkeypatch.delattr(torch.jit, "CompilationUnit")  # a torch without TorchScript at all
    replay.clipped_sum(model, x[:12], y[:12], _per_example_loss, CLIP)
    replay.clipped_sum(model, x[:12], y[:12], _per_example_loss, CLIP)
    assert replay.traced == 2 and replay.scripted == 0
    assert all(t.scripted is None for t in replay._traces.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayRefusedWarning)
        for n in (16, 12, 16, 12):
            got = replay.clipped_sum(model, x[:n], y[:n], _per_example_loss, CLIP)
            want = clipped_gradient_sum(model, x[:n], y[:n], _per_example_loss, CLIP)
            assert _max_diff(got, want) == 0
    assert replay.replayed == 2  # the first of each size was its checked replay


def test_a_script_asked_for_none_is_not_made():
    model, x, y = _model("lstm", 16)
    replay = _traced(model, x, y, script=False)
    assert replay.scripted == 0 and next(iter(replay._traces.values())).scripted is None


def test_a_scripted_trace_that_differs_runs_as_python():
    model, x, y = _model("lstm", 16)
    replay = _traced(model, x, y)
    (trace,) = replay._traces.values()
    function = trace.scripted.function
    trace.scripted.function = lambda *a: [t * 1.001 for t in function(*a)]  # a script gone wrong
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayRefusedWarning)
        for _ in range(3):
            got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
            assert _max_diff(got, clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)) == 0
    assert trace.scripted is None and replay.scripted == 0
    assert replay.replayed == 2 and replay._traces  # replayed as Python


def test_none_inputs_are_left_out_and_a_read_one_is_not_scripted():
    def f(a, b, c):
        return [a * 2 + c]

    from torch.fx.experimental.proxy_tensor import make_fx

    a, c = torch.randn(3), torch.randn(3)
    graph = make_fx(f)(a, None, c)
    script = scripted(graph, (a, None, c))
    assert script is not None and script.kept == [0, 2]
    assert torch.equal(script(a, None, c)[0], a * 2 + c)
    assert scripted(graph, (a, c)) is None  # inputs that are not the trace's placeholders


def test_run_unoptimised_turns_torchscripts_optimisations_off_for_its_block():
    assert torch._C._get_graph_executor_optimize()
    with run_unoptimised():
        assert not torch._C._get_graph_executor_optimize()
    assert torch._C._get_graph_executor_optimize()


def test_a_trace_that_names_a_cuda_device_is_scripted():
    """On a GPU a trace's creations name the device (``device(type='cuda', index=0)`` in its
    code): TorchScript compiles them, so a GPU's replay runs scripted too (compiled here, not
    run: no GPU in CI)."""
    model, x, y = _model("transformer", 16)
    (trace,) = _traced(model, x, y)._traces.values()
    named = 0
    for node in trace.graph.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
            named += 1
    trace.graph.recompile()
    assert named and "device(type='cuda', index=0)" in trace.graph.code
    assert scripted(trace.graph, (x, y, None, torch.ones(x.shape[0]))) is not None
