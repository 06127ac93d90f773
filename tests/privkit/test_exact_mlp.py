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
        models.append(_model(template, x, y, 10 + j))
    return template, models


def _model(template, x, y, seed: int, soft: bool = False):
    """A copy of ``template`` on ``(x, y)``: two epochs of batches of 8 drawn for ``seed``."""
    return model_for(
        copy.deepcopy(template),
        x,
        y,
        epochs=2,
        batch_size=8,
        seed=seed,
        device=torch.device("cpu"),
        soft=soft,
    )


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


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("mu", [[0.0] * 4, [0.1] * 4, [0.0, 0.1, 0.2, 0.1]])
def test_every_head_form_follows_the_exact_kernels_up_to_rounding(depth, soft, mu):
    """Below a hidden layer the stacked head holds its weights as (classes, inputs) and takes its
    logits transposed; a head that is the first layer is held like the others. Either way, with
    labels or soft targets (distillation's KL), one proximal factor or several, every model
    trains as the exact kernels train it, loss totals included, up to float rounding."""
    rng = np.random.default_rng(depth)
    data = []
    for j in range(4):
        x = rng.normal(size=(15 + 3 * j, 36)).astype(np.float32)
        y = (
            np.exp(rng.normal(size=(len(x), 3))).astype(np.float32)
            if soft
            else rng.integers(0, 3, len(x))
        )
        data.append((x, y / y.sum(1, keepdims=True) if soft else y))

    def models():
        torch.manual_seed(0)
        # without a hidden layer the head reads the 36 inputs themselves
        template = build_model("mlp", (1, 6, 6), 3, feature_dim=8 if depth else 36, depth=depth)
        return template, [_model(template, x, y, 10 + j, soft) for j, (x, y) in enumerate(data)]

    template, stacked = models()
    _, exact = models()
    anchors = [{k: v.clone() + 0.01 for k, v in m.params.items()} for m in stacked]
    kw = dict(optimizer="adam", lr=0.01, mu=mu, anchors=anchors, loss_from=[2] * 4)
    got = train_exact(template, stacked, stacked=True, **kw)
    want = train_exact(template, exact, stacked=False, **kw)
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(stacked, exact):
        moved = max(float((a.params[k] - m0).abs().max()) for k, m0 in anchors[0].items())
        assert moved > 1e-3
        for k in a.params:
            torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-5, atol=1e-6)


def _sparse_models(seed: int):
    """Five models on records whose inputs are 0 in every record of a model (a different set per
    model, 10-20 of 36, as MNIST's clients leave a third of the pixels blank)."""
    template, models = _models(shared=False)
    gen = torch.Generator().manual_seed(seed)
    for m in models:
        blank = torch.randperm(36, generator=gen)[
            : 10 + int(torch.randint(0, 11, (), generator=gen))
        ]
        m.x[:, blank] = 0.0
    return template, models


