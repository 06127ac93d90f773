"""benchmarks/single_run.py: its comparison of two trained models and its checks of bad input
(the benchmark itself trains every method twice per repeat: not run here)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import single_run


def test_max_abs_diff_is_the_largest_entrywise_difference_and_zero_only_for_equal_models():
    a = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5]), "e": torch.zeros(0)}
    assert single_run.max_abs_diff(a, {k: v.clone() for k, v in a.items()}) == 0.0
    b = {**a, "w": a["w"] + torch.tensor([[0.0, 0.0], [-2.5e-7, 0.0]])}
    assert single_run.max_abs_diff(a, b) == abs(float(b["w"][1, 0]) - 3.0) > 0
    # compared in float64: a difference below float32's spacing at 4.0 is still seen
    c = {**a, "w": a["w"].double() + torch.tensor([[0.0, 0.0], [0.0, 1e-9]], dtype=torch.float64)}
    assert 0 < single_run.max_abs_diff(a, c) < 2e-9


def test_bad_input_names_the_parameter_and_exits_2(capsys):
    assert single_run.main(["--repeats", "0"]) == 2
    assert "--repeats must be >= 1; found 0" in capsys.readouterr().err
    assert single_run.main(["--methods", "fedauxfdp,nope"]) == 2
    err = capsys.readouterr().err
    assert "--methods" in err and "fedauxfdp, nope" in err
