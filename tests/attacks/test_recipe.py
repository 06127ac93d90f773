"""Recipes and model adapters: scikit-learn, torch and probability callables read the same way."""

import numpy as np
import pytest
import torch
from scipy.special import softmax
from sklearn.linear_model import LogisticRegression

from attacks.experiment import train_models
from attacks.recipe import PROBABILITY_FLOOR, Recipe, as_recipe, model_kind, predict_logits


@pytest.fixture(scope="module")
def blobs():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 90)
    x = rng.normal(size=(90, 4)) + y[:, None]
    return x.astype(np.float32), y


def test_sklearn_columns_follow_classes(blobs):
    x, y = blobs
    sel = y != 1  # trained without class 1: predict_proba has 2 columns, for classes 0 and 2
    clf = LogisticRegression().fit(x[sel], y[sel])
    z = predict_logits(clf, x, n_classes=3)
    p = softmax(z, axis=1)
    np.testing.assert_allclose(p[:, [0, 2]], clf.predict_proba(x), rtol=1e-6)  # float32 inputs
    # the unseen class gets the floor, i.e. probability 0 up to 1e-30
    assert np.all(p[:, 1] <= 2 * PROBABILITY_FLOOR)
    assert model_kind(clf) == "sklearn"


def test_torch_module_gives_its_logits_and_keeps_its_mode(blobs):
    x, _ = blobs
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    ).train()
    z = predict_logits(net, x, n_classes=3)
    net.eval()
    with torch.no_grad():
        expected = net(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(z, expected, rtol=1e-6)  # eval mode: dropout off
    net.train()
    predict_logits(net, x[:5])
    assert net.training and model_kind(net) == "torch"


def test_probability_callable(blobs):
    x, _ = blobs
    x = x.astype(np.float64)
    fn = lambda v: softmax(v[:, :3], axis=1)
    np.testing.assert_allclose(softmax(predict_logits(fn, x, 3), axis=1), fn(x), rtol=1e-12)
    with pytest.raises(
        ValueError, match=r"model\(x\) probabilities must have shape \(90, 4\); found \(90, 3\)"
    ):
        predict_logits(fn, x, 4)
    with pytest.raises(ValueError, match="must be finite and non-negative"):
        predict_logits(lambda v: -np.ones((len(v), 3)), x, 3)
    with pytest.raises(ValueError, match="model must be a scikit-learn classifier"):
        predict_logits(3, x)


def _logreg(x, y, seed):
    return LogisticRegression(C=0.5, random_state=seed).fit(x, y)


def _logreg_many(x, y, index_sets, seeds):
    return [_logreg(x[ix], y[ix], s) for ix, s in zip(index_sets, seeds)]


def test_batched_form_and_loop_agree(blobs):
    x, y = blobs
    rng = np.random.default_rng(1)
    sets = [rng.choice(90, 45, replace=False) for _ in range(3)]
    loop, _ = train_models(_logreg, x, y, sets, [1, 2, 3], n_classes=3)
    batched, _ = train_models(
        Recipe(_logreg, train_many=_logreg_many), x, y, sets, [1, 2, 3], n_classes=3
    )
    np.testing.assert_array_equal(loop, batched)
    assert loop.shape == (3, 90, 3)
    # the models differ because their data differ
    assert not np.allclose(loop[0], loop[1])


def test_recipe_validation():
    with pytest.raises(ValueError, match="train_fn must be callable"):
        Recipe(3)
    with pytest.raises(ValueError, match="recipe must be a callable train_fn"):
        as_recipe("sklearn")
    r = Recipe(_logreg, train_many=lambda *a: [])
    with pytest.raises(ValueError, match="train_many must return one model per index set"):
        r.fit_many(np.zeros((4, 2)), np.zeros(4, int), [np.arange(2)], [0])
    assert as_recipe(r) is r and r.batched and "batched" in repr(r)
