"""Centralised DP-SGD's stacked runs over the inputs some record uses, while reference runs train.

:class:`~privkit.batched.used_inputs.UnusedInputs`: with seeded reference runs in the stack, the
first layer's columns of the inputs 0 in every record (MNIST's border pixels) are held aside. The
target run releases its whole gradient at every step; a reference run draws its unused columns'
noise of all its steps after its last one. Checked here: which inputs are found; without noise
the narrowed runs are the full ones; a run releasing its own noise keeps its numbers (its unused
columns included); the reference runs' unused columns move by the law of the steps' noise (a
one-sample and a two-sample test over many coordinates, with a control missing the steps that
both must reject); and an audit's noise mutation scales that draw.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from test_batched_federations import CASES

from privkit.batched import used_inputs
from privkit.batched.many_dpsgd import train_dpsgd_runs
from privkit.batched.used_inputs import UnusedInputs
from privkit.data import FederationConfig, build_federation
from privkit.mechanisms import mutations
from privkit.mechanisms.stacked import StackedModels
from privkit.methods.contract import make_config
from privkit.models import build_model
from privkit.seeding import derive_seed
from privkit.trainers.common import new_model

CONFIG = CASES["dpsgd given-sigma"]  # 3,200 records: 16 steps of 200 a run
#: a false alarm of each agreement test at most this often
ALPHA = 1e-3
FIND = UnusedInputs.find.__func__  # type: ignore[attr-defined]  # the classmethod's function


@pytest.fixture(scope="module")
def fed():
    """MNIST records (3,200 pooled: 129 of the 784 pixels 0 in every record and test record)."""
    return build_federation(FederationConfig(partition="shards", clients=20, seed=0))


def _net(arch: str = "mlp", side: int = 4) -> tuple[StackedModels, list[str]]:
    model = build_model(arch, (1, side, side), 3, feature_dim=8)
    return StackedModels(model, 2), [k for k, p in model.named_parameters() if p.requires_grad]


def test_the_inputs_no_record_or_test_record_uses_are_found():
    net, names = _net()
    x = torch.zeros(5, 1, 4, 4)
    x[:, 0, :2] = 1.0  # the first 8 pixels used by the records
    test = torch.zeros(3, 1, 4, 4)
    test[0, 0, 3, 3] = -2.0  # and the last by a test record
    got = UnusedInputs.find(net, names, [x, x[:2]], [test])
    assert got is not None and got.weight == f"{net.parametrised[0]}.weight"
    assert got.used.tolist() == [*range(8), 15] and got.unused.tolist() == list(range(8, 15))
    # nothing to leave out: every input used, or fewer than MIN_UNUSED_SHARE of them unused
    assert UnusedInputs.find(net, names, [torch.ones(5, 1, 4, 4)], []) is None
    few = torch.ones(5, 1, 4, 4)
    few[:, 0, 0, 0] = 0.0  # 1 of 16 inputs
    assert UnusedInputs.find(net, names, [few], []) is None
    # a frozen first layer, or one that is not linear on the input
    frozen = [k for k in names if not k.startswith(net.parametrised[0])]
    assert UnusedInputs.find(net, frozen, [x], []) is None
    cnn, cnn_names = _net("cnn", side=8)
    assert UnusedInputs.find(cnn, cnn_names, [torch.zeros(5, 1, 8, 8)], []) is None


def test_a_narrowed_stack_puts_every_column_back_in_place():
    net, names = _net()
    x = torch.zeros(4, 16)
    x[:, ::3] = 1.0
    narrowing = UnusedInputs.find(net, names, [x], [])
    assert narrowing is not None
    w = torch.randn(2, 8, 16)
    params = {narrowing.weight: w.clone()}
    narrowing.narrow(params)
    assert params[narrowing.weight].shape == (2, 8, len(narrowing.used))
    assert torch.equal(narrowing.weights(params, 1)[narrowing.weight], w[1])
    whole = narrowing.whole({narrowing.weight: params[narrowing.weight][0]})[narrowing.weight]
    assert torch.equal(whole[:, narrowing.used], w[0][:, narrowing.used])
    assert not whole[:, narrowing.unused].any()
    narrowing.restore(params)
    assert torch.equal(params[narrowing.weight], w)


def _runs(fed, seeds: list[int], fast: list[bool], narrowed: bool, monkeypatch, **config):
    """The runs of ``seeds`` (``fast``: seeded reference runs) and their initial models; over
    the used inputs where ``narrowed``, else over every input (:meth:`UnusedInputs.find` made
    to find none)."""
    found: list[bool] = []

    def find(cls, *args, **kw):
        out = FIND(cls, *args, **kw) if narrowed else None
        found.append(out is not None)
        return out

    monkeypatch.setattr(UnusedInputs, "find", classmethod(find))
    cfg = make_config("dpsgd", {**CONFIG, **config})
    torch.set_num_threads(1)
    runs = train_dpsgd_runs("dpsgd", [fed] * len(seeds), [cfg] * len(seeds), seeds, fast)
    assert found == [narrowed]  # looked for once, and narrowed where asked
    starts = [new_model(fed, cfg, derive_seed(s, "init"))[0].state_dict() for s in seeds]
    return [r.model.state_dict() for r in runs], starts


def _first(state: dict) -> str:
    return next(k for k in state if k.endswith("weight"))


def _unused(fed) -> torch.Tensor:
    x = np.concatenate([fed.pooled_arrays()[0], fed.test_arrays()[0]]).reshape(-1, 784)
    return torch.as_tensor(~(x != 0).any(0)).nonzero().flatten()


def test_without_noise_the_narrowed_runs_are_the_full_ones(fed, monkeypatch):
    seeds, fast = [1, 2, 3], [False, True, True]
    narrow, starts = _runs(fed, seeds, fast, True, monkeypatch, noise_multiplier=1e-30)
    full, _ = _runs(fed, seeds, fast, False, monkeypatch, noise_multiplier=1e-30)
    w, off = _first(full[0]), _unused(fed)
    for a, b, s in zip(narrow, full, starts):
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-5), k
        assert float((b[w] - s[w]).abs().max()) > 1e-2  # the training moved the weights
        assert torch.equal(a[w][:, off], s[w][:, off])  # and the unused columns not at all


def test_a_run_releasing_its_own_noise_keeps_its_numbers(fed, monkeypatch):
    """A seeded run that is no reference run (as the target run is) releases its whole gradient
    from its own stream at every step, narrowed or not: the same numbers up to the products'
    rounding, its unused columns' noise included; the reference runs beside it differ."""
    seeds, fast = [1, 2, 3], [False, True, True]
    narrow, starts = _runs(fed, seeds, fast, True, monkeypatch)
    full, _ = _runs(fed, seeds, fast, False, monkeypatch)
    w, off = _first(full[0]), _unused(fed)
    for k in full[0]:
        assert torch.allclose(narrow[0][k], full[0][k], atol=1e-5), k
    assert float((full[0][w][:, off] - starts[0][w][:, off]).abs().min()) > 1e-6  # noise moved them
    assert not torch.allclose(narrow[1][w], full[1][w], atol=1e-3)


