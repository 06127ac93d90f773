"""A DP-SGD step's clipped sum traced by batch size and replayed (``privkit.mechanisms.step_replay``).

What is pinned here, against the step computed without a replay (the reference: book-keeping
ghost clipping, privkit's stacked layers, ``torch.func``):

* the replayed sums equal the step's on Poisson-sized batches of every model of
  ``benchmarks/dpsgd_step.py`` (padded to a few sizes), and a whole seeded training with
  ``DpSgdStep.apply(replay=...)`` ends at the same parameters, bit for bit on the CPU;
* a padded row (loss weight 0) adds exactly nothing, on all three clipping paths;
* one record moves the replayed sum by at most the clip norm (the sensitivity the noise is
  calibrated to), under autocast too;
* a model or loss that reads its batch's values into Python (``.item()``, ``.tolist()``,
  ``.numpy()``) is not replayed (a warning names it) and its steps stay the step's;
* a change of the model (a parameter frozen or replaced, ``eval()``) is traced anew;
* dropout draws as the step does (the first replay's check forks the random state);
* a replay that differs from the step is caught by that check and dropped;
* a model only ``torch.func`` clips is replayed too, and white-box canaries observe a replayed
  step's releases as the step's.
"""

import gc
import importlib.util
import math
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.errors import PrivkitError
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.dp_sgd_step import DpSgdStep, clipped_gradient_sum
from privkit.mechanisms.step_replay import ReplayRefusedWarning, StepReplay, padded_size
from privkit.models import build_model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from dpsgd_step import _host_bound, _per_example_loss, batch, build  # noqa: E402

MODELS = ["resnet_small", "transformer", "encoder", "vit", "lm", "lstm", "gpt2"]
CLIP = 1.0


def _model(name: str, records: int = 24):
    if name == "gpt2" and importlib.util.find_spec("transformers") is None:
        pytest.skip("HF transformers is not installed")
    torch.manual_seed(0)
    model, _, _ = build(name)
    x, y = batch(name, records, torch.device("cpu"))
    return (model, *_host_bound(name, x, y))  # images cropped to 8x8, sequences to 8 tokens


def _poisson_batches(x, y, steps: int, seed: int = 0):
    """``steps`` batches of the records, each record in with probability 3/4."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        keep = torch.rand(x.shape[0], generator=g) < 0.75
        yield x[keep], y[keep]


def _training(name: str, records: int, seed: int):
    """A seeded DP-SGD training's parts: the model and its records, its optimiser, its step (every
    record in with probability 3/4) and its noise."""
    model, x, y = _model(name, records)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = DpSgdStep(CLIP, 1.0, 0.75, records)
    return (
        model,
        x,
        y,
        opt,
        step,
        DpRandom(torch.Generator().manual_seed(seed), torch.device("cpu")),
    )


def _max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).detach().abs().max()) for k in a)


@pytest.mark.parametrize("per_octave", [1, 2, 4, 8, 16])
def test_padded_size_pads_little_and_takes_few_sizes(per_octave):
    sizes = [padded_size(b, per_octave) for b in range(1, 5000)]
    assert all(b <= s < b * (1 + 1 / per_octave) for b, s in zip(range(1, 5000), sizes))
    assert sizes[: 2 * per_octave - 1] == list(range(1, 2 * per_octave))
    for octave in range(5, 12):  # per_octave sizes from 2^k up to 2^(k+1) (the next one's first)
        got = {padded_size(b, per_octave) for b in range(2**octave, 2 ** (octave + 1))}
        assert len(got - {2 ** (octave + 1)}) == per_octave
    assert padded_size(padded_size(777, per_octave), per_octave) == padded_size(777, per_octave)


@pytest.mark.parametrize("bad", [0, 3, 12])
def test_sizes_per_octave_must_be_a_power_of_two(bad):
    with pytest.raises(PrivkitError, match=f"per_octave must be a power of two; found {bad}"):
        StepReplay(sizes_per_octave=bad)


@pytest.mark.parametrize("name", MODELS)
def test_replayed_sums_equal_the_steps(name):
    model, x, y = _model(name)
    replay = StepReplay(patience=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayRefusedWarning)
        for xb, yb in _poisson_batches(x, y, 14):
            got = replay.clipped_sum(model, xb, yb, _per_example_loss, CLIP)
            want = clipped_gradient_sum(model, xb, yb, _per_example_loss, CLIP)
            assert _max_diff(got, want) <= 1e-6 * CLIP
    assert replay.traced >= 1 and replay.replayed >= 4 and not replay.refused


class _SignBag(nn.Module):
    """An EmbeddingBag (``max`` mode) of each feature's sign as a token (torch.func on the bag
    alone)."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(40, 8, mode="max")
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        tokens = (x > 0).long() + 2 * torch.arange(x.shape[1], device=x.device)
        return self.head(self.bag(tokens))


