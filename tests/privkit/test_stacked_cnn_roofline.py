"""benchmarks/stacked_cnn_roofline.py: the step's floating-point work and its bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import stacked_cnn_roofline as roofline


@pytest.mark.parametrize("batch,width,feature_dim", [(32, 16, 128), (5, 8, 64), (7, 3, 10)])
def test_step_flops_are_torchs_own_count(batch, width, feature_dim):
    """The step's work counted from the layer shapes equals torch's FLOP counter over the CNN's
    forward and backward passes (convolutions and products; the first layer's input gradient is
    not taken, as autograd does not take it)."""
    model = roofline._cnn(width, feature_dim, 0)
    x = torch.randn(batch, 1, roofline.SIDE, roofline.SIDE)
    y = torch.randint(0, roofline.CLASSES, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    assert sum(roofline.step_flops(batch, width, feature_dim).values()) == counter.get_total_flops()


def test_bad_input_is_one_line_and_exit_code_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        roofline.main(["--models", "0"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "--models must be an integer >= 1; found 0"
