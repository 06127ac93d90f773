"""The small parameters' per-example gradients joined into blocks (``privkit.mechanisms.
ghost_joined``): the same squared norms and clipped sums as taken tensor by tensor, a block per
dtype, and in a model's DP-SGD step the operations it saves (a GroupNorm ResNet's step, counted
as ``benchmarks/step_kernels.py`` counts them)."""

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from privkit.mechanisms import ghost_clipping
from privkit.mechanisms.ghost_joined import JoinedRows


def _entries(b: int = 5):
    g = torch.Generator().manual_seed(0)
    owners = [object(), object(), object()]
    return [
        (owners[0], "weight", torch.randn(b, 4, generator=g), torch.Size([4])),
        (owners[0], "bias", torch.randn(b, 4, generator=g), torch.Size([4])),
        (owners[1], "weight", torch.randn(b, 2, 3, generator=g), torch.Size([2, 3])),
        (owners[2], "bias", torch.randn(b, 7, generator=g, dtype=torch.float64), torch.Size([7])),
    ]


def test_the_blocks_give_each_tensors_norms_and_clipped_sums():
    entries = _entries()
    joined = JoinedRows(entries, 5)
    assert [b.rows.dtype for b in joined.blocks] == [torch.float32, torch.float64]
    c = torch.rand(5, dtype=torch.float64)
    want_sq = sum(rows.reshape(5, -1).double().pow(2).sum(1) for _, _, rows, _ in entries)
    got_sq = sum(part.double() for part in joined.squared_norms())
    torch.testing.assert_close(got_sq, want_sq)
    sums = joined.clipped(c)
    assert len(sums) == len(entries)
    for owner, key, rows, shape in entries:
        got = sums[(id(owner), key)]
        assert got.shape == shape and got.dtype == rows.dtype  # each in its own dtype
        torch.testing.assert_close(got, torch.tensordot(c.to(rows.dtype), rows, dims=1))


def test_nothing_joined_adds_nothing():
    joined = JoinedRows([], 3)
    assert joined.squared_norms() == [] and joined.clipped(torch.ones(3)) == {}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        return func(*args, **(kwargs or {}))


def test_a_groupnorm_models_small_parameters_cost_a_few_operations():
    """Eight GroupNorms and the biases: joined, their norms and clipped sums take a handful of
    operations where each tensor took about four (a square, a sum, an addition, a product)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(6, 6), nn.GroupNorm(2, 6), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(6, 3))
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))

    def losses(logits, s):
        return nn.functional.cross_entropy(logits, y[s], reduction="none")

    ghost_clipping.clipped_sum(model, x, losses, 1.0)  # the first pass' checks
    with _Count() as counted:
        ghost_clipping.clipped_sum(model, x, losses, 1.0)
    with _Count() as unclipped:  # no norms: the plain book-kept sums
        ghost_clipping.clipped_sum(model, x, losses, float("inf"))
    # 25 small tensors (16 GroupNorm, 9 biases), about four operations each tensor by tensor
    # (measured: 49 more when joined, 142 tensor by tensor)
    assert counted.n < unclipped.n + 80, (counted.n, unclipped.n)


def test_the_layers_norms_add_up_in_one_sum_or_one_by_one_across_dtypes():
    """``_added``: parts of one dtype in one stacked sum, parts of several dtypes one by one
    (promoted as the additions promote them); both the parts' sum."""
    g = torch.Generator().manual_seed(1)
    same = [torch.rand(6, generator=g) for _ in range(5)]
    torch.testing.assert_close(ghost_clipping._added(same), sum(same))
    mixed = [same[0], same[1].double()]
    got = ghost_clipping._added(mixed)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, same[0].double() + same[1].double())