class _Reused(nn.Module):
    """A weight the model's own code reads twice, which ghost clipping does not cover: torch.func
    clips the model."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 20) * 0.3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.w.T * self.w.sum()))


@pytest.mark.parametrize("path", ["ghost", "stacked", "layer-vjp", "torch.func"])
def test_a_padded_row_adds_nothing(path):
    torch.manual_seed(1)
    if path == "stacked":  # privkit's own MLP: its stacked layers
        model = build_model("mlp", (1, 4, 5), 4)
    elif path == "ghost":
        model = nn.Sequential(nn.Linear(20, 16), nn.GroupNorm(4, 16), nn.ReLU(), nn.Linear(16, 4))
    elif path == "layer-vjp":  # an EmbeddingBag's by torch.func on it alone
        from privkit.mechanisms import ghost_clipping

        model = _SignBag()
        assert [layer.vjp for layer in ghost_clipping._layers(model)] == [True, False]
    else:  # a layer ghost clipping does not cover: torch.func's per-example gradients
        model = _Reused()
    x, y = torch.randn(9, 20), torch.randint(0, 4, (9,))
    if path == "stacked":
        x = x.view(9, 1, 4, 5)
    rows = torch.tensor([0, 1, 2])
    xp, yp = torch.cat([x, x[rows]]), torch.cat([y, y[rows]])
    w = torch.cat([torch.ones(9), torch.zeros(3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's fallback warning
        plain = clipped_gradient_sum(model, x, y, _per_example_loss, 0.05)
        padded = clipped_gradient_sum(model, xp, yp, _per_example_loss, 0.05, weights=w)
        both = clipped_gradient_sum(model, xp, yp, _per_example_loss, 0.05)
    assert _max_diff(plain, padded) <= 1e-7
    assert _max_diff(plain, both) > 1e-3  # the rows do count at weight 1: the test can fail


@pytest.mark.parametrize("autocast", [False, True])
def test_one_record_moves_the_replayed_sum_by_at_most_the_clip_norm(autocast):
    model, x, y = _model("resnet_small", 20)
    clip = 0.01  # every record clipped
    replay = StepReplay(patience=0)
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with cast:
        for _ in range(3):  # first step unreplayed, second traced, third checked
            replay.clipped_sum(model, x[:18], y[:18], _per_example_loss, clip)
            replay.clipped_sum(model, x[:17], y[:17], _per_example_loss, clip)
        with_i = replay.clipped_sum(model, x[:18], y[:18], _per_example_loss, clip)
        without = replay.clipped_sum(model, x[:17], y[:17], _per_example_loss, clip)
    assert replay.replayed >= 2 and not replay.refused
    d = math.sqrt(sum(float((with_i[k] - without[k]).pow(2).sum()) for k in with_i))
    assert clip * 0.9 < d <= clip * (1 + 1e-5)


@pytest.mark.parametrize("pad", [False, True])
def test_a_seeded_training_ends_where_the_unreplayed_one_does(pad):
    results = []
    for replay in (None, StepReplay(pad=pad, patience=0)):
        model, x, y, opt, step, noise = _training("transformer", 32, seed=5)
        for xb, yb in _poisson_batches(x, y, 30, seed=2):
            step.apply(model, opt, xb, yb, _per_example_loss, noise, replay=replay)
        results.append({k: p.detach().clone() for k, p in model.named_parameters()})
        if replay is not None:
            assert replay.replayed >= 6
    # unpadded: the same operations on the same shapes, bit for bit on the CPU; padded: the
    # batch's sums over more rows (zeros), which may round otherwise
    assert _max_diff(*results) <= (1e-6 if pad else 0.0)


class _Reads(nn.Module):
    """A model that reads its batch's values into Python: a trace would keep them."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.fc = how, nn.Linear(6, 3)

    def forward(self, x):
        if self.how == "item":
            scale = x.abs().max().item()
        elif self.how == "tolist":
            scale = max(x.abs().reshape(-1).tolist())
        else:
            scale = float(x.detach().abs().numpy().max())
        return self.fc(x / scale)