@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("mu", [0.0, 0.1])
def test_inputs_no_record_uses_keep_their_weights_and_the_rest_train_as_exactly(
    monkeypatch, optimizer, mu, chunk
):
    """The stacked form trains each model's first layer over the inputs its records use (a
    chunk of models over as many as its widest model needs): the weights of the others stay bit
    for bit where they were, and every weight follows the exact kernels (which train all inputs)
    up to rounding; a proximal anchor that differs from the start at an unused input makes that
    input train (its term's gradient is not zero there)."""
    import privkit.batched.exact_mlp as exact_mlp

    widths: list[int] = []
    pick = exact_mlp._pick_rows
    monkeypatch.setattr(
        exact_mlp,
        "_pick_rows",
        lambda first, rows, used, out=None: (
            (used is not None and widths.append(used.shape[1])) or pick(first, rows, used, out)
        ),
    )
    if chunk is not None:  # chunks of two models: three chunks, of different widths
        monkeypatch.setattr(exact_mlp, "_models_per_chunk", lambda *a: chunk)
    template, stacked = _sparse_models(3)
    _, exact = _sparse_models(3)
    anchors = [{k: v.clone() for k, v in m.params.items()} for m in stacked]
    anchors[4]["features.1.weight"][:, :] += 0.05  # model 4's anchor differs everywhere
    start = [{k: v.clone() for k, v in m.params.items()} for m in stacked]
    kw = dict(optimizer=optimizer, lr=0.01, mu=[mu] * 5, anchors=anchors, loss_from=[0] * 5)
    got = train_exact(template, stacked, stacked=True, **kw)
    want = train_exact(template, exact, stacked=False, **kw)
    assert got == pytest.approx(want, rel=1e-4)
    for j, (a, b) in enumerate(zip(stacked, exact)):
        for k in a.params:
            torch.testing.assert_close(a.params[k], b.params[k], rtol=1e-4, atol=1e-5)
        unused = (a.x != 0).sum(0) == 0
        w, w0 = a.params["features.1.weight"], start[j]["features.1.weight"]
        assert 10 <= int(unused.sum()) <= 20
        if mu > 0 and j == 4:  # pulled towards its anchor at every input
            assert not torch.equal(w[:, unused], w0[:, unused])
        else:
            assert torch.equal(w[:, unused], w0[:, unused])
        assert not torch.equal(w[:, ~unused], w0[:, ~unused])
    if mu == 0:  # narrowed: per chunk, to its widest model's inputs
        used = [int(((m.x != 0).sum(0) != 0).sum()) for m in stacked]
        assert len(widths) == (1 if chunk is None else 3) and max(widths) == max(used)
        assert chunk is None or len(set(widths)) > 1
    else:  # model 4 needs every input: no narrowing
        assert widths == []


def test_stacked_logits_are_each_modules_own_forward():
    """One batched product per layer gives each MLP's own logits up to float rounding (a deep
    and a shallow architecture; more models than one chunk); another architecture is refused."""
    from privkit.batched.exact_mlp import stacked_logits
    from privkit.mechanisms.stacked import UnsupportedModelError
    from privkit.trainers.common import predict_logits

    dense = np.random.default_rng(2).normal(size=(31, 1, 6, 6)).astype(np.float32)
    blank = dense.copy()
    blank[:, :, 0, :] = 0.0  # inputs 0 in every record: left out of the first layer's products
    for depth, x in ((1, dense), (2, dense), (1, blank), (2, blank)):
        torch.manual_seed(depth)
        models = [build_model("mlp", (1, 6, 6), 4, feature_dim=8, depth=depth) for _ in range(7)]
        got = stacked_logits(models, x, torch.device("cpu"), chunk=3)
        assert got.shape == (7, 31, 4)
        for m, g in zip(models, got):
            want = predict_logits(m, x, torch.device("cpu"))
            np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-6)
    other = build_model("mlp", (1, 6, 6), 4, feature_dim=5)
    with pytest.raises(UnsupportedModelError, match="one architecture"):
        stacked_logits([models[0], other], x, torch.device("cpu"))


