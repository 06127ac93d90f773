"""privkit.mechanisms.clip_precision: DP-SGD's norms and clipped sums at full precision whatever
the caller set (autocast, ``torch.set_float32_matmul_precision``), the caller's settings put back
after. On a GPU the lowered float32 products are TF32 (no such hardware here): what is checked is
that the norms and sums run with the products at float32's precision and autocast off, and that
every setting comes back, on an error too."""

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


def test_newer_flags_in_use_are_left_as_they_are(monkeypatch):
    """torch refuses to read the legacy setting once its per-backend flags were written: the
    products' precision is then left alone (autocast is still turned off)."""

    def refuse():
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", refuse)
    assert not clip_precision.lowered(torch.device("cpu"))
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        clip_precision.full_precision(torch.device("cpu")),
    ):
        assert not torch.is_autocast_enabled("cpu")


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