@pytest.mark.parametrize("how", ["item", "tolist", "numpy"])
def test_a_model_that_reads_its_batch_is_not_replayed(how):
    torch.manual_seed(2)
    model, replay = _Reads(how), StepReplay(patience=0)
    with pytest.warns(ReplayRefusedWarning, match="not replayed"):
        for i in range(6):
            x, y = torch.randn(5, 6) * (1 + i), torch.randint(0, 3, (5,))
            got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
            assert _max_diff(got, clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)) == 0
    assert replay.replayed == 0 and len(replay.refused) == 1
    # refused at the trace, before any replay could carry a value on
    (reason,) = replay.refused.values()
    assert ("_local_scalar_dense" if how == "item" else f"Tensor.{how}() read") in reason
    assert torch.ones(2).tolist() == [1.0, 1.0]  # the reads are given back after the trace


def test_a_changed_model_is_traced_anew():
    model, x, y = _model("resnet_small", 16)
    replay = StepReplay(patience=0)

    def check() -> None:
        for _ in range(3):
            got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
            want = clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)
            assert _max_diff(got, want) <= 1e-6

    check()
    first = replay.traced
    model.fc.weight.requires_grad_(False)  # frozen: no longer in the sum
    check()
    assert "fc.weight" not in replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    model.fc.weight = nn.Parameter(torch.randn_like(model.fc.weight))  # replaced
    check()
    model.fc.bias.data = model.fc.bias.data + 1.0  # the same parameter, new storage
    check()
    model.eval()
    check()
    assert replay.traced == first + 4


def test_dropout_draws_as_the_step_does():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))
    x, y = torch.randn(20, 8), torch.randint(0, 3, (20,))
    replay = StepReplay(patience=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayRefusedWarning)
        for seed in range(5):
            torch.manual_seed(seed)
            got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
            torch.manual_seed(seed)
            want = clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)
            assert _max_diff(got, want) <= 1e-6
    assert replay.replayed >= 2
    torch.manual_seed(0)
    a = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    b = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    assert _max_diff(a, b) > 1e-3  # fresh masks at every replay


def test_a_replay_that_differs_from_the_step_is_dropped(monkeypatch):
    model, x, y = _model("lstm", 16)
    replay = StepReplay(patience=0)
    replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    replay.clipped_sum(model, x, y, _per_example_loss, CLIP)  # traced
    (trace,) = replay._traces.values()
    assert trace.scripted is not None
    graph = trace.graph
    trace.graph = lambda *batch: [t * 1.001 for t in graph(*batch)]  # a replay gone wrong
    trace.scripted = None  # (the scripted form's own check: test_scripted_trace.py)
    with pytest.warns(ReplayRefusedWarning, match="differed"):
        got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    assert _max_diff(got, clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)) == 0
    for _ in range(2):
        replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    assert replay.replayed == 0 and not replay._traces


def test_an_empty_batch_and_the_trace_limit():
    with pytest.raises(PrivkitError, match="max_traces must be >= 1; found 0"):
        StepReplay(max_traces=0)
    model, x, y = _model("transformer", 30)
    replay = StepReplay(max_traces=2, patience=0)
    step = DpSgdStep(CLIP, 0.0, 0.5, 30)  # no noise: an empty batch's mean gradient is 0
    noise = DpRandom(torch.Generator().manual_seed(0), torch.device("cpu"))
    empty = step.noisy_gradient(model, x[:0], y[:0], _per_example_loss, noise, replay=replay)
    assert all(float(t.abs().max()) == 0 for t in empty.values())
    for n in (17, 19, 21, 17, 19, 21, 17):
        replay.clipped_sum(model, x[:n], y[:n], _per_example_loss, CLIP)
    assert len(replay._traces) == 2


def test_functional_loss_with_aux_is_replayed():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 4))
    x, y, teacher = torch.randn(21, 10), torch.randint(0, 4, (21,)), torch.randn(21, 4)

    def distil(logits, target, aux):
        return F.kl_div(
            logits.log_softmax(-1), aux.softmax(-1), reduction="batchmean"
        ) + F.cross_entropy(logits, target)

    replay = StepReplay(patience=0)
    for _ in range(4):
        got = replay.clipped_sum(model, x, y, distil, CLIP, teacher)
        want = clipped_gradient_sum(model, x, y, distil, CLIP, teacher)
        assert _max_diff(got, want) <= 1e-6
    assert replay.replayed >= 1