def test_reference_runs_parties_are_evaluated_stacked_as_one_by_one(monkeypatch):
    """FedMD's record of an audit's reference runs after their last round (stacked evaluation,
    runs with equal test sets together) gives every party's accuracy as its own evaluation does;
    an exact run evaluates its own parties; a reference run records nothing before its last
    round."""
    from privkit.batched import many_fedmd
    from privkit.data import FederationConfig, build_federation
    from privkit.trainers.fedmd import FedMDRun

    fed = build_federation(FederationConfig(partition="dirichlet", clients=4, seed=0))
    cfg_dict = {
        "arch": "mlp",
        "feature_dim": 16,
        "rounds": 0,  # round 0 (after the initialisation) is the last
        "public_subset": 50,
        "device": "cpu",
        "reproducible_noise": True,
    }
    from privkit.methods.contract import make_config

    cfg = make_config("fedmd-np", cfg_dict)

    def runs():
        out = [FedMDRun(fed, cfg, s, "np", pretrain=False) for s in (1, 2, 3)]
        for r in out:
            r.start()
        return out

    one_by_one, stacked = runs(), runs()
    for r in one_by_one:
        r.record()
    calls = []
    real = many_fedmd.stacked_logits
    monkeypatch.setattr(
        many_fedmd,
        "stacked_logits",
        lambda models, *a: calls.append(len(models)) or real(models, *a),
    )
    many_fedmd.record(stacked, [True, True, False])
    # the two reference runs' parties, an architecture at a time for both runs at once
    archs = {many_fedmd.architecture(m) for m in stacked[0].models}
    assert sum(calls) == 2 * len(stacked[0].models) and len(calls) == len(archs)
    assert all(c >= 2 for c in calls)
    for a, b in zip(one_by_one, stacked):
        assert len(b.rounds) == 1
        np.testing.assert_allclose(
            b.rounds[0]["client_accuracy"], a.rounds[0]["client_accuracy"], atol=1e-9
        )
        assert b.rounds[0]["test_accuracy"] == pytest.approx(a.rounds[0]["test_accuracy"])
    early = FedMDRun(
        fed, make_config("fedmd-np", {**cfg_dict, "rounds": 1}), 1, "np", pretrain=False
    )
    early.start()
    many_fedmd.record([early], [True])
    assert early.rounds == []


def test_stacked_party_logits_are_each_partys_own():
    """The shared logits of an audit's reference runs' parties (one stacked pass per
    architecture) are each party's own forward pass up to float rounding."""
    from privkit.batched.many_fedmd import stacked_party_logits
    from privkit.trainers.common import predict_logits

    torch.manual_seed(5)
    models = [build_model("mlp", (1, 6, 6), 4, feature_dim=f) for f in (8, 5, 8, 5, 8)]
    x = np.random.default_rng(3).normal(size=(13, 1, 6, 6)).astype(np.float32)
    got = stacked_party_logits(models, x)
    for m, g in zip(models, got):
        assert g.dtype == np.float32 and g.shape == (13, 4)
        np.testing.assert_allclose(
            g, predict_logits(m, x, torch.device("cpu")), rtol=1e-5, atol=1e-6
        )


def test_architectures_are_found_once_per_model(monkeypatch):
    """FedMD's batched phases read each party model's architecture from one walk per model
    (``Architectures``): an MLP's is ``architecture``'s, a CNN's ``of`` None (no MLP kernels)
    and its ``form`` the stacked CNN kernels', and a model met again is not walked again; the
    stacked party logits group by it as before."""
    from privkit.batched import many_fedmd

    torch.manual_seed(2)
    mlps = [build_model("mlp", (1, 6, 6), 4, feature_dim=f) for f in (8, 5, 8)]
    cnn = build_model("cnn", (1, 8, 8), 4, width=2, feature_dim=6)
    walks = []
    real = many_fedmd.architecture
    monkeypatch.setattr(many_fedmd, "architecture", lambda m: walks.append(m) or real(m))
    kinds = many_fedmd.Architectures()
    for _ in range(3):
        assert [kinds.of(m) for m in mlps] == [real(m) for m in mlps]
        assert kinds.of(cnn) is None
        assert kinds.form(cnn) == ("stacked", type(cnn).__qualname__, real(cnn))
    assert len(walks) == len(mlps) + 1  # once per model
    x = np.random.default_rng(4).normal(size=(7, 1, 6, 6)).astype(np.float32)
    fresh = many_fedmd.stacked_party_logits(mlps, x)
    kept = many_fedmd.stacked_party_logits(mlps, x, kinds)
    assert len(walks) == 2 * len(mlps) + 1  # the fresh call walked each again; the kept one none
    for a, b in zip(fresh, kept):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mu", [0.0, 0.1])
