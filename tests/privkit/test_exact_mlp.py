"""The stacked training of many MLPs (:func:`privkit.batched.exact_mlp.train_exact` with
``stacked=True``, an audit's reference runs): models that share their records train exactly as
models holding their own copies, and FedProx's proximal term is the one ``train_exact`` takes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from privkit.batched.exact_mlp import model_for, train_exact
from privkit.models import build_model


def _models(shared: bool, n: int = 5):
    """``n`` models from one template on records of which the first three models hold the same
    array (one tensor when ``shared``, else each its own copy) and the others their own."""
    torch.manual_seed(0)
    template = build_model("mlp", (1, 6, 6), 3, feature_dim=8)
    rng = np.random.default_rng(1)
    common = (rng.normal(size=(23, 36)).astype(np.float32), rng.integers(0, 3, 23))
    own = [
        (rng.normal(size=(17 + j, 36)).astype(np.float32), rng.integers(0, 3, 17 + j))
        for j in range(n)
    ]
    models = []
    for j in range(n):
        x, y = common if j < 3 else own[j]
        if not shared:
            x, y = x.copy(), y.copy()
        models.append(
            model_for(
                copy.deepcopy(template),
                x,
                y,
                epochs=2,
                batch_size=8,
                seed=10 + j,
                device=torch.device("cpu"),
            )
        )
    return template, models


@pytest.mark.parametrize("mu", [0.0, 0.1])
def test_models_sharing_their_records_train_as_with_their_own_copies(mu):
    template, shared = _models(shared=True)
    _, copies = _models(shared=False)
    assert shared[0].x.data_ptr() == shared[1].x.data_ptr()  # one tensor, read by three models
    assert copies[0].x.data_ptr() != copies[1].x.data_ptr()
    anchors = [{k: v.clone() for k, v in m.params.items()} for m in shared]
    kw = dict(
        optimizer="adam", lr=0.01, mu=[mu] * 5, anchors=anchors, loss_from=[0] * 5, stacked=True
    )
    losses_shared = train_exact(template, shared, **kw)
    losses_copies = train_exact(template, copies, **kw)
    assert losses_shared == losses_copies
    for a, b in zip(shared, copies):
        for k in a.params:
            assert torch.equal(a.params[k], b.params[k])
    # and the models trained: each moved from the template, the three on one array differently
    start = dict(template.named_parameters())
    assert all(not torch.equal(m.params["head.weight"], start["head.weight"]) for m in shared)
    assert not torch.equal(shared[0].params["head.weight"], shared[1].params["head.weight"])


def test_stacked_training_follows_the_exact_kernels_up_to_rounding():
    """The stacked form trains every model as the exact kernels do (same batches, losses and
    updates), up to float rounding."""
    template, stacked = _models(shared=True)
    _, exact = _models(shared=True)
    anchors = [{k: v.clone() for k, v in m.params.items()} for m in stacked]
    kw = dict(optimizer="adam", lr=0.01, mu=[0.1] * 5, anchors=anchors, loss_from=[0] * 5)
    got = train_exact(template, stacked, stacked=True, **kw)
    want = train_exact(template, exact, stacked=False, **kw)
    assert got == pytest.approx(want, rel=1e-4)
    for a, b in zip(stacked, exact):
        for k in a.params:
            torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-4, atol=1e-5)
