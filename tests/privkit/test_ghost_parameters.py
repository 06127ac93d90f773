"""Bare trainable parameters under ghost clipping (privkit.mechanisms.ghost_parameters) against
torch.func.

A vision transformer's class token and position embedding, a ConvNeXt block's layer scale and a
per-feature scale take per-example stand-ins: norms and clipped sums equal ``torch.func``'s
per-example gradients clipped (float64, every form of ghost clipping's layers). Uses a stand-in
does not follow are refused, each by the check meant for it, and fall back to ``torch.func``: a
forward that fails with the stand-in, one whose outputs it changes, one that gives one example's
row to every example (``P[0]``, and a per-feature scale broadcast over a sequence as long as the
batch), one that reads the parameter itself, not its stand-in. Dropout's random draws are replayed by the check of the outputs, not drawn twice.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from privkit.mechanisms import dp_sgd_step, ghost_clipping, ghost_parameters
from privkit.mechanisms.stacked import UnsupportedModelError
from tests.privkit.test_ghost_clipping import _check, _example_losses, _loss, _reference, falls_back


class VisionTransformer(nn.Module):
    """torchvision's ViT in small: patches by a strided convolution, a class token and a position
    embedding as bare parameters, batch-first pre-norm encoder layers, the class token's head."""

    def __init__(self, d=16, heads=2, patch=4, size=8, classes=3, layers=1, dropout=0.0):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, patch, stride=patch)
        self.class_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embedding = nn.Parameter(0.5 * torch.randn(1, (size // patch) ** 2 + 1, d))
        block = nn.TransformerEncoderLayer(
            d, heads, 2 * d, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.ln(self.encoder(x + self.pos_embedding))[:, 0])


class ConvNeXtBlock(nn.Module):
    """torchvision's ConvNeXt block: depthwise 7x7, LayerNorm over channels, an MLP, and a layer
    scale ``(C, 1, 1)`` on the residual branch."""

    def __init__(self, c=8, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 2, stride=2)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.up, self.down = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.layer_scale = nn.Parameter(torch.rand(c, 1, 1) + 0.5)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        h = self.down(F.gelu(self.up(h))).permute(0, 3, 1, 2)
        return self.head((x + self.layer_scale * h).mean((2, 3)))


class Scaled(nn.Module):
    """A per-feature scale ``(3,)`` on each example's features."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 2)
        self.scale = nn.Parameter(torch.tensor([1.5, 0.5, 1.0]))
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).mean(2) * self.scale)


def _images(b=6):
    return torch.randn(b, 3, 8, 8), torch.randint(0, 3, (b,))


@pytest.mark.parametrize(
    "build", [VisionTransformer, ConvNeXtBlock], ids=["vision-transformer", "convnext"]
)
def test_bare_parameters_of_vision_models(build, monkeypatch):
    torch.manual_seed(20)
    model = build()
    x, y = _images()
    _check(model, x, y, monkeypatch)
    assert ghost_clipping._ROWS_CHECKED[model.double()] is None


def test_a_per_feature_scale(monkeypatch):
    torch.manual_seed(21)
    _check(Scaled(), torch.randn(6, 2, 5), torch.randint(0, 3, (6,)), monkeypatch)


def test_frozen_bare_parameters_take_no_stand_in(monkeypatch):
    """A frozen class token and position embedding are read as they are."""
    torch.manual_seed(22)
    model = VisionTransformer()
    model.class_token.requires_grad_(False)
    model.pos_embedding.requires_grad_(False)
    got = _check(model, *_images(), monkeypatch)
    assert "class_token" not in got and "conv_proj.weight" in got


def takes_ghost_clipping(model, x, y, monkeypatch, loss=_loss):
    """``DpSgdStep``'s clipped sum of ``model`` comes from ghost clipping (no fallback warning,
    torch.func unused) and is that of torch.func's per-example gradients."""
    _, clip, want = _reference(model, x, y, loss)
    monkeypatch.setattr(dp_sgd_step, "per_sample_gradients", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dp_sgd_step.ClippingFallbackWarning)
        got = dp_sgd_step.clipped_gradient_sum(model, x, y, loss, clip)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)


def test_a_vision_transformers_dp_sgd_step_takes_ghost_clipping(monkeypatch):
    torch.manual_seed(23)
    x, y = _images(8)
    takes_ghost_clipping(VisionTransformer().double(), x.double(), y, monkeypatch)


def test_parameters_are_put_back_after_the_pass():
    """After the pass (and after a pass that failed) the module holds its own parameters; an
    input the model's own forward fails on raises the model's own error, and refuses nothing."""
    torch.manual_seed(24)
    model = VisionTransformer()
    token, pos = model.class_token, model.pos_embedding
    x, y = _images()
    ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    assert model.class_token is token and model.pos_embedding is pos
    assert model._parameters["class_token"] is token
    with pytest.raises(RuntimeError, match="size of tensor"):  # 9 patches: the model's own error
        ghost_clipping.clipped_sum(model, torch.randn(6, 3, 12, 12), _example_losses(y), 1.0)
    assert model.class_token is token and model.pos_embedding is pos
    ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)  # not refused for it