def test_buffers_kept_across_calls_give_each_call_its_fresh_result(mu):
    """A caller that trains every round keeps the stacked form's buffers (``scratch``) across its
    calls: rounds of other sizes (models, records, inputs in use, batch widths) reuse them and
    each comes out bit for bit as with fresh buffers, the stale contents of a larger round
    included."""
    rounds = [_sparse_models(3), _models(shared=True, n=2), _sparse_models(4), _models(False, 4)]
    fresh = [_sparse_models(3), _models(shared=True, n=2), _sparse_models(4), _models(False, 4)]
    scratch: dict = {}
    for (template, kept), (_, new) in zip(rounds, fresh):
        n = len(kept)
        anchors = [{k: v.clone() for k, v in m.params.items()} for m in kept]
        kw = dict(optimizer="adam", lr=0.01, mu=[mu] * n, anchors=anchors, loss_from=[0] * n)
        got = train_exact(template, kept, stacked=True, scratch=scratch, **kw)
        want = train_exact(template, new, stacked=True, **kw)
        assert got == want
        for a, b in zip(kept, new):
            for k in a.params:
                assert torch.equal(a.params[k], b.params[k]), k
    assert scratch  # the buffers were kept


def _uneven_models():
    """Five models of 9-41 records (4-12 steps of 8 over two epochs), blank inputs per model."""
    torch.manual_seed(2)
    template = build_model("mlp", (1, 6, 6), 3, feature_dim=8)
    rng = np.random.default_rng(4)
    models = []
    for j, n in enumerate((9, 17, 23, 30, 41)):
        x = rng.normal(size=(n, 36)).astype(np.float32)
        x[:, rng.choice(36, 8 + j, replace=False)] = 0.0
        models.append(
            model_for(
                copy.deepcopy(template),
                x,
                rng.integers(0, 3, n),
                epochs=2,
                batch_size=8,
                seed=20 + j,
                device=torch.device("cpu"),
            )
        )
    return template, models


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("mu", [0.0, 0.1])
def test_models_trained_a_chunk_at_a_time_equal_all_at_once(monkeypatch, optimizer, mu):
    """The stacked form trains its models a cache-sized chunk at a time, each chunk through all
    of its steps: chunks of one, two and three models (models of 9-41 records, so of 4-12 steps,
    blank inputs, a proximal term) give each model the weights and loss total of
    one chunk of all of them up to the last bits (1.5e-8 measured: a kernel's vector and scalar
    paths can round differently with a tensor's size)."""
    import privkit.batched.exact_mlp as exact_mlp

    results = {}
    for chunk in (5, 1, 2, 3):
        template, models = _uneven_models()
        anchors = [{k: v.clone() + 0.01 for k, v in m.params.items()} for m in models]
        monkeypatch.setattr(exact_mlp, "_models_per_chunk", lambda *a, c=chunk: c)
        totals = train_exact(
            template,
            models,
            optimizer=optimizer,
            lr=0.01,
            mu=[mu] * 5,
            anchors=anchors,
            loss_from=[1] * 5,
            stacked=True,
        )
        results[chunk] = (totals, [{k: v.clone() for k, v in m.params.items()} for m in models])
    want_totals, want_params = results[5]
    assert sorted({len(m.batches) for m in _uneven_models()[1]}) == [4, 6, 8, 12]
    for chunk, (totals, params) in results.items():
        assert totals == pytest.approx(want_totals, rel=1e-6), chunk
        for got, want in zip(params, want_params):
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_a_chunk_holds_as_many_models_as_fit_its_bytes(monkeypatch):
    """Models per chunk: as many as fit the byte budget (weights read, gradients and two
    moments of the trainable ones, records, one step's activations), at least one, at most all."""
    import privkit.batched.exact_mlp as exact_mlp

    p = {"w": torch.zeros(10, 36, 8), "b": torch.zeros(10, 8)}  # 296 parameters a model
    xs = torch.zeros(10 * 20, 36)  # 20 records of 36 inputs a model
    per_model = 4 * (4 * 296 + 20 * 36 + 8 * (8 + 8))  # float32 bytes
    for models, budget in ((1, 1), (1, per_model), (3, 3 * per_model + 1), (10, 10**9)):
        monkeypatch.setattr(exact_mlp, "CHUNK_BYTES", budget)
        assert exact_mlp._models_per_chunk(p, ["w", "b"], 8, xs, 10, 8 + 8) == models


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("mu", [0.0, 0.1])
def test_models_starting_from_one_global_model_train_as_copies_of_it(stacked, mu):
    """A run's clients start from its global model itself (``Model.start``), not from copies of
    it in their own modules: each model's trained parameters and loss total equal, bit for bit,
    those of the same model holding a copy; what its module held before is never read (filled
    with noise here), and every parameter of it is written."""
    results = []
    for shared in (False, True):
        template, models = _uneven_models()
        if shared:
            start = {k: q.detach() for k, q in template.named_parameters()}
            for m in models:
                for q in m.params.values():
                    q.normal_()
                m.start = start
        anchors = [{k: q.detach() + 0.01 for k, q in template.named_parameters()} for _ in models]
        totals = train_exact(
            template,
            models,
            optimizer="adam",
            lr=0.01,
            mu=[mu] * 5,
            anchors=anchors,
            loss_from=[1] * 5,
            stacked=stacked,
        )
        results.append((totals, [{k: v.clone() for k, v in m.params.items()} for m in models]))
    (want_totals, want_params), (totals, params) = results
    assert totals == want_totals
    for got, want in zip(params, want_params):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("chunk", [None, 2])
