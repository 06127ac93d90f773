"""Layers whose weight a parametrization computes (privkit.mechanisms.ghost_parametrized): weight
normalisation, orthogonal weights, spectral normalisation and a standardisation of the user's own,
on linear layers and 1-d, 2-d and 3-d convolutions, once or twice a pass, on sequences.

Their norms and clipped sums equal ``torch.func``'s per-example gradients of the parametrization's
tensors (float64, every way of the other layers' norms; clipping off is the plain sum); DP-SGD's
step takes the path without fallback and reports the parametrization's tensors by their names; a
spectral normalisation's power iteration runs once a step, as in plain training; what is not
taken (a parametrized bias, a parametrized layer of another kind, a subclass with its own forward,
the old ``weight_norm`` hook) falls back to ``torch.func``.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import orthogonal, spectral_norm, weight_norm

from privkit.mechanisms import dp_sgd_step, ghost_clipping
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, _loss, falls_back


class Standardised(nn.Module):
    """Weight standardisation (each output unit's weights less their mean, over their standard
    deviation), as a parametrization: the weight reads its tensor three times."""

    def forward(self, w):
        dims = tuple(range(1, w.dim()))
        mean, var = w.mean(dims, keepdim=True), w.var(dims, keepdim=True, unbiased=False)
        return (w - mean) / torch.sqrt(var + 1e-5)


def standardised(layer: nn.Module) -> nn.Module:
    parametrize.register_parametrization(layer, "weight", Standardised())
    return layer


class Twice(nn.Module):
    """A standardised convolution run twice a pass (a block shared across depth)."""

    def __init__(self):
        super().__init__()
        self.conv = standardised(nn.Conv2d(2, 2, 3, padding=1))
        self.head = nn.Linear(2 * 36, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))).flatten(1))


class OnSequences(nn.Module):
    """A weight-normalised linear layer on sequences, mean-pooled."""

    def __init__(self):
        super().__init__()
        self.lin = weight_norm(nn.Linear(4, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)).mean(1))


def _spectral_eval():
    model = nn.Sequential(spectral_norm(nn.Linear(5, 8)), nn.Tanh(), nn.Linear(8, 3))
    model(torch.randn(4, 5))  # a few power iterations, then frozen (eval: no more)
    return model.eval()


CASES = {
    "weight-norm-linear": (
        lambda: nn.Sequential(weight_norm(nn.Linear(5, 8)), nn.Tanh(), nn.Linear(8, 3)),
        (7, 5),
    ),
    "weight-norm-conv2d": (
        lambda: nn.Sequential(
            weight_norm(nn.Conv2d(2, 4, 3)), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)
        ),
        (7, 2, 6, 6),
    ),
    "orthogonal-linear": (
        lambda: nn.Sequential(orthogonal(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 3)),
        (7, 8),
    ),
    "spectral-norm-eval": (_spectral_eval, (7, 5)),
    "standardised-conv1d": (
        lambda: nn.Sequential(
            standardised(nn.Conv1d(2, 4, 3)), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3)
        ),
        (7, 2, 6),
    ),
    "standardised-conv3d-no-bias": (
        lambda: nn.Sequential(
            standardised(nn.Conv3d(2, 3, 2, bias=False)),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(3 * 27, 3),
        ),
        (7, 2, 4, 4, 4),
    ),
    "standardised-conv2d-twice": (Twice, (7, 2, 6, 6)),
    "weight-norm-on-sequences": (OnSequences, (7, 5, 4)),
}


def _built(case: str):
    torch.manual_seed(sorted(CASES).index(case))
    build, shape = CASES[case]
    return build(), torch.randn(shape), torch.randint(0, 3, (shape[0],))


@pytest.mark.parametrize("case", sorted(CASES))
def test_parametrized_layers_against_torch_func(case, monkeypatch):
    model, x, y = _built(case)
    layers = [layer for layer in ghost_clipping._layers(model) if layer.parametrized]
    assert len(layers) == 1
    got = _check(model, x, y, monkeypatch)
    tensors = {k for k, p in model.named_parameters() if ".parametrizations.weight." in k}
    assert tensors and tensors <= set(got)
    plain = ghost_clipping.clipped_sum(model, x.double(), _example_losses(y), float("inf"))
    per = dp_sgd_step.per_sample_gradients(model, x.double(), y, _loss)
    for k, g in per.items():
        torch.testing.assert_close(plain[k], g.sum(0), rtol=1e-10, atol=1e-12, msg=k)


def test_dp_sgd_takes_the_path():
    """No fallback; the parametrization's tensors move (weight normalisation's direction and
    magnitude), and a frozen magnitude with a trainable bias is taken too."""
    model, x, y = _built("weight-norm-linear")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = dp_sgd_step.DpSgdStep(1.0, 0.0, 7 / 100, 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dp_sgd_step.ClippingFallbackWarning)
        step.apply(model, opt, x, y, lambda lo, t, a: F.cross_entropy(lo, t), torch.Generator())
        model[0].parametrizations.weight.original0.requires_grad_(False)
        model[0].parametrizations.weight.original1.requires_grad_(False)
        got = dp_sgd_step.clipped_gradient_sum(model, x, y, _loss, 1.0)
    for k in ("0.parametrizations.weight.original0", "0.parametrizations.weight.original1"):
        assert not torch.equal(dict(model.named_parameters())[k], before[k]), k
    assert set(got) == {"0.bias", "2.weight", "2.bias"}


def test_a_spectral_normalisation_iterates_once_a_step():
    """In training mode the weight is computed once a pass (``parametrize.cached``): the power
    iteration's vectors move as one plain forward pass moves them, and the norms and sums equal
    autograd's one example at a time with those vectors frozen."""
    torch.manual_seed(3)
    model = nn.Sequential(spectral_norm(nn.Linear(5, 8)), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    norm = model[0].parametrizations.weight[0]
    start = (norm._u.clone(), norm._v.clone())
    with torch.no_grad():
        model(x)  # one plain pass: one power iteration
    once = (norm._u.clone(), norm._v.clone())
    norm._u.copy_(start[0])
    norm._v.copy_(start[1])
    norms = ghost_clipping.per_example_norms(model, x, _example_losses(y))
    assert torch.equal(norm._u, once[0]) and torch.equal(norm._v, once[1])
    model.eval()  # the vectors as the pass left them: the weight the pass used
    per = dp_sgd_step.per_sample_gradients(model, x, y, _loss)
    want = sum(g.reshape(7, -1).pow(2).sum(1) for g in per.values()).sqrt()
    torch.testing.assert_close(norms, want, rtol=1e-10, atol=1e-12)


class OwnForward(nn.Linear):
    """A linear layer with a forward of its own."""

    def forward(self, x):
        return super().forward(2 * x)


def _parametrized_bias():
    layer = nn.Linear(5, 3)
    parametrize.register_parametrization(layer, "bias", nn.Tanh())
    return layer


def _old_weight_norm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        return nn.utils.weight_norm(nn.Linear(5, 3))


@pytest.mark.parametrize(
    "build, why",
    [
        (_parametrized_bias, "parametrized bias"),
        (lambda: weight_norm(nn.Embedding(10, 5)), "other than a linear layer or a convolution"),
        (lambda: weight_norm(OwnForward(5, 3)), "overrides Linear's forward"),
        (_old_weight_norm, "trainable parameters of Linear are not covered"),
    ],
    ids=["bias", "embedding", "own-forward", "old-weight-norm"],
)
def test_what_is_not_taken_falls_back(build, why):
    torch.manual_seed(4)
    layer = build()
    embedding = isinstance(layer, nn.Embedding)
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(3)) if embedding else layer
    x = torch.randint(0, 10, (6, 2)) if embedding else torch.randn(6, 5)
    model(x)  # the lazy layer's shape
    y = torch.randint(0, 3, (6,))
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    falls_back(model.double(), x.double() if not embedding else x, y, why)


@pytest.mark.parametrize("precision", ["autocast", "bfloat16"])
def test_an_example_alone_contributes_the_clip_norm_in_half_precision(precision):
    """A weight-normalised convolution under bfloat16 autocast and held in bfloat16: one record
    alone clipped to the clip norm, its norm and contribution from the same float32 values."""
    from tests.privkit.test_ghost_layer_vjp import each_record_alone_is_clipped_to_the_norm

    model, x, y = _built("weight-norm-conv2d")
    each_record_alone_is_clipped_to_the_norm(model, x, y, precision)


class ReadElsewhere(nn.Module):
    """A weight-normalised layer whose magnitude the model also reads outside it: its gradient
    has a path the layer's calls do not see."""

    def __init__(self):
        super().__init__()
        self.lin = weight_norm(nn.Linear(5, 3))

    def forward(self, x):
        return self.lin(x) * self.lin.parametrizations.weight.original0.sum()


def test_a_parametrization_tensor_read_outside_the_layer_is_refused():
    torch.manual_seed(5)
    model = ReadElsewhere().double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    why = "original0 reaches the loss other than through its layer's one call"
    with pytest.raises(UnsupportedModelError, match=why):
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    falls_back(model, x, y, why)
