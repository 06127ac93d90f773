"""benchmarks/freed_memory.py: its cases are the steps they name, its rounds alternate the policies,
its ratio is of medians, and its bad input is one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import freed_memory


def test_stacked_client_case_is_each_models_own_gradient(monkeypatch):
    """The stacked client case's step gives each of its 8 CNNs the gradient autograd gives that
    model on its own batch (so the benchmark times the reference clients' real work)."""
    import torch.nn.functional as F

    import privkit.batched.many_central as central
    from privkit.models import build_model

    captured = {}
    original = central.step_gradients

    def spy(net, params, buffers, x, y, counts):
        captured.update(params=params, x=x, y=y)
        return original(net, params, buffers, x, y, counts)

    monkeypatch.setattr(central, "step_gradients", spy)  # the case imports it when it is made
    grads, _ = freed_memory._step("client_cnn_stacked")()
    params, x, y = captured["params"], captured["x"], captured["y"]
    assert x.shape[:2] == (8, 32)
    for m in (0, 7):
        model = build_model("cnn", (1, 28, 28), 10, width=16, feature_dim=128)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(params[k][m])
        F.cross_entropy(model(x[m]), y[m]).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k][m], p.grad, rtol=1e-4, atol=1e-6)


def test_rounds_alternate_and_the_ratio_is_of_medians(monkeypatch):
    order = []
    times = {"kept": iter([0.2, 0.1, 0.3]), "system": iter([0.4, 0.5, 0.9])}

    def fake(case, policy, steps):
        order.append(policy)
        return {"kept": policy == "kept", "step_s": next(times[policy]), "faults": 0}

    monkeypatch.setattr(freed_memory, "_run_child", fake)
    row = freed_memory.measure(["dpsgd_cnn_single"], 3, 1)["dpsgd_cnn_single"]
    assert order == ["kept", "system", "system", "kept", "kept", "system"]
    assert row["kept_over_system"] == pytest.approx(0.2 / 0.5, abs=1e-3)
    assert row["kept_step_ms"] == [200.0, 100.0, 300.0] and row["kept_applied"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cases", "nope"], "--cases must name some of"),
        (["--rounds", "0"], "--rounds must be at least 1; found 0"),
        (["--steps", "0"], "--steps must be at least 1; found 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        freed_memory.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err