def test_models_starting_from_their_anchor_train_as_with_an_equal_copy_of_it(monkeypatch, chunk):
    """FedProx's reference clients start from their run's global model, which is also their
    proximal anchor (``Model.start is anchors[j]``): the stacked form then copies each chunk's
    narrowed starts as its anchors instead of picking the anchors apart. Bit for bit the
    training of the same models whose anchor is an equal copy, and up to rounding the exact
    kernels' (records that leave inputs unused: narrowed first layers; chunks of two)."""
    import privkit.batched.exact_mlp as exact_mlp

    if chunk is not None:
        monkeypatch.setattr(exact_mlp, "_models_per_chunk", lambda *a: chunk)
    results = []
    for same, stacked in ((True, True), (False, True), (False, False)):
        template, models = _sparse_models(5)
        globals_ = [
            {k: q.detach() + 0.02 * r for k, q in template.named_parameters()} for r in range(2)
        ]
        anchors = []
        for j, m in enumerate(models):
            m.start = globals_[j % 2]  # two runs' global models
            anchors.append(m.start if same else {k: q.clone() for k, q in m.start.items()})
        totals = train_exact(
            template,
            models,
            optimizer="adam",
            lr=0.01,
            mu=[0.1] * 5,
            anchors=anchors,
            loss_from=[1] * 5,
            stacked=stacked,
        )
        results.append((totals, [{k: v.clone() for k, v in m.params.items()} for m in models]))
    (from_anchor, p_anchor), (copied, p_copied), (exact, p_exact) = results
    assert from_anchor == copied and from_anchor == pytest.approx(exact, rel=1e-4)
    for a, b, c in zip(p_anchor, p_copied, p_exact):
        for k in a:
            assert torch.equal(a[k], b[k]), k
            torch.testing.assert_close(a[k], c[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n, batch_size", [(23, 8), (24, 8), (5, 8), (1, 1), (0, 4)])
def test_a_models_batches_are_the_draws_of_minibatches(n, batch_size):
    """``model_for`` keeps each epoch's permutation whole (the stacked form reads them so); the
    batches, step count and sizes it gives are those ``train_supervised`` draws with
    ``minibatches`` for the seed: one permutation per epoch, cut with the last batch partial."""
    from privkit.errors import PrivkitError
    from privkit.seeding import torch_generator
    from privkit.trainers.common import minibatches

    template = build_model("mlp", (1, 6, 6), 3, feature_dim=8)
    x = np.zeros((n, 36), dtype=np.float32)
    m = model_for(
        template,
        x,
        np.zeros(n, dtype=np.int64),
        epochs=3,
        batch_size=batch_size,
        seed=7,
        device=torch.device("cpu"),
    )
    gen = torch_generator(7)
    want = [b for _ in range(3) for b in minibatches(n, batch_size, gen)]
    assert len(m.batches) == len(want) == m.steps
    assert all(torch.equal(a, b) for a, b in zip(m.batches, want))
    assert m.sizes() == [len(b) for b in want]
    with pytest.raises(PrivkitError, match="batch_size must be >= 1; found 0"):
        model_for(template, x, x[:, 0], epochs=1, batch_size=0, seed=7, device=torch.device("cpu"))


def test_a_models_inputs_used_are_computed_once_and_read_back(monkeypatch):
    """The stacked form keeps which inputs each model's records use (``Model.inputs_used``); a
    caller that trains the same records again (a client's, round after round) passes them back,
    and they are read, not computed again: the training is the same bit for bit."""
    import privkit.batched.exact_mlp as exact_mlp

    kw = dict(optimizer="adam", lr=0.01, mu=[0.0] * 5, anchors=None, loss_from=[0] * 5)
    template, first = _sparse_models(3)
    train_exact(template, first, stacked=True, **kw)
    for m in first:
        assert torch.equal(m.inputs_used, (m.x != 0).any(0))
    scans = []
    real = exact_mlp._inputs_in_use
    monkeypatch.setattr(exact_mlp, "_inputs_in_use", lambda x: scans.append(1) or real(x))
    _, again = _sparse_models(3)
    for m, f in zip(again, first):
        m.inputs_used = f.inputs_used
    _, fresh = _sparse_models(3)
    got = train_exact(template, again, stacked=True, **kw)
    assert scans == []
    want = train_exact(template, fresh, stacked=True, **kw)
    assert len(scans) == 5 and got == want
    for a, b in zip(again, fresh):
        for k in a.params:
            assert torch.equal(a.params[k], b.params[k]), k


def test_fedmd_phases_keep_each_partys_used_inputs(monkeypatch):
    """FedMD's phases train each party on its own records again (its initialisation, then every
    revisit): run_jobs keeps the inputs they use and the next phase reads them back, unscanned,
    training bit for bit as without them; a digest's public subset (new every round) is not
    kept."""
    from types import SimpleNamespace

    from privkit.batched import exact_mlp, many_fedmd
    from privkit.trainers.fedmd import PartyJob

    rng = np.random.default_rng(6)
    private = []
    for n in (9, 12, 7):
        x = rng.normal(size=(n, 1, 6, 6)).astype(np.float32)
        x[:, :, rng.integers(0, 6)] = 0.0  # inputs this party's records never use
        private.append((x, rng.integers(0, 4, size=n)))
    public = rng.normal(size=(10, 1, 6, 6)).astype(np.float32)
    soft = rng.dirichlet(np.ones(4), size=10).astype(np.float32)
    config = SimpleNamespace(lr=1e-3, knowledge="softmax")
    scans = []
    real = exact_mlp._inputs_in_use
    monkeypatch.setattr(exact_mlp, "_inputs_in_use", lambda r: scans.append(1) or real(r))

    def parties(kept):
        torch.manual_seed(0)
        models = [build_model("mlp", (1, 6, 6), 4, feature_dim=8) for _ in private]
        counts = []
        for phase in range(3):
            digest = phase == 1
            jobs = [
                PartyJob(m, public, soft, True, 1, 4, 10 + p)
                if digest
                else PartyJob(m, x, y, False, 2, 4, 20 * phase + p)
                for p, (m, (x, y)) in enumerate(zip(models, private))
            ]
            scans.clear()
            many_fedmd.run_jobs(jobs, config, torch.device("cpu"), frozenset(map(id, jobs)), kept)
            counts.append(len(scans))
        return models, counts

    kept: dict = {}
    with_kept, counts = parties(kept)
    assert counts == [3, 1, 0]  # the public subset is scanned once for all parties
    assert {id(x) for x, _ in private} == set(kept) and id(public) not in kept
    for (x, _), (held, used) in zip(private, kept.values()):
        assert held is x
        assert torch.equal(used, torch.from_numpy(x).flatten(1).abs().sum(0) != 0)
    without, counts = parties(None)
    assert counts == [3, 1, 3]
    for a, b in zip(with_kept, without):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), name


def test_fedmd_phases_share_each_architectures_buffers():
    """run_jobs keeps each architecture's stacked-kernel buffers from phase to phase (its
    digests and revisits take turns in them): two MLP widths and a CNN trained through three
    phases with the buffers kept come out bit for bit as with fresh buffers at every phase, and
    the kept buffers are one set per architecture."""
    from types import SimpleNamespace

    from privkit.batched import many_fedmd
    from privkit.trainers.fedmd import PartyJob

    rng = np.random.default_rng(7)
    private = [
        (rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, size=n))
        for n in (9, 12, 7, 10, 5)
    ]
    public = rng.normal(size=(10, 1, 8, 8)).astype(np.float32)
    soft = rng.dirichlet(np.ones(4), size=10).astype(np.float32)
    config = SimpleNamespace(lr=1e-3, knowledge="softmax")
    shapes = [("mlp", 8), ("mlp", 8), ("mlp", 6), ("cnn", 8), ("cnn", 8)]

    def parties(buffers):
        torch.manual_seed(0)
        models = [build_model(a, (1, 8, 8), 4, width=2, feature_dim=f) for a, f in shapes]
        for phase in range(3):
            jobs = [
                PartyJob(m, public, soft, True, 1, 4, 10 + p)
                if phase == 1
                else PartyJob(m, x, y, False, 2, 4, 20 * phase + p)
                for p, (m, (x, y)) in enumerate(zip(models, private))
            ]
            fast = frozenset(map(id, jobs))
            many_fedmd.run_jobs(jobs, config, torch.device("cpu"), fast, buffers=buffers)
        return models

    buffers: dict = {}
    kept = parties(buffers)
    assert len(buffers) == 3 and all(buffers.values())
    for a, b in zip(kept, parties(None)):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), name


