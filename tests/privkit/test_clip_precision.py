"""privkit.mechanisms.clip_precision: DP-SGD's norms and clipped sums at full precision whatever
the caller set (autocast, ``torch.set_float32_matmul_precision``), the caller's settings put back
after. On a GPU the lowered float32 products are TF32 (no such hardware here): what is checked is
that the norms and sums run with the products at float32's precision and autocast off, through
the legacy setting or torch's per-backend flags, and that every setting comes back, on an error
too."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import clip_precision, ghost_clipping
from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum


@pytest.fixture
def high():
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision("highest")


def test_compute_dtype_is_float32_or_wider():
    assert clip_precision.compute_dtype(torch.bfloat16) == torch.float32
    assert clip_precision.compute_dtype(torch.float16) == torch.float32
    assert clip_precision.compute_dtype(torch.float32) == torch.float32
    assert clip_precision.compute_dtype(torch.float64) == torch.float64


def test_lowered_says_where_the_caller_computes_below_float32(high):
    cpu = torch.device("cpu")
    assert clip_precision.lowered(cpu)  # the fixture's "high"
    torch.set_float32_matmul_precision("highest")
    assert not clip_precision.lowered(cpu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert clip_precision.lowered(cpu)


def test_full_precision_inside_and_the_caller_s_settings_after_an_error_too(high):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(KeyError), clip_precision.full_precision(torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.is_autocast_enabled("cpu")
            raise KeyError
        assert torch.is_autocast_enabled("cpu")
    assert torch.get_float32_matmul_precision() == "high"


PER_BACKEND = """
import torch, torch.nn.functional as F
from torch import nn
from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.dp_sgd_step import clipped_gradient_sum
b = torch.backends
b.fp32_precision = "tf32"  # the caller's: every backend's float32 products in TF32
try:
    torch.get_float32_matmul_precision()
    raise SystemExit("torch read the legacy setting beside the per-backend flags")
except RuntimeError:
    pass
seen = []
real = ghost_clipping._sq_norms
def spy(*args):
    seen.append((b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision))
    return real(*args)
ghost_clipping._sq_norms = spy
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
clipped_gradient_sum(model, torch.randn(4, 6), torch.randint(0, 3, (4,)),
                     lambda lo, t, aux: F.cross_entropy(lo, t), 0.5)
assert seen and set(seen) == {("ieee", "ieee")}, seen
assert (b.cuda.matmul.fp32_precision, b.mkldnn.matmul.fp32_precision) == ("tf32", "tf32")
assert b.fp32_precision == "tf32"
print("ok")
"""


def test_the_per_backend_flags_are_raised_and_put_back():
    """Where the caller set torch's per-backend flags (torch then refuses to read the legacy
    setting), the norms run with cuBLAS's and oneDNN's float32 products at IEEE precision, and
    the flags come back to the precision they read (torch reads an inherited flag as its
    parent's). In a process of its own: once written, those flags change what the legacy setting
    may do in every later test."""
    run = subprocess.run(
        [sys.executable, "-c", PER_BACKEND], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_the_norms_and_sums_run_at_full_precision_under_the_caller_s_lowered_products(
    high, monkeypatch
):
    """A ghost-clipped sum with float32 products lowered and autocast on: every layer's norm and
    clipped sum run with the products at float32's precision and autocast off; the caller's
    settings are back after; the sums equal those at full precision (the CPU's products are
    float32 either way)."""
    seen = []
    for name in ("_sq_norms", "_clipped"):
        real = getattr(ghost_clipping, name)

        def spy(*args, real=real):
            seen.append((torch.get_float32_matmul_precision(), torch.is_autocast_enabled("cpu")))
            return real(*args)

        monkeypatch.setattr(ghost_clipping, name, spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(72, 3))
    x, y = torch.randn(5, 3, 5, 5), torch.randint(0, 3, (5,))

    def loss(lo, t, _aux):
        return F.cross_entropy(lo, t)

    lowered = clipped_gradient_sum(model, x, y, loss, 0.5)
    assert seen and set(seen) == {("highest", False)}
    assert torch.get_float32_matmul_precision() == "high"
    torch.set_float32_matmul_precision("highest")
    full = clipped_gradient_sum(model, x, y, loss, 0.5)
    assert all(torch.equal(lowered[k], full[k]) for k in full)
