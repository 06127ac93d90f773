"""The arithmetic of benchmarks/audit_roofline.py: the audit ratio's floor, the goals, and which
aten ops count as matrix work (the benchmark itself trains every method: not run here)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "audit_roofline", REPO / "benchmarks" / "audit_roofline.py"
)
roofline = importlib.util.module_from_spec(_spec)
sys.modules["audit_roofline"] = roofline
_spec.loader.exec_module(roofline)


def test_ratio_floor_is_the_target_plus_the_reference_runs_at_peak():
    assert roofline.audit_ratio_floor(0.0, 2.0, 16) == 1.0  # free reference runs: the target alone
    assert roofline.audit_ratio_floor(0.1, 2.0, 16) == pytest.approx(1.8)
    assert roofline.audit_ratio_floor(2.0, 2.0, 16) == pytest.approx(17.0)  # no overhead at all


def test_goals_of_issue_32():
    for method in ("dpsgd", "dp-fedavg", "fedkd-dp", "fedkadp", "fedavg", "fedprox"):
        assert roofline.audit_goal(method) == 3.0
    for method in ("flip", "fedmd-nfdp", "centralized"):
        assert roofline.audit_goal(method) == 6.0


@pytest.mark.parametrize(
    ("op", "matrix"),
    [
        ("aten.mm", True),
        ("aten.addmv", True),
        ("aten.linalg_solve", True),
        ("aten._convolution_double_backward", True),
        ("aten.linalg_vector_norm", False),
        ("aten.add", False),
        ("aten.sum", False),
    ],
)
def test_matrix_like_ops(op, matrix):
    assert roofline._matrix_like(op) is matrix


def test_observed_floor_uses_the_observed_training_time():
    entry = {"reference_floor_s": 0.5}
    out = roofline.with_observed(entry, {"observed_train_cpu_s": 4.0, "ratio": 1}, 16)
    assert out["audit_ratio_floor_observed_train"] == 3.0
    assert "audit_ratio_floor_observed_train" not in roofline.with_observed(entry, {}, 16)


def test_observed_floor_counts_the_reference_noise():
    entry = {"reference_floor_s": 0.25, "reference_noise_floor_s": 0.25}
    out = roofline.with_observed(entry, {"observed_train_cpu_s": 4.0}, 16)
    assert out["audit_ratio_floor_observed_train"] == 3.0


def test_the_recorder_counts_every_standard_normal_drawn():
    """The reference runs' noise floor counts the elements of every Gaussian draw (randn, normal_
    in place, normal with tensor moments) and nothing else."""
    import torch

    recorder = roofline._op_recorder()
    gen = torch.Generator().manual_seed(0)
    with recorder:
        torch.randn(3, 4, generator=gen)
        torch.empty(5).normal_(generator=gen)
        torch.normal(torch.zeros(7), torch.ones(7), generator=gen)
        torch.rand(11, generator=gen)  # uniforms are not normals
        torch.zeros(13).add_(1.0)
    assert recorder.normals == 12 + 5 + 7
    assert recorder.calls["aten.add_"] == 1


# -- the kernel floor: benchmarks/kernel_replay.py and the audit's reference runs ----------------
replay = sys.modules["kernel_replay"]  # imported by audit_roofline from benchmarks/


def test_a_described_call_materialises_with_its_layouts():
    import torch

    base = torch.randn(6, 4)
    args = (base.t(), [base[:, :2], torch.arange(3)], 7, "mean")
    described = replay.describe(args)
    assert hash(described) is not None  # a key of the recorder's counter
    t, (part, ints), n, name = replay.materialise(described)
    assert (t.shape, t.stride(), t.dtype) == ((4, 6), (1, 4), torch.float32)  # a transposed view
    assert (part.shape, part.stride()) == ((6, 2), (4, 1))
    assert ints.dtype == torch.int64 and int(ints.abs().sum()) == 0
    assert (n, name) == (7, "mean")
    assert float(t.min()) >= 0.5 and float(t.max()) < 1.0  # finite under sqrt and division
    # an expanded argument (stride 0, as a broadcast bias) keeps its layout
    (bias,) = replay.materialise(replay.describe((torch.randn(5)[None, :].expand(3, 5),)))
    assert (bias.shape, bias.stride()) == ((3, 5), (0, 1)) and torch.equal(bias[0], bias[2])
    (empty,) = replay.materialise(replay.describe((torch.empty(0, 4),)))
    assert empty.shape == (0, 4)


def test_the_recorder_counts_kept_ops_by_layout():
    import torch

    recorder = replay.KernelRecorder(lambda op: op == "aten.mm")
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    with recorder:
        for _ in range(3):
            torch.mm(a, b)
        torch.mm(a, b.t().contiguous().t())  # same shapes, the other layout: its own signature
        torch.add(a, 1.0)  # not kept
    assert sorted(recorder.calls.values()) == [1, 3]
    assert {str(func.overloadpacket) for func, _, _ in recorder.calls} == {"aten.mm"}


def test_replayed_sums_each_signatures_count_times_its_time(monkeypatch):
    import torch

    recorder = replay.KernelRecorder(lambda op: op in ("aten.mm", "aten.bmm"))
    with recorder:
        for _ in range(4):
            torch.mm(torch.randn(4, 4), torch.randn(4, 4))
        torch.bmm(torch.randn(2, 4, 4), torch.randn(2, 4, 4))
    times = {"aten.mm": 0.5, "aten.bmm": 2.0}
    monkeypatch.setattr(
        replay, "call_seconds", lambda func, *a, **k: times[str(func.overloadpacket)]
    )
    out = replay.replayed(recorder.calls)
    assert out["seconds"] == pytest.approx(4 * 0.5 + 2.0)
    assert out["by_op"] == {"aten.mm": 2.0, "aten.bmm": 2.0}
    assert (out["calls"], out["signatures"]) == (5, 2)


def test_call_seconds_runs_the_call_on_fresh_tensors():
    import torch

    seen = []
    recorder = replay.KernelRecorder(lambda op: op == "aten.mm")
    with recorder:
        torch.mm(torch.randn(3, 2), torch.randn(2, 5))
    ((func, args, kwargs),) = recorder.calls

    def spy(*a, **k):
        seen.append(tuple(x.shape for x in a))
        return func(*a, **k)

    assert replay.call_seconds(spy, args, kwargs, repeats=2, window=0.0) >= 0.0
    assert seen and set(seen) == {((3, 2), (2, 5))}


def test_kernel_floor_is_the_target_plus_the_replayed_reference_kernels(monkeypatch):
    counted = {"reference_kernel_s": 4.0, "audit_reference_flops": 0, "audit_reference_normals": 0}
    monkeypatch.setattr(roofline, "reference_kernels", lambda *a: dict(counted))
    out = roofline._kernel_floor("fedavg", 0, 16, 3, 2.0, 3.0, 90e9, 5.0)
    assert out["audit_ratio_floor_kernels"] == 3.0 and out["excluded_at_kernel_rates"] is False
    out = roofline._kernel_floor("fedavg", 0, 16, 3, 1.6, 3.0, 90e9, 5.0)
    assert out["audit_ratio_floor_kernels"] == 3.5 and out["excluded_at_kernel_rates"] is True
    assert roofline._kernel_floor("fedavg", None, 16, 3, 2.0, 3.0, 90e9, 5.0) == {}


def test_the_kernel_floor_trains_the_audits_reference_runs_only(monkeypatch):
    """The runs replayed are audit_run's reference runs at the audit seed: its design's reference
    seeds and index sets, seeded noise, the target run left out."""
    from attacks.experiment import design_experiment
    from privkit.audit.recipes import FederationRecipe
    from privkit.audit.run import audit_pool

    got = {}

    def fit_many(self, x, y, sets, seeds):
        got.update(recipe=self, sets=sets, seeds=seeds)

    monkeypatch.setattr(FederationRecipe, "fit_many", fit_many)
    roofline.audit_reference_runs("dp-fedavg", 3, 4)()
    fed = roofline._federation()
    pool, audited, _ = audit_pool(fed, None, 3)
    design = design_experiment(pool.size, shadows=4, seed=3, audited=audited)
    assert list(got["seeds"]) == list(design.reference_seeds)
    assert design.target_seed not in got["seeds"]
    assert all(got["recipe"].reference(s) for s in got["seeds"])
    wanted = dict(zip(design.seeds(), design.index_sets()))
    assert all(np.array_equal(ix, wanted[s]) for ix, s in zip(got["sets"], got["seeds"]))


def test_the_table_names_the_kernel_floor_where_measured(capsys):
    entry = {
        "flops": 2e9,
        "floor_s": 0.02,
        "reference_noise_floor_s": 0.0,
        "train_cpu_s": 1.0,
        "floor_share": 0.02,
        "audit_ratio_floor": 1.3,
        "goal": 3.0,
        "excluded": False,
        "uncounted_matrix_ops": {},
    }
    kernels = {
        "reference_kernel_s": 2.5,
        "audit_ratio_floor_kernels": 3.5,
        "excluded_at_kernel_rates": True,
    }
    out = {"peak_gflops": 90.0, "ns_per_normal": 3.4}
    roofline._print_table({**out, "methods": {"fedavg": {**entry, **kernels}, "flip": entry}})
    lines = capsys.readouterr().out.splitlines()
    assert any("kernel floor 3.50x  excluded at these kernels' rates" in line for line in lines)
    assert sum("kernel floor" in line for line in lines) == 1  # flip: not measured, not shown


def test_the_peak_floor_counts_the_audits_reference_runs_own_arithmetic(monkeypatch):
    counted = {
        "audit_reference_flops": 180e9,  # 2 s at 90 GFLOP/s
        "audit_reference_normals": 100_000_000,  # 0.5 s at 5 ns
        "reference_kernel_s": 3.0,
    }
    monkeypatch.setattr(roofline, "reference_kernels", lambda *a: dict(counted))
    got = roofline._kernel_floor("fedavg", 0, 16, 3, 1.25, 3.0, 90e9, 5.0)
    assert got["audit_ratio_floor_at_peak"] == pytest.approx(1 + 2.5 / 1.25)
    assert got["excluded_at_peak"] is False
    over = roofline._kernel_floor("fedavg", 0, 16, 3, 1.0, 3.0, 90e9, 5.0)
    assert over["audit_ratio_floor_at_peak"] == pytest.approx(3.5) and over["excluded_at_peak"]
    # products that would take longer at peak (4 s) than their kernels took (3 s): no floor
    counted["audit_reference_flops"] = 360e9
    wrong = roofline._kernel_floor("fedavg", 0, 16, 3, 1.0, 3.0, 90e9, 5.0)
    assert not wrong["peak_count_plausible"] and not wrong["excluded_at_peak"]