def test_mlp_layers_covers_models_trained_from_some_layer_on():
    """The exact and stacked kernels cover privkit MLPs trained from some layer on (every layer,
    frozen features under a trained head, a frozen first layer under trained ones): those train
    as ``train_supervised`` trains them, bit for bit. A layer with a frozen weight and a trained
    bias, a frozen head, a trained layer under a frozen one (whose backward pass would stop above
    it) and a CNN are refused."""
    from privkit.batched.exact_mlp import mlp_layers
    from privkit.mechanisms.stacked import UnsupportedModelError
    from privkit.trainers.common import train_supervised

    def mlp(frozen=()):
        torch.manual_seed(4)
        model = build_model("mlp", (1, 6, 6), 4, feature_dim=8, depth=2)
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        return model

    first, second = (
        ["features.1.weight", "features.1.bias"],
        ["features.3.weight", "features.3.bias"],
    )
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(21, 1, 6, 6)).astype(np.float32), rng.integers(0, 4, 21)
    cpu = torch.device("cpu")
    for frozen in ((), first, first + second):
        assert mlp_layers(mlp(frozen)) == ["features.1", "features.3", "head"]
        ours, want = mlp(frozen), mlp(frozen)
        m = model_for(ours, x, y, epochs=2, batch_size=8, seed=3, device=cpu)
        train_exact(ours, [m], optimizer="adam", lr=0.01)
        train_supervised(want, x, y, epochs=2, batch_size=8, lr=0.01, device=cpu, seed=3)
        for (name, a), b in zip(ours.named_parameters(), want.parameters()):
            assert torch.equal(a, b), (frozen, name)
        assert torch.equal(ours.features[1].weight, mlp(frozen).features[1].weight) == bool(frozen)
    for frozen in (["features.3.weight"], ["head.weight", "head.bias"], second):
        with pytest.raises(UnsupportedModelError, match="trainable from some layer on"):
            mlp_layers(mlp(frozen))
    with pytest.raises(UnsupportedModelError, match="Flatten, then Linear"):
        mlp_layers(build_model("cnn", (1, 8, 8), 4, width=4, feature_dim=8))