def test_dropout_is_replayed_by_the_check_of_the_outputs():
    """The first pass of a model with dropout is checked against its own forward on the same
    random draws (no refusal), and leaves the random state where one pass leaves it."""
    torch.manual_seed(25)
    model = VisionTransformer(dropout=0.3)
    checked = copy.deepcopy(model)
    x, y = _images()
    ghost_clipping.per_example_norms(checked, x, _example_losses(y))  # checked: no more checks
    assert ghost_clipping._ROWS_CHECKED[checked] is None
    torch.manual_seed(26)
    ghost_clipping.per_example_norms(model, x, _example_losses(y))
    after_check = torch.get_rng_state()
    assert ghost_clipping._ROWS_CHECKED[model] is None
    torch.manual_seed(26)
    ghost_clipping.per_example_norms(checked, x, _example_losses(y))
    assert torch.equal(torch.get_rng_state(), after_check)


def test_stand_in_shapes():
    shape = ghost_parameters.stand_in_shape
    assert shape(torch.zeros(1, 5, 4), 3) == shape(torch.zeros(1, 5, 4), 3, 1) == (3, 5, 4)
    assert shape(torch.zeros(4, 1, 1), 3) == (3, 4, 1, 1)
    assert shape(torch.zeros(4), 3) == (3, 4) and shape(torch.zeros(4), 3, 1) == (3, 1, 4)
    assert shape(torch.zeros(()), 3) == (3,) and shape(torch.zeros(()), 3, 1) == (3, 1)


class FirstRow(nn.Module):
    """A bias ``(1, 3)`` read as ``bias[0]``: the same outputs with a stand-in, but every
    example's gradient lands in row 0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bias = nn.Parameter(torch.randn(1, 3))

    def forward(self, x):
        return self.lin(x) + self.bias[0]


class Summed(nn.Module):
    """An offset ``(1, 3)`` summed over its first dimension: a stand-in's sum is ``B`` times it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.offset = nn.Parameter(torch.randn(1, 3))

    def forward(self, x):
        return self.lin(x) + self.offset.sum(0)


class TokenScaled(nn.Module):
    """timm's and DINOv2's layer scale: ``gamma (d,)`` times ``(B, N, d)`` tokens. Its first
    stand-in ``(B, d)`` fails against the tokens, or, where ``N`` equals ``B``, broadcasts wrongly
    (token ``n`` scaled by example ``n``'s row: the row check); the second, ``(B, 1, d)``, is
    right."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gamma = nn.Parameter(torch.rand(4) + 0.5)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head((self.gamma * torch.tanh(self.lin(x))).mean(1))


class Listed(nn.Module):
    """A scale read through a plain list that holds the parameter itself: the stand-in is not
    what the forward reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.rand(3) + 0.5)
        self.scales = [self.scale]

    def forward(self, x):
        return self.lin(x) * self.scales[0]