def test_a_loss_written_in_the_loop_finds_its_trace_and_one_over_new_values_does_not():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 4))
    x, y = torch.randn(20, 10), torch.randint(0, 4, (20,))
    inline = StepReplay(patience=0)
    for _ in range(5):  # a new lambda object at every step, the same code and captures
        inline.clipped_sum(model, x, y, lambda lo, t, _: F.cross_entropy(lo, t), CLIP)
    assert inline.replayed == 2
    moving, kept = StepReplay(patience=0), []
    for i in range(5):  # the loss closes over a new class weighting at every step
        w = torch.rand(4, generator=torch.Generator().manual_seed(i)) + 0.5
        kept.append(weakref.ref(w))

        def weighted(lo, t, _, w=None, cw=w, tag=_SameHash()):
            return F.cross_entropy(lo, t, weight=cw)

        got = moving.clipped_sum(model, x, y, weighted, CLIP)
        assert _max_diff(got, clipped_gradient_sum(model, x, y, weighted, CLIP)) == 0
        del w, weighted, got
    # nothing recorded: captures that are other objects are another key, even where the keys'
    # hashes agree (as a freed object's identity reused by the next makes them agree)
    assert moving.replayed == 0 and moving.traced == 0
    gc.collect()
    assert all(ref() is None for ref in kept)  # what a loss closed over is not kept alive


class _SameHash:
    """An object whose hash every other one shares (its equality is identity)."""

    def __hash__(self) -> int:
        return 7