def _walked_models():
    """privkit's MLPs, a CNN and a normalised MLP (a buffer), a FeatureClassifier with a tied
    parameter (the head's weight is a hidden layer's) and one with a submodule met twice."""
    from torch import nn

    from privkit.models import FeatureClassifier

    mlps = [build_model("mlp", (1, 6, 6), 4, feature_dim=8, depth=d) for d in (1, 2)]
    others = [
        build_model("cnn", (1, 8, 8), 4, width=4, feature_dim=8),
        build_model("mlp", (1, 6, 6), 4, feature_dim=8, normalize=True),
    ]
    tied = build_model("mlp", (1, 6, 6), 8, feature_dim=8, depth=2)
    tied.head.weight = tied.features[3].weight
    layer = nn.Linear(8, 8)
    layer.register_buffer("scale", torch.ones(8))  # a shared module's buffer: listed once
    inner = nn.Sequential(layer, nn.ReLU())  # met first at features.2.0, again at features.3
    twice = FeatureClassifier(nn.Sequential(nn.Flatten(), nn.Linear(36, 8), inner, layer), 8, 4)
    return mlps + others + [tied, twice]


def test_the_walk_finds_what_torchs_three_walks_find():
    """``model_for``'s one walk of a module gives the parameters as ``named_parameters()`` names,
    orders and de-duplicates them (a tied parameter under its first name, a shared submodule's
    once), the buffers ``buffers()`` gives, and whether every module ``modules()`` gives is in
    training mode."""
    from privkit.batched.exact_mlp import _walk

    for module in _walked_models():
        for eval_part in (None, module.head, module.features):
            module.train()
            if eval_part is not None:
                eval_part.eval()
            params, buffers, training = _walk(module)
            want = list(module.named_parameters())
            assert [(k, id(q)) for k, q in params.items()] == [(k, id(q)) for k, q in want]
            assert [id(b) for b in buffers] == [id(b) for b in module.buffers()]
            assert training == all(m.training for m in module.modules()) == (eval_part is None)
    tied, twice = _walked_models()[-2:]
    assert "head.weight" not in _walk(tied)[0] and "features.3.weight" in _walk(tied)[0]
    assert list(_walk(twice)[0])[2:4] == ["features.2.0.weight", "features.2.0.bias"]
    assert len(_walk(twice)[0]) == len(list(twice.parameters())) == 6