def _displacement(fed, monkeypatch, seeds: list[int], narrowed: bool) -> np.ndarray:
    """The reference runs' unused columns' displacement, in units of one step's noise."""
    after, before = _runs(fed, seeds, [True] * len(seeds), narrowed, monkeypatch)
    w, off = _first(after[0]), _unused(fed)
    unit = CONFIG["lr"] * CONFIG["noise_multiplier"] * CONFIG["clip_norm"] / 200  # E = 3200 / 16
    moved = [(a[w][:, off] - b[w][:, off]).double().flatten() / unit for a, b in zip(after, before)]
    return torch.cat(moved).numpy()


def test_the_reference_runs_unused_columns_move_by_the_law_of_the_steps_noise(fed, monkeypatch):
    steps = 16  # one epoch of 3,200 records in batches of 200
    full = _displacement(fed, monkeypatch, list(range(10, 22)), narrowed=False)
    narrow = _displacement(fed, monkeypatch, list(range(30, 42)), narrowed=True)
    assert len(narrow) > 20_000 and len(full) == len(narrow)
    law = stats.norm(scale=np.sqrt(steps))
    assert stats.ks_2samp(full, narrow).pvalue > ALPHA
    assert stats.kstest(narrow, law.cdf).pvalue > ALPHA
    assert stats.kstest(full, law.cdf).pvalue > ALPHA
    # the control: one step's variance instead of all steps' must be told apart
    original = used_inputs.summed_noise
    monkeypatch.setattr(
        used_inputs,
        "summed_noise",
        lambda source, shape, stds, steps, dtype: original(source, shape, stds, 1, dtype),
    )
    bad = _displacement(fed, monkeypatch, list(range(30, 42)), narrowed=True)
    assert stats.ks_2samp(full, bad).pvalue < 1e-6
    assert stats.kstest(bad, law.cdf).pvalue < 1e-6


def test_an_audits_noise_mutation_scales_the_reference_runs_unused_columns(fed, monkeypatch):
    right = _displacement(fed, monkeypatch, list(range(50, 56)), narrowed=True)
    with mutations.mutated(mutations.MUTATIONS["noise x1/2"]):
        halved = _displacement(fed, monkeypatch, list(range(50, 56)), narrowed=True)
    assert np.std(halved) / np.std(right) == pytest.approx(0.5, rel=0.05)


def test_a_probed_stack_stays_whole(fed, monkeypatch):
    """While an audit probes the runs, its canaries observe the whole release of every step:
    the stack is not narrowed, and the probed reference run's probes observe each of its 16
    releases."""
    from privkit.mechanisms.probes import ProbePlan, probing

    looked: list[bool] = []
    monkeypatch.setattr(
        UnusedInputs, "find", classmethod(lambda cls, *a, **kw: looked.append(True))
    )
    cfg = make_config("dpsgd", CONFIG)
    with probing(ProbePlan(canaries=64, clients=(0,), seed=3)) as session:
        train_dpsgd_runs("dpsgd", [fed, fed], [cfg, cfg], [1, 2], [False, True])
    assert not looked
    assert session.probes[(0, "dp-sgd")].steps == 2 * 16  # both runs' releases, each observed
