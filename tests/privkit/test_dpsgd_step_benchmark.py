"""benchmarks/dpsgd_step.py in a small configuration: its JSON (every variant timed, the ratios
from the interleaved repeats), the clock it says it used with one torch thread and with several,
and bad input refused in one line with exit code 2."""

import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dpsgd_step.py"


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_the_benchmark_times_every_variant_on_the_threads_asked(threads):
    run = _run("--models", "resnet_small", "--repeats", "2", "--threads", str(threads), "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["schema_version"] == 1 and out["threads"] == threads
    r = out["models"]["resnet_small"]
    assert r["privkit_path"] == "ghost_clipping"
    variants = {"sgd", "opacus_hooks", "opacus_ghost", "privkit", "privkit_seeded"}
    variants |= {"privkit_replay", "privkit_replay_seeded", "privkit_replay_python_seeded"}
    assert set(r["times_ms"]) == variants and all(len(t) == 2 for t in r["times_ms"].values())
    for v, times in r["times_ms"].items():  # the ratios are the repeats' paired ratios
        pairs = zip(times, r["times_ms"]["sgd"], strict=True)
        assert r["vs_sgd"][v] == pytest.approx(statistics.median(a / b for a, b in pairs))
    assert r["median_ms"]["sgd"] == pytest.approx(statistics.median(r["times_ms"]["sgd"]))


def test_host_bound_steps_are_small_and_seeded():
    """``--host-bound``: 4 records of 8x8 images, seeded noise only (the release's ChaCha20 is
    torch's operations on a CPU), privkit's GPU forms."""
    run = _run("--models", "resnet_small", "--repeats", "2", "--host-bound", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["setup"]["host_bound"] and out["setup"]["batch"].startswith("fixed, 4 records")
    r = out["models"]["resnet_small"]
    assert r["batch"] == 4 and "privkit" not in r["times_ms"] and "privkit_seeded" in r["times_ms"]
    assert "privkit_replay" not in r["times_ms"] and "privkit_replay_seeded" in r["times_ms"]


def test_a_model_opacus_refuses_is_left_out_with_the_reason():
    """opacus' ghost clipping refuses a tied head (its NotImplementedError, itself a
    RuntimeError): the variant is left out, the others timed."""
    run = _run("--models", "lm", "--repeats", "1", "--host-bound", "--json")
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)["models"]["lm"]
    assert "Parameter tying" in r["unavailable"]["opacus_ghost"]
    assert {"sgd", "opacus_hooks", "privkit_seeded", "privkit_replay_seeded"} | {
        "privkit_replay_python_seeded"
    } == set(r["times_ms"])


def test_the_host_bound_batch_is_cropped():
    sys.path.insert(0, str(SCRIPT.parent))
    import torch
    from dpsgd_step import _host_bound

    x, y = _host_bound("resnet_small", torch.zeros(4, 3, 32, 32), torch.zeros(4))
    assert x.shape == (4, 3, 8, 8) and y.shape == (4,)
    x, y = _host_bound("vit", torch.zeros(4, 3, 32, 32), torch.zeros(4))
    assert x.shape == (4, 3, 32, 32)  # its position embedding's length
    x, y = _host_bound("lm", torch.zeros(4, 64, dtype=torch.long), torch.zeros(4, 64))
    assert x.shape == (4, 8) and y.shape == (4, 8)


def test_autocast_runs_every_variant_under_it_or_says_why_not():
    run = _run("--models", "resnet_small", "--repeats", "2", "--autocast", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["setup"]["autocast"] == "bfloat16"
    r = out["models"]["resnet_small"]
    assert {"sgd", "privkit_seeded", "privkit_replay_seeded"} <= set(r["times_ms"])
    # opacus' hooks assign half-precision per-example gradients to float32 parameters
    sys.path.insert(0, str(SCRIPT.parent))
    from dpsgd_step import VARIANTS

    assert set(r["times_ms"]) | set(r["unavailable"]) == set(VARIANTS)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--repeats", "0"], "--repeats must be >= 1; found 0"),
        (["--threads", "0"], "--threads must be >= 1; found 0"),
        (["--threads", "2", "--device", "meta"], "found --device meta"),
        (["--host-bound", "--device", "meta"], "--host-bound measures the host's work on the CPU"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, named):
    run = _run(*args)
    assert run.returncode == 2 and named in run.stderr.splitlines()[-1]


def test_torch_func_variant_and_the_models_of_torchs_other_layers():
    """``--torch-func`` adds the step clipped from the whole model's per-example gradients;
    the 3-d CNN, the ResNet with frozen BatchNorm, the EmbeddingBag classifier and torch's LSTM
    take ghost clipping; opacus' variants run the ResNet with its BatchNorm made GroupNorm (in
    training mode) and the LSTM made DPLSTM, and are left out of the EmbeddingBag classifier with
    opacus' reason (it takes bags by offsets only)."""
    run = _run(
        "--models", "cnn3d,resnet_small_bn,fasttext,lstm_torch", "--repeats", "1", "--host-bound",
        "--torch-func", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["setup"]["torch_func"]
    for name in ("cnn3d", "resnet_small_bn", "fasttext", "lstm_torch"):
        r = out["models"][name]
        assert r["privkit_path"] == "ghost_clipping"
        assert {"sgd", "privkit_seeded", "privkit_torch_func_seeded"} <= set(r["times_ms"])
        opacus = {"opacus_hooks", "opacus_ghost"}
        if name == "fasttext":
            assert set(r["unavailable"]) == opacus
            assert all("ValueError" in why for why in r["unavailable"].values())
        else:
            assert not r["unavailable"] and opacus <= set(r["times_ms"])


def test_a_cell_loop_and_opacus_form_of_it():
    """torch's ``nn.LSTMCell`` in the model's loop, ``nn.LSTM`` on packed texts and a stacked
    ``nn.LSTM`` with dropout take ghost clipping; opacus trains a ``DPLSTMCell`` of the same
    weights (the same function) and ``DPLSTM``, and the whole model's ``torch.func`` gradients,
    which cannot batch the cell's zero state, the packing nor the dropout's draws, are left out
    with torch's error."""
    sys.path.insert(0, str(SCRIPT.parent))
    import dpsgd_step

    torch.manual_seed(0)
    model = dpsgd_step.CellLoopClassifier(vocab=50, d=6, hidden=5)
    x = torch.randint(0, 50, (4, 7))
    converted = dpsgd_step.opacus_cells(copy.deepcopy(model))
    assert type(converted.cell).__name__ == "DPLSTMCell"
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-6)
    run = _run(
        "--models", "lstm_cell,lstm_packed,lstm_stacked", "--repeats", "1", "--host-bound",
        "--torch-func",
        "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for name in ("lstm_cell", "lstm_packed", "lstm_stacked"):  # nor torch.func the whole model
        r = json.loads(run.stdout)["models"][name]
        assert r["privkit_path"] == "ghost_clipping"
        assert {"sgd", "opacus_hooks", "opacus_ghost", "privkit_seeded"} <= set(r["times_ms"])
        assert list(r["unavailable"]) == ["privkit_torch_func_seeded"]
        assert r["unavailable"]["privkit_torch_func_seeded"].startswith("RuntimeError")


def test_a_sequence_first_encoder_and_its_batch_first_twin():
    """The sequence-first encoder takes ghost clipping; opacus trains its batch-first twin of the
    same weights (the same function)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import dpsgd_step

    torch.manual_seed(0)
    model = dpsgd_step.EncoderClassifier(vocab=50, d=8, heads=2, length=6, batch_first=False)
    x = torch.randint(0, 50, (4, 6))
    twin = model.batch_first_twin()
    assert twin.batch_first and all(b.self_attn.batch_first for b in twin.blocks.layers)
    torch.testing.assert_close(twin(x), model(x), rtol=1e-5, atol=1e-6)
    run = _run("--models", "encoder_seq_first", "--repeats", "1", "--host-bound", "--json")
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)["models"]["encoder_seq_first"]
    assert r["privkit_path"] == "ghost_clipping" and not r["unavailable"]
    assert {"sgd", "opacus_hooks", "opacus_ghost", "privkit_seeded"} <= set(r["times_ms"])


def test_a_run_stopped_by_sigterm_keeps_the_models_it_measured():
    """A stage's time limit (``timeout``'s SIGTERM) after the first model: the JSON holds it, and
    says the run stopped and which models it did not measure."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--models", "resnet_small,lm,vit", "--repeats", "3",
         "--host-bound", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:  # progress: a line per model measured
        if line.startswith("measured resnet_small"):
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0
    run = json.loads(out)
    assert list(run["models"]) == ["resnet_small"]
    assert run["stopped"] == "SIGTERM after 1 of 3 models; not measured: lm, vit"


def test_standardised_convolutions_take_ghost_clipping_where_opacus_cannot():
    """The ResNet with parametrized (standardised) convolutions: privkit's path is ghost
    clipping; opacus' variants are left out with its reason."""
    run = _run("--models", "resnet_small_ws", "--repeats", "1", "--host-bound", "--json")
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout)["models"]["resnet_small_ws"]
    assert r["privkit_path"] == "ghost_clipping"
    assert set(r["unavailable"]) == {"opacus_hooks", "opacus_ghost"}
    assert all("ModuleValidator.fix" in why for why in r["unavailable"].values())
    assert {"sgd", "privkit_seeded", "privkit_replay_seeded"} <= set(r["times_ms"])