def test_model_for_moves_the_module_and_sets_it_training_only_where_needed():
    """``model_for`` moves a module with a tensor elsewhere to the device (the model's parameters
    are then the moved ones) and sets a module with a submodule in eval mode training; a module
    already there and training is left as it is, its parameters the model's."""
    x, y = np.zeros((5, 36), dtype=np.float32), np.zeros(5, dtype=np.int64)
    kw = dict(epochs=1, batch_size=2, seed=7)
    for module in _walked_models()[:2]:
        module.features[1].eval()
        m = model_for(module, x, y, device=torch.device("cpu"), **kw)
        assert all(q.training for q in module.modules())
        assert [q.data_ptr() for q in m.params.values()] == [
            q.data_ptr() for q in module.parameters()
        ]
        moved = model_for(module, x, y, device=torch.device("meta"), **kw)
        assert all(q.device.type == "meta" for q in module.parameters())
        assert list(moved.params) == [k for k, _ in module.named_parameters()]
        assert all(q.device.type == "meta" for q in moved.params.values())
    # a buffer elsewhere is moved too: a normalised MLP on the device but for its center
    normalised = _walked_models()[3].to("meta")
    normalised.features[-1].center = torch.zeros(8)
    model_for(normalised, x, y, device=torch.device("meta"), **kw)
    assert normalised.features[-1].center.device.type == "meta"