@pytest.mark.parametrize("path", ["layer-vjp", "torch.func"])
def test_a_model_clipped_by_torch_func_is_replayed_too(path):
    """The whole model's per-example gradients by torch.func, or an EmbeddingBag's alone."""
    torch.manual_seed(6)
    model = _Reused() if path == "torch.func" else _SignBag()
    x, y = torch.randn(21, 20), torch.randint(0, 4, (21,))
    replay = StepReplay(patience=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's fallback warning
        for n in (17, 18, 17, 18, 17, 18):
            got = replay.clipped_sum(model, x[:n], y[:n], _per_example_loss, CLIP)
            want = clipped_gradient_sum(model, x[:n], y[:n], _per_example_loss, CLIP)
            assert _max_diff(got, want) <= 1e-6
    assert replay.replayed >= 3 and not replay.refused


def test_canaries_observe_a_replayed_step_as_the_step():
    """White-box canaries of a seeded training (their coins and the noise drawn from the same
    stream) see the same releases with the clipped sum replayed, unpadded: bit for bit."""
    from attacks.whitebox import GradientCanaries

    scores = []
    for replay in (None, StepReplay(pad=False, patience=0)):
        model, x, y, opt, step, noise = _training("lstm", 24, seed=7)
        canaries = GradientCanaries.for_parameters(
            list(model.parameters()), 50, clip_norm=CLIP, sample_rate=0.75, noise_multiplier=1.0
        )
        for _ in range(8):  # the same batch: one size, so that steps 3-8 are replayed
            step.apply(
                model,
                opt,
                x[:18],
                y[:18],
                _per_example_loss,
                noise,
                canaries=canaries,
                replay=replay,
            )
        scores.append(canaries.scores())
        if replay is not None:
            assert replay.replayed >= 5
    assert scores[0].shape == (50,) and (scores[0] == scores[1]).all()


@pytest.mark.parametrize("family", ["llama", "bert", "t5", "bart"])
def test_hf_transformers_models_are_replayed_or_refused_with_the_reason(family):
    """HF models in training mode (dropout on): replayed bit for bit at a size that needs no
    padding, the random state alike; BART's classifier reads its end-of-sequence tokens' count
    into Python, and is refused."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("HF transformers is not installed")
    from hf_models import Logits, record_loss
    from hf_models import batch as hf_batch
    from hf_models import build as hf_build

    torch.manual_seed(0)
    model, kind = hf_build(family)
    model = Logits(model, kind).train()
    x, y = hf_batch(kind, 18, 50, 16)
    loss, replay = record_loss(kind), StepReplay(patience=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ReplayRefusedWarning)
        for seed in range(5):
            torch.manual_seed(seed)
            got = replay.clipped_sum(model, x, y, loss, CLIP)
            torch.manual_seed(seed)
            assert _max_diff(got, clipped_gradient_sum(model, x, y, loss, CLIP)) == 0
    refused = [w for w in caught if issubclass(w.category, ReplayRefusedWarning)]
    if family == "bart":
        assert replay.replayed == 0 and len(refused) == 1
        assert "_local_scalar_dense" in str(refused[0].message)
    else:
        assert replay.replayed == 2 and not refused


class _Clock:
    """A fake clock for the replay's timing: an unreplayed step takes 10 ms, a trace 300 ms more,
    a replay 2 ms."""

    def __init__(self, monkeypatch):
        from privkit.mechanisms import dp_sgd_step, scripted_trace, step_replay

        self.now = 0.0
        monkeypatch.setattr(step_replay, "time", self)
        step_fn, trace_fn = dp_sgd_step.clipped_gradient_sum, StepReplay._trace
        call = scripted_trace.ScriptedTrace.__call__

        def stepped(*args, **kwargs):
            self.now += 0.010
            return step_fn(*args, **kwargs)

        def traced(replay, *args, **kwargs):
            self.now += 0.300
            return trace_fn(replay, *args, **kwargs)

        def replayed(script, *args):
            self.now += 0.002
            return call(script, *args)

        monkeypatch.setattr(dp_sgd_step, "clipped_gradient_sum", stepped)
        monkeypatch.setattr(StepReplay, "_trace", traced)
        monkeypatch.setattr(scripted_trace.ScriptedTrace, "__call__", replayed)

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("patience", [1.0, 0.5, 0.0])
def test_a_size_is_traced_once_its_steps_have_paid_for_a_trace(monkeypatch, patience):
    """Ski rental: the first size is traced at its second step; a later size once its unreplayed
    steps would have saved, replayed, ``patience`` times the trace's cost (here 8 ms a step,
    10 ms less the replay's 2 ms, against 310 ms: the 39th step at patience 1, the 20th at 0.5;
    the second at 0)."""
    from privkit.mechanisms import step_replay

    monkeypatch.setattr(step_replay, "_TRACED_IN_PROCESS", [True])  # not a process's first
    clock = _Clock(monkeypatch)
    model, x, y = _model("lstm", 16)
    replay = StepReplay(pad=False, patience=patience)
    for _ in range(6):  # size 16: a step, its trace, its check, three replays
        replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
    assert (replay.traced, replay.replayed) == (1, 3)
    assert replay._trace_seconds == pytest.approx(0.310)
    due = {1.0: 39, 0.5: 20, 0.0: 1}[patience]  # unreplayed steps of size 12 before its trace
    calls = 0
    while replay.traced < 2 and calls < 60:
        replay.clipped_sum(model, x[:12], y[:12], _per_example_loss, CLIP)
        calls += 1
    assert calls == due + 1 and clock.now > 0


def test_a_processs_first_trace_is_not_the_price(monkeypatch):
    """The first trace in a process pays one-time costs: it is not timed, and the next size is
    traced at its second step (and timed)."""
    from privkit.mechanisms import step_replay

    monkeypatch.setattr(step_replay, "_TRACED_IN_PROCESS", [])
    _Clock(monkeypatch)
    model, x, y = _model("lstm", 16)
    replay = StepReplay(pad=False)
    for n in (16, 16, 16, 16, 12, 12):
        replay.clipped_sum(model, x[:n], y[:n], _per_example_loss, CLIP)
    assert replay.traced == 2 and replay._trace_seconds == pytest.approx(0.310)
    with pytest.raises(PrivkitError, match="patience must be >= 0; found -1"):
        StepReplay(patience=-1)


@pytest.mark.parametrize("both", [False, True])
def test_a_trace_that_raises_on_its_checked_run_is_not_kept(both, monkeypatch):
    """A scripted trace (or both runners) raising on the checked first replay, as TorchScript did
    on torch.func's vmap of an LSTM: the step's own result is returned, the scripted runner
    dropped (the graph replayed after it), or with both the size refused with a warning."""
    from privkit.mechanisms import step_replay

    def failing(*_args, **_kwargs):
        raise RuntimeError("a trace that records but does not run")

    monkeypatch.setattr(step_replay, "scripted", lambda graph, batch: failing)
    if both:
        monkeypatch.setattr(step_replay._Trace, "runners", lambda self: [failing, failing])
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(20, 12), nn.Tanh(), nn.Linear(12, 4))
    x, y = torch.randn(12, 20), torch.randint(0, 4, (12,))
    replay = StepReplay(pad=False, patience=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", step_replay.ReplayRefusedWarning)
        for _ in range(5):
            got = replay.clipped_sum(model, x, y, _per_example_loss, CLIP)
            want = clipped_gradient_sum(model, x, y, _per_example_loss, CLIP)
            assert _max_diff(got, want) <= 1e-6
    assert replay.scripted == 0
    assert bool(replay.refused) == both and (replay.replayed == 0) == both
