"""Channels-last inference (:mod:`attacks.conv_layout`): the same logits up to float rounding,
and the model given back with the very tensors it held."""

import numpy as np
import pytest
import torch
from torch import nn

from attacks.conv_layout import channels_last_inference
from attacks.recipe import torch_logits
from privkit.models import build_model
from privkit.trainers.common import embed, predict_logits


def _cnn(shape=(3, 16, 16)):
    torch.manual_seed(0)
    return build_model("cnn", shape, 10, width=8, feature_dim=16)


def _tensors(model):
    return [(t.data_ptr(), t.stride(), t.clone()) for t in (*model.parameters(), *model.buffers())]


def _same(model, before) -> bool:
    now = list(zip((*model.parameters(), *model.buffers()), before))
    return all(t.data_ptr() == p and t.stride() == s and torch.equal(t, v) for t, (p, s, v) in now)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 16, 16)])
def test_logits_equal_the_default_layout_s_and_the_model_is_given_back(shape):
    model = _cnn(shape)
    x = np.random.default_rng(0).standard_normal((300, *shape)).astype(np.float32)
    model.eval()
    with torch.no_grad():
        want = model(torch.as_tensor(x)).double().numpy()
    before = _tensors(model)
    got = torch_logits(model, x, batch_size=128)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert _same(model, before)
    np.testing.assert_allclose(predict_logits(model, x, torch.device("cpu")), want, atol=1e-5)
    assert embed(model, x, torch.device("cpu")).shape == (300, 16)
    assert _same(model, before)


def test_inside_the_block_the_weights_are_channels_last_and_an_error_still_gives_them_back():
    model = _cnn()
    before = _tensors(model)
    with pytest.raises(RuntimeError, match="inside"), channels_last_inference(model, "cpu"):
        conv = model.features[0].weight
        assert conv.is_contiguous(memory_format=torch.channels_last)
        assert not conv.is_contiguous()
        raise RuntimeError("inside")
    assert _same(model, before)


def test_a_model_already_channels_last_stays_so():
    model = _cnn().to(memory_format=torch.channels_last)
    before = _tensors(model)
    torch_logits(model, np.zeros((4, 3, 16, 16), np.float32))
    assert _same(model, before)
    assert model.features[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_models_without_convolutions_and_other_devices_are_left_alone():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    cnn = _cnn()
    for model, device in ((mlp, "cpu"), (cnn, "meta")):
        before = [t.stride() for t in model.parameters()]
        with channels_last_inference(model, device):
            assert [t.stride() for t in model.parameters()] == before
