"""The arithmetic of benchmarks/audit_breakdown.py: the floor that keeps an audit's fixed parts,
and the clock that times them (the benchmark itself trains and audits: not run here)."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import audit_breakdown as breakdown


def test_floor_keeps_the_target_run_and_the_attack_fit_beside_the_reference_kernels():
    row = {"train_cpu_s": 2.0, "target_exact_s": 0.5, "shadow_fit_s": 0.5}
    out = breakdown.with_floor(row, {"reference_kernel_s": 3.0}, 3.0)
    assert out["floor_with_fixed_parts"] == pytest.approx(2.0)  # (0.5 + 3 + 0.5) / 2
    assert out["goal_leaves_s"] == pytest.approx(2.0)  # 3 x 2 s - 4 s
    assert breakdown.with_floor(row, {"reference_kernel_s": 3.0}, 6.0)["goal_leaves_s"] == 8.0
    over = breakdown.with_floor({**row, "train_cpu_s": 1.0}, {"reference_kernel_s": 3.0}, 3.0)
    assert over["goal_leaves_s"] < 0 and over["floor_with_fixed_parts"] > 3.0
    assert breakdown.with_floor(row, None, 3.0) == row  # no kernels measured: the row as it is


def test_the_clock_times_each_part_and_passes_results_and_errors_through():
    clock = breakdown._Clock()

    def busy(seconds: float) -> str:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
        return "done"

    def fails():
        busy(0.02)
        raise ValueError("boom")

    assert clock.wrap("shadow_fit", busy)(0.05) == "done"
    with pytest.raises(ValueError, match="boom"):
        clock.wrap("rounds_finish", fails)()
    assert clock.seconds["shadow_fit"] >= 0.05
    assert clock.seconds["rounds_finish"] >= 0.02
    assert clock.seconds["target_exact"] == 0.0
