"""Config overrides, seeding, models, device selection (executors: tests/attacks/test_executor.py)."""

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from privkit.config import apply_overrides, load_toml, parse_value
from privkit.data import FederationConfig
from privkit.errors import PrivkitError
from privkit.models import build_from_spec, build_model, model_spec, select_device
from privkit.seeding import child_seeds, derive_seed, make_rng


def test_overrides_parse_as_toml_values():
    out = apply_overrides(
        {"federation": {"alpha": 1.0}},
        ["federation.alpha=0.01", 'methods=["a", "b"]', "flag=true", "name=demo"],
    )
    assert out == {
        "federation": {"alpha": 0.01},
        "methods": ["a", "b"],
        "flag": True,
        "name": "demo",
    }
    assert parse_value("3") == 3 and parse_value("1e-5") == 1e-5


def test_override_errors_name_the_input():
    with pytest.raises(PrivkitError, match="--set expects key=value; found 'alpha'"):
        apply_overrides({}, ["alpha"])
    with pytest.raises(PrivkitError, match="a is not a table"):
        apply_overrides({"a": 1}, ["a.b=2"])


def test_load_toml_errors(tmp_path):
    with pytest.raises(PrivkitError, match="config file not found"):
        load_toml(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("a = [")
    with pytest.raises(PrivkitError, match="malformed config"):
        load_toml(tmp_path / "bad.toml")


def test_federation_config_rejects_bad_values():
    with pytest.raises(ValidationError, match="alpha"):
        FederationConfig(alpha=0)
    with pytest.raises(ValidationError, match="clients"):
        FederationConfig(clients=0)
    with pytest.raises(ValidationError, match="extra"):
        FederationConfig.model_validate({"alpah": 1.0})
    with pytest.raises(ValidationError, match="public_size must be > 0"):
        FederationConfig(public_dataset=None, public_size=0)


def test_child_seeds_are_stable_and_independent():
    a = child_seeds(1, 4, "shadow")
    assert a == child_seeds(1, 4, "shadow")  # same inputs, same seeds
    assert child_seeds(1, 5, "shadow")[:4] == a  # adding a task does not shift the others
    assert a != child_seeds(1, 4, "client") and len(set(a)) == 4
    assert derive_seed(1, "x") == child_seeds(1, 1, "x")[0]
    assert make_rng(3, "p").random() == make_rng(3, "p").random()


@pytest.mark.parametrize(
    "arch, shape", [("cnn", (1, 28, 28)), ("cnn", (3, 32, 32)), ("mlp", (1, 8, 8))]
)
def test_models_are_features_plus_linear_head(arch, shape):
    m = build_model(arch, shape, 10, width=4, feature_dim=16)
    x = torch.zeros(2, *shape)
    assert m(x).shape == (2, 10) and m.embed(x).shape == (2, 16)
    assert torch.allclose(m(x), m.head(m.features(x)))
    spec = model_spec(arch, shape, 10, width=4, feature_dim=16)
    clone = build_from_spec(spec)
    clone.load_state_dict(m.state_dict())
    assert torch.equal(clone(x), m(x))


def test_model_errors():
    with pytest.raises(PrivkitError, match="arch must be one of cnn, mlp; found 'resnet'"):
        build_model("resnet", (1, 28, 28), 10)
    with pytest.raises(PrivkitError, match="cnn needs inputs of at least 8x8; found 4x4"):
        build_model("cnn", (1, 4, 4), 10)


def test_device_selection():
    assert select_device("cpu").type == "cpu"
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(PrivkitError, match="device must be auto, cpu or cuda; found 'tpu'"):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(PrivkitError, match="torch sees no GPU"):
            select_device("cuda")


def test_a_cuda_device_turns_cudnn_autotuning_off(monkeypatch):
    """Poisson batches change size every step: cudnn's autotuner would re-tune every convolution
    each step, so selecting a GPU switches it off (and the CPU leaves the setting alone)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert select_device("cpu").type == "cpu" and torch.backends.cudnn.benchmark
    assert select_device("cuda:0") == torch.device("cuda:0")
    assert torch.backends.cudnn.benchmark is False
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert select_device("auto").type == "cuda" and torch.backends.cudnn.benchmark is False


def test_cli_json_is_strict_for_infinite_epsilons(capsys):
    import json
    import math

    from privkit.cli.app import print_json

    print_json({"best": math.inf, "rows": [1.5, -math.inf, float("nan")], "n": np.int64(3)})
    text = capsys.readouterr().out

    def reject(token):
        raise ValueError(token)

    out = json.loads(text, parse_constant=reject)  # strict: no bare Infinity/NaN tokens
    assert out == {"best": "Infinity", "rows": [1.5, "-Infinity", "NaN"], "n": 3}
    assert float(out["best"]) == math.inf


def test_cnn_trains_channels_last_and_ends_in_the_default_layout():
    """train_supervised runs a convolutional model in channels-last layout (faster pooling on the
    CPU) and hands it back in the default layout; the weights are those of the same SGD steps taken
    in the default layout, up to the convolutions' summation order."""
    import copy

    import torch.nn.functional as F

    from privkit.seeding import torch_generator
    from privkit.trainers.common import minibatches, train_supervised

    torch.manual_seed(0)
    model = build_model("cnn", (1, 12, 12), 4, width=4, feature_dim=8)
    ref, init = copy.deepcopy(model), copy.deepcopy(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 1, 12, 12)).astype(np.float32)
    y = rng.integers(0, 4, size=40)
    train_supervised(
        model, x, y, epochs=2, batch_size=16, lr=0.1, device=torch.device("cpu"), seed=3,
        optimizer="sgd",
    )  # fmt: skip
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen, xt, yt = torch_generator(3), torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(2):
        for idx in minibatches(40, 16, gen):
            opt.zero_grad()
            F.cross_entropy(ref(xt[idx]), yt[idx]).backward()
            opt.step()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.is_contiguous(), name
        torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)
    assert not torch.equal(model.features[0].weight, init.features[0].weight)  # it trained
