"""Log-softmax and cross-entropy over stacked models' class axis
(:mod:`privkit.batched.class_axis`): torch's values and gradients, to float rounding, on tensors
of either path (the two-kernel form on large CPU tensors, torch's fused kernel on small ones)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from privkit.batched import class_axis


@pytest.mark.parametrize("shape", [(80, 45, 10), (3, 7, 10), (40, 33, 100)])
def test_log_softmax_and_cross_entropy_are_torchs(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    z = (torch.randn(*shape, generator=gen) * 4).requires_grad_(True)
    y = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    weights = torch.rand(shape[:-1], generator=gen)
    assert (z.numel() >= class_axis.SMALL) == (shape != (3, 7, 10))  # both paths are covered

    got = class_axis.log_softmax(z)
    want = F.log_softmax(z, dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    (g_got,) = torch.autograd.grad((got * got.detach().exp()).sum(), z)
    (g_want,) = torch.autograd.grad((want * want.detach().exp()).sum(), z)
    # gradients of size up to 1 from logits of size up to ~15: float32 rounding of ~1e-6
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=3e-6)

    ce = class_axis.cross_entropy(z, y)
    ref = F.cross_entropy(z.reshape(-1, shape[-1]), y.reshape(-1), reduction="none").view(y.shape)
    assert ce.shape == y.shape
    torch.testing.assert_close(ce, ref, rtol=0, atol=2e-6)
    (c_got,) = torch.autograd.grad((ce * weights).sum(), z)
    (c_want,) = torch.autograd.grad((ref * weights).sum(), z)
    torch.testing.assert_close(c_got, c_want, rtol=1e-5, atol=3e-6)


def test_extreme_logits_stay_finite():
    """Logits of 1e4 and -1e4 (a diverged model): both forms subtract the row's maximum, so no
    exponential overflows."""
    z = torch.tensor([[1e4, -1e4, 0.0] * 2000]).reshape(1, 2000, 3)
    y = torch.zeros(1, 2000, dtype=torch.long)
    assert z.numel() >= class_axis.SMALL
    assert torch.isfinite(class_axis.log_softmax(z)).all()
    torch.testing.assert_close(class_axis.cross_entropy(z, y), torch.zeros(1, 2000))


@pytest.mark.parametrize("dim", [0, 1, -2, 2, -1])
def test_log_softmax_along_any_axis_is_torchs(dim):
    """Along an axis other than the last (the transposed head's logits, classes on axis 1),
    ``log_softmax`` is torch's kernel itself; along the last, the two-kernel form as above."""
    z = torch.randn(16, 10, 32, generator=torch.Generator().manual_seed(dim + 5)) * 4
    assert z.numel() >= class_axis.SMALL
    got = class_axis.log_softmax(z, dim)
    want = F.log_softmax(z, dim=dim)
    if dim % 3 != 2:
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