class ChannelScaled(nn.Module):
    """timm ConvNeXt's layer scale, ``gamma (C,)`` reshaped to ``(1, C, 1, 1)``: no stand-in's
    shape survives the reshape; followed to the batch instead
    (:mod:`privkit.mechanisms.ghost_broadcast`), it meets it in the product."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.gamma = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return (self.conv(x) * self.gamma.reshape(1, -1, 1, 1)).mean((2, 3))


class Convolved(nn.Module):
    """A bare kernel passed to ``F.conv2d``: no stand-in gets through, and following it to the
    batch stops at the convolution."""

    def __init__(self):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(3, 3, 1, 1))

    def forward(self, x):
        return F.conv2d(x, self.kernel).mean((2, 3))


def test_a_reshaped_layer_scale_is_followed_to_the_batch(monkeypatch):
    """Every form of stand-ins fails the forward; the scale followed through its reshape to the
    product with the batch's maps is taken, and kept for the model."""
    torch.manual_seed(30)
    model = ChannelScaled()
    _check(model, torch.randn(5, 3, 4, 4), torch.randint(0, 3, (5,)), monkeypatch)
    assert ghost_clipping._FOLLOWED[model] == {"gamma"}


@pytest.mark.parametrize("tokens", [6, 5], ids=["tokens", "as-many-tokens-as-examples"])
def test_a_layer_scale_on_tokens_takes_the_second_form(tokens, monkeypatch):
    """The first form fails (or, with as many tokens as examples, fails the row check), the
    second is taken and kept for the model."""
    torch.manual_seed(29)
    model = TokenScaled()
    _check(model, torch.randn(5, tokens, 4), torch.randint(0, 3, (5,)), monkeypatch)
    assert ghost_clipping._FORMS[model.double()] == 1


@pytest.mark.parametrize(
    "build, shape, why",
    [
        (Listed, (5, 4), "scale reaches the loss other than through"),
        (FirstRow, (5, 4), "not the batch's examples"),
        (Summed, (5, 4), "other outputs than the model's own"),
        (Convolved, (5, 3, 4, 4), "kernel, followed to where it meets the batch, is used by"),
    ],
    ids=["listed", "first-row", "summed", "kernel-convolved"],
)
def test_uses_a_stand_in_does_not_follow_are_refused_and_fall_back(build, shape, why):
    """Each refused by its check, for this step and every later one, and clipped by
    ``torch.func`` instead."""
    torch.manual_seed(27)
    model = build().double()
    x, y = torch.randn(shape, dtype=torch.float64), torch.randint(0, 3, (5,))
    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match=why):
            ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    falls_back(model, x, y, why)


def test_torchs_own_layers_take_no_stand_ins():
    """torch's own layers read their parameters in their own ways: a PReLU's slopes take their
    own rule, an EmbeddingBag's in ``max`` mode are taken on its call (ghost_layer_vjp), an
    LSTM's through its maps written out (ghost_rnn); none is given stand-ins."""
    torch.manual_seed(28)
    y = torch.randint(0, 3, (6,))
    for model, x, kinds in (
        (nn.Sequential(nn.Linear(4, 3), nn.PReLU()), torch.randn(6, 4), [(False, False)] * 2),
        (
            nn.Sequential(nn.EmbeddingBag(10, 3, mode="max"), nn.Linear(3, 3)),
            torch.randint(0, 10, (6, 4)),
            [(True, False), (False, False)],
        ),
    ):
        layers = ghost_clipping._layers(model)
        assert [(layer.vjp, layer.bare) for layer in layers] == kinds
        ghost_clipping.clipped_sum(model, x, _example_losses(y), 1.0)
    lstm = nn.LSTM(4, 3, batch_first=True)
    layers = ghost_clipping._layers(nn.Sequential(lstm))
    assert layers and all(layer.rnn is lstm and not layer.bare for layer in layers)


def test_a_vision_transformers_dp_sgd_audit_sees_its_bugs(monkeypatch):
    """A ViT's DP-SGD (ghost clipping with stand-ins for its class token and position embedding)
    audited white-box, canaries on every parameter: as claimed it is not a violation, and half
    the noise or clipping switched off are caught, at each of three seeds."""
    from tests.privkit.test_ghost_attention import audit_sees_its_bugs

    def build():
        data = torch.randn(400, 3, 8, 8), torch.randint(0, 2, (400,))
        return VisionTransformer(d=8, classes=2), data

    audit_sees_its_bugs(monkeypatch, build)
