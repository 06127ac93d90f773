"""The arithmetic of benchmarks/audit_roofline.py: the audit ratio's floor, the goals, and which
aten ops count as matrix work (the benchmark itself trains every method: not run here)."""

import importlib.util
import sys
from pathlib import Path

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
