"""FLiP: the differentiable unroll against closed-form and finite-difference gradients, Eq. 4-5,
ledger, shared artifacts and determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accountants import NonPrivateEvent
from privkit.data import FederationConfig, build_federation
from privkit.trainers import flip, get_trainer, train

TINY = {"k": 1, "rounds": 2, "local_epochs": 2, "feature_dim": 8, "device": "cpu"}


@pytest.fixture(scope="module")
def fed():
    full = build_federation(FederationConfig(clients=3, partition="iid", seed=2))
    return full.with_clients([c[:40] for c in full.clients], "small")


def _linear(d: int, c: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(d, c)).double()


def _problem(d=5, c=3, K=1, B=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(K, d, generator=g, dtype=torch.float64)
    lab = torch.randn(K, c, generator=g, dtype=torch.float64)
    rho = flip.raw_from_rates(
        torch.full((K,), 0.3, dtype=torch.float64)
        + 0.1 * torch.rand(K, generator=g, dtype=torch.float64)
    )
    x = torch.randn(B, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (B,), generator=g)
    return s, lab, rho, x, y


def _loss(model, init, s, lab, rho, x, y):
    eta = flip.rates_from_raw(rho, 0.0, 10.0)
    theta = flip.unroll(model, init, s, lab, eta, create_graph=True)
    return flip.raw_loss(model, theta, x, y)


def test_unrolled_gradient_matches_closed_form_one_step():
    """Softmax regression, K=1: theta_1 = theta_0 - eta * [(p - q) s^T, p - q]; every gradient of
    L_raw(theta_1) with respect to the rate, the sample and the label logits in closed form."""
    d, c = 5, 3
    model = _linear(d, c)
    init = flip.initial_params(model)
    s, lab, rho, x, y = _problem(d, c)
    s.requires_grad_(True), lab.requires_grad_(True), rho.requires_grad_(True)
    _loss(model, init, s, lab, rho, x, y).backward()

    W0, b0 = init["1.weight"].numpy(), init["1.bias"].numpy()
    sv, lv, xv, yv = s.detach().numpy()[0], lab.detach().numpy()[0], x.numpy(), y.numpy()
    eta = float(F.softplus(rho.detach())[0])
    sm = lambda z: (
        np.exp(z - z.max(-1, keepdims=True))
        / np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
    )
    p, q = sm(W0 @ sv + b0), sm(lv)
    gW0, gb0 = np.outer(p - q, sv), p - q  # gradient of the inner loss at theta_0
    W1, b1 = W0 - eta * gW0, b0 - eta * gb0
    P = sm(xv @ W1.T + b1)
    Y = np.eye(c)[yv]
    G, gb = (P - Y).T @ xv / len(yv), (P - Y).mean(0)  # gradient of L_raw at theta_1
    d_eta = -(np.sum(G * gW0) + gb @ gb0)
    Jp = np.diag(p) - np.outer(p, p)
    d_s = -eta * (W0.T @ Jp @ (G @ sv + gb) + G.T @ (p - q))
    d_q = eta * (G @ sv + gb)
    d_l = (np.diag(q) - np.outer(q, q)) @ d_q
    sig = 1 / (1 + math.exp(-float(rho.detach()[0])))  # d softplus / d rho
    np.testing.assert_allclose(rho.grad.numpy()[0], d_eta * sig, rtol=1e-10)
    np.testing.assert_allclose(s.grad.numpy()[0], d_s, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(lab.grad.numpy()[0], d_l, rtol=1e-9, atol=1e-13)


def test_unrolled_gradient_matches_finite_differences_two_steps():
    """K=2 through a hidden tanh layer (second-order terms matter): central differences in float64."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    init = flip.initial_params(model)
    s, lab, rho, x, y = _problem(4, 3, K=2, seed=3)
    leaves = [
        s.clone().requires_grad_(True),
        lab.clone().requires_grad_(True),
        rho.clone().requires_grad_(True),
    ]
    _loss(model, init, *leaves, x, y).backward()
    h = 1e-6
    for which, leaf in enumerate(leaves):
        base = [t.detach().clone() for t in leaves]
        fd = torch.zeros_like(base[which])
        for i in range(base[which].numel()):
            plus = [t.clone() for t in base]
            minus = [t.clone() for t in base]
            plus[which].view(-1)[i] += h
            minus[which].view(-1)[i] -= h
            fd.view(-1)[i] = (
                _loss(model, init, *plus, x, y) - _loss(model, init, *minus, x, y)
            ) / (2 * h)
        torch.testing.assert_close(leaf.grad, fd, rtol=1e-6, atol=1e-9)


def test_final_model_is_one_sgd_pass_over_the_samples():
    """Eq. 5 with the unroll equals plain per-sample SGD steps taken with torch.optim on a copy."""
    model = _linear(5, 3, seed=2)
    init = flip.initial_params(model)
    s, lab, rho, _, _ = _problem(5, 3, K=3, seed=4)
    eta = flip.rates_from_raw(rho, 0.0, 10.0)
    ref = _linear(5, 3, seed=2)
    for j in range(3):
        opt = torch.optim.SGD(ref.parameters(), lr=float(eta[j]))
        opt.zero_grad()
        flip.soft_cross_entropy(ref(s[j : j + 1]), F.softmax(lab[j : j + 1], 1)).backward()
        opt.step()
    out = flip.final_model(_linear(5, 3, seed=2), init, s, lab, eta)
    for (_, p), (_, r) in zip(out.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, r, rtol=1e-12, atol=1e-12)


def test_rates_parametrisation_and_aggregation():
    eta = torch.tensor([1e-4, 0.02, 0.5, 3.0], dtype=torch.float64)
    torch.testing.assert_close(F.softplus(flip.raw_from_rates(eta)), eta, rtol=1e-10, atol=0)
    assert flip.rates_from_raw(torch.tensor([10.0]), 0.0, 0.5).item() == 0.5  # clipped
    ups = [
        (torch.full((2, 1), float(i)), torch.full((2, 3), 2.0 * i), torch.full((2,), 0.1 * i))
        for i in range(3)
    ]
    S, L, E = flip.aggregate(ups)
    torch.testing.assert_close(S, torch.full((2, 1), 1.0))
    torch.testing.assert_close(L, torch.full((2, 3), 2.0))
    torch.testing.assert_close(E, torch.full((2,), 0.1))


def test_client_update_lowers_raw_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    init = flip.initial_params(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    cfg = flip.FlipConfig(k=1, local_epochs=40, batch_size=60, distill_lr=0.05)
    S, L, E = flip.initial_distilled(1, 3, (4,), cfg, 0, torch.device("cpu"))
    before = float(flip.raw_loss(model, flip.unroll(model, init, S, L, E), x, y).detach())
    S2, L2, E2, _ = flip.client_update(model, init, S, L, E, x, y, cfg, cfg.distill_lr, seed=0)
    after = float(flip.raw_loss(model, flip.unroll(model, init, S2, L2, E2), x, y).detach())
    assert after < before - 0.1


# ----------------------------------------------------------------------------- the rank-one form
def _mlp(d: int, c: int, depth: int, seed: int) -> nn.Module:
    from privkit.models import build_model

    torch.manual_seed(seed)
    return build_model("mlp", (1, 1, d), c, feature_dim=6, depth=depth).double()


@pytest.mark.parametrize("depth", [1, 2])
def test_rank_one_unroll_equals_the_autograd_unroll_weights_and_gradients(depth):
    """Three clients' unrolls at once (float64): the unrolled weights, the raw loss and its
    gradients with respect to samples, label logits and rates equal the generic unroll's."""
    from privkit.trainers import flip_rank_one

    d, c, K, C = 7, 4, 5, 3
    model = _mlp(d, c, depth, seed=depth)
    init = flip.initial_params(model)
    names = flip_rank_one.mlp_linear_names(model)
    assert names is not None and len(names) == depth + 1
    layers = [(init[w], init[b]) for w, b in names]
    probs = [_problem(d, c, K=K, B=9, seed=10 + i) for i in range(C)]
    leaves = [
        torch.stack([p[k].reshape(K, 1, 1, d) if k == 0 else p[k] for p in probs]).requires_grad_(
            True
        )
        for k in range(3)
    ]
    x = torch.stack([p[3] for p in probs])
    y = torch.stack([p[4] for p in probs])
    eta = flip.rates_from_raw(leaves[2], 0.0, 10.0)
    hist = flip_rank_one.unroll(layers, leaves[0].reshape(C, K, d), F.softmax(leaves[1], -1), eta)
    out = flip_rank_one.logits(layers, hist, x)
    losses = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(C, -1).mean(1)
    losses.sum().backward()
    unrolled = flip_rank_one.weights(layers, hist)
    for i in range(C):
        ref = [
            t.detach().clone().requires_grad_(True)
            for t in (leaves[0][i], leaves[1][i], leaves[2][i])
        ]
        theta = flip.unroll(model, init, ref[0], ref[1], flip.rates_from_raw(ref[2], 0.0, 10.0))
        for (w, b), (W, B) in zip(names, unrolled):
            torch.testing.assert_close(W[i], theta[w], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(B[i], theta[b], rtol=1e-12, atol=1e-12)
        loss = flip.raw_loss(model, theta, x[i].view(-1, 1, 1, d), y[i])
        torch.testing.assert_close(losses[i], loss, rtol=1e-12, atol=1e-12)
        loss.backward()
        for leaf, r in zip(leaves, ref):
            torch.testing.assert_close(leaf.grad[i], r.grad, rtol=1e-9, atol=1e-12)


def test_rank_one_client_updates_equal_one_client_at_a_time():
    """Clients of unequal size (two lockstep groups: one and two batches per epoch, padded last
    batches) get, in float64, the uploads and losses of client_update run one by one."""

    d, c = 6, 3
    model = _mlp(d, c, 1, seed=0)
    init = flip.initial_params(model)
    cfg = flip.FlipConfig(k=2, local_epochs=3, batch_size=16, distill_lr=0.05)
    S, L, E = (
        t.double() for t in flip.initial_distilled(2, c, (1, 1, d), cfg, 0, torch.device("cpu"))
    )
    g = torch.Generator().manual_seed(1)
    clients = []
    for n in (16, 9, 25, 30):
        x = torch.randn(n, 1, 1, d, generator=g, dtype=torch.float64)
        clients.append((x, torch.randint(0, c, (n,), generator=g)))
    seeds = [11, 12, 13, 14]
    got = flip.round_updates(model, init, S, L, E, clients, cfg, 0.05, seeds)
    for (x, y), seed, (s2, l2, e2, loss2) in zip(clients, seeds, got):
        s1, l1, e1, loss1 = flip.client_update(model, init, S, L, E, x, y, cfg, 0.05, seed)
        torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(l2, l1, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(e2, e1, rtol=1e-9, atol=1e-11)
        assert loss2 == pytest.approx(loss1, rel=1e-9)
        assert not torch.equal(s2, S)  # the samples moved


def _run_start(d, c, depth, r, cfg):
    """Run ``r``'s model, initial parameters and float64 distilled data, its rates shifted by
    ``0.05 r`` (the runs' rates differ too)."""
    model = _mlp(d, c, depth, seed=r)
    S, L, E = (
        t.double() for t in flip.initial_distilled(2, c, (1, 1, d), cfg, r, torch.device("cpu"))
    )
    return model, flip.initial_params(model), S, L, E + 0.05 * r


@pytest.mark.parametrize("depth", [1, 2])
def test_clients_of_several_runs_get_their_own_runs_updates(depth):
    """runs_round_updates (an audit's reference runs, batched): the clients of two runs, each run
    with its own initial model and distilled data, in one call get, in float64, the uploads and
    losses of their own run's round_updates (clients of unequal size: several lockstep groups)."""
    d, c = 6, 3
    cfg = flip.FlipConfig(k=2, local_epochs=2, batch_size=16, distill_lr=0.05)
    g = torch.Generator().manual_seed(2)
    runs = []
    for r in range(2):
        model, _, S, L, E = _run_start(d, c, depth, r, cfg)
        clients = []
        for n in (16, 9, 30) if r == 0 else (25, 16):
            x = torch.randn(n, 1, 1, d, generator=g, dtype=torch.float64)
            clients.append((x, torch.randint(0, c, (n,), generator=g)))
        runs.append(
            (
                model,
                flip.initial_params(model),
                S,
                L,
                E,
                clients,
                [10 * r + i for i in range(len(clients))],
            )
        )
    got = flip.runs_round_updates(
        runs[0][0],
        [(init, S, L, E) for _, init, S, L, E, clients, _ in runs for _ in clients],
        [cl for run in runs for cl in run[5]],
        cfg,
        0.05,
        [s for run in runs for s in run[6]],
    )
    alone = [
        u
        for m, init, S, L, E, cl, seeds in runs
        for u in flip.round_updates(m, init, S, L, E, cl, cfg, 0.05, seeds)
    ]
    assert len(got) == len(alone) == 5
    for (s2, l2, e2, loss2), (s1, l1, e1, loss1) in zip(got, alone):
        torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(l2, l1, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(e2, e1, rtol=1e-9, atol=1e-11)
        assert loss2 == pytest.approx(loss1, rel=1e-9)


def _sparse_clients(d, c, sizes, g, zero_share=0.5):
    """Clients whose rows leave some input columns 0 (as MNIST's border pixels are): each client
    its own random half of the columns."""
    clients = []
    for n in sizes:
        x = torch.randn(n, 1, 1, d, generator=g, dtype=torch.float64)
        blank = torch.randperm(d, generator=g)[: int(zero_share * d)]
        x[..., blank] = 0.0
        clients.append((x, torch.randint(0, c, (n,), generator=g)))
    return clients


@pytest.mark.parametrize("depth, batch_size", [(1, 64), (2, 64), (1, 8)])
def test_runs_with_narrowed_rows_and_per_run_layers_equal_the_generic_unroll(depth, batch_size):
    """Two runs of three clients each (the layers stacked per run, not per client), every client
    using half of the input columns (its rows narrowed to them), an epoch one whole batch or two
    drawn batches: in float64 each client's upload and loss are client_update's (the generic
    autograd unroll, one client at a time)."""
    from privkit.trainers import flip_rank_one

    d, c = 16, 3
    cfg = flip.FlipConfig(k=2, local_epochs=2, batch_size=batch_size, distill_lr=0.05)
    g = torch.Generator().manual_seed(7)
    runs = [_run_start(d, c, depth, r, cfg) for r in range(2)]
    clients = [_sparse_clients(d, c, (12, 9, 14), g) for _ in runs]
    flat = [x.reshape(len(x), -1) for cl in clients for x, _ in cl]
    cols = flip_rank_one.used_columns(flat)
    assert cols is not None and cols.shape == (6, d // 2)
    names = flip_rank_one.mlp_linear_names(runs[0][0])
    inits = [run[1] for run in runs for _ in range(3)]
    assert flip._stacked_layers(names, inits)[0][0].shape[0] == 2  # one per run
    seeds = list(range(6))
    got = flip.runs_round_updates(
        runs[0][0],
        [(init, S, L, E) for _, init, S, L, E in runs for _ in range(3)],
        [cl for run_clients in clients for cl in run_clients],
        cfg,
        0.05,
        seeds,
    )
    at = 0
    for (model, init, S, L, E), run_clients in zip(runs, clients):
        for x, y in run_clients:
            s1, l1, e1, loss1 = flip.client_update(model, init, S, L, E, x, y, cfg, 0.05, seeds[at])
            s2, l2, e2, loss2 = got[at]
            torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(l2, l1, rtol=1e-9, atol=1e-11)
            torch.testing.assert_close(e2, e1, rtol=1e-9, atol=1e-11)
            assert loss2 == pytest.approx(loss1, rel=1e-9)
            at += 1


@pytest.mark.parametrize("per_run", [False, True])
def test_sample_products_gradient_by_finite_differences(per_run):
    """The samples' three products (first layer, Gram matrix, raw rows at each client's used
    columns) and their one-buffer gradient, against finite differences (float64)."""
    from privkit.trainers import flip_rank_one

    g = torch.Generator().manual_seed(3)
    C, K, d, n, out = 4, 3, 10, 5, 4
    flat = [x.reshape(n, d) for x, _ in _sparse_clients(d, 2, [n] * C, g)]
    cols = flip_rank_one.used_columns(flat)
    assert cols is not None
    xs = flip_rank_one.narrowed(flat, cols)
    rows = flip_rank_one.padded_rows(xs, [torch.zeros(n, dtype=torch.long)] * C, xs, cols)
    W = torch.randn((2, out, d) if per_run else (out, d), generator=g, dtype=torch.float64)
    b = torch.randn((2, out) if per_run else (out,), generator=g, dtype=torch.float64)
    S = torch.randn(C, K, d, generator=g, dtype=torch.float64, requires_grad=True)

    def products(S):
        return flip_rank_one._SampleProducts.apply(S, W, b, rows.cols, rows.xt, rows.x)

    assert torch.autograd.gradcheck(products, (S,))
    first, gram, on_rows = products(S)
    for i in range(C):  # and the values, client by client
        Wi, bi = (W[i // 2], b[i // 2]) if per_run else (W, b)
        torch.testing.assert_close(first[i], S[i] @ Wi.T + bi)
        torch.testing.assert_close(gram[i], S[i] @ S[i].T)
        torch.testing.assert_close(on_rows[i], S[i] @ flat[i].T)


def test_rows_cache_is_reused_for_the_same_clients_only():
    """round_updates' rows_cache: a second round of the same clients and initial model reuses
    the padded rows (and gives the uncached updates bit for bit); other clients rebuild them."""
    d, c = 12, 3
    cfg = flip.FlipConfig(k=2, local_epochs=2, batch_size=64, distill_lr=0.05)
    model, init, S, L, E = _run_start(d, c, 1, 0, cfg)
    g = torch.Generator().manual_seed(4)
    clients = _sparse_clients(d, c, (10, 7), g)
    cache: dict = {}
    first = flip.round_updates(model, init, S, L, E, clients, cfg, 0.05, [1, 2], cache)
    kept = cache[1][2]
    again = flip.round_updates(model, init, S, L, E, clients, cfg, 0.05, [1, 2], cache)
    uncached = flip.round_updates(model, init, S, L, E, clients, cfg, 0.05, [1, 2])
    assert cache[1][2] is kept
    for a, b, u in zip(first, again, uncached):
        for ta, tb, tu in zip(a[:3], b[:3], u[:3]):
            assert torch.equal(ta, tb) and torch.equal(ta, tu)
    other = [clients[0], _sparse_clients(d, c, (7,), g)[0]]
    flip.round_updates(model, init, S, L, E, other, cfg, 0.05, [1, 2], cache)
    assert cache[1][2] is not kept


def test_rank_one_form_applies_to_the_mlp_only():
    from privkit.models import build_model
    from privkit.trainers import flip_rank_one

    assert flip_rank_one.mlp_linear_names(build_model("cnn", (1, 28, 28), 10)) is None
    normalized = build_model("mlp", (1, 28, 28), 10, normalize=True)
    assert flip_rank_one.mlp_linear_names(normalized) is None
    assert flip_rank_one.mlp_linear_names(build_model("mlp", (1, 28, 28), 10)) == [
        ("features.1.weight", "features.1.bias"),
        ("head.weight", "head.bias"),
    ]


# ----------------------------------------------------------------------------- the trainer
def test_flip_run_ledger_artifacts_and_determinism(fed):
    a = train("flip", fed, TINY, seed=5)
    b = train("flip", fed, TINY, seed=5)
    C, K = fed.num_classes, TINY["k"] * fed.num_classes
    assert a.rounds == b.rounds and len(a.rounds) == TINY["rounds"]
    for key in a.artifacts:
        assert np.array_equal(a.artifacts[key], b.artifacts[key])
    for i in range(fed.num_clients):
        (entry,) = a.ledger.entries(i)
        assert isinstance(entry.event, NonPrivateEvent) and "no formal DP" in entry.event.reason
        assert a.artifacts[f"distilled_x/client_{i}"].shape == (K, *fed.input_shape)
        ysoft = a.artifacts[f"distilled_y/client_{i}"]
        assert ysoft.shape == (K, C)
        np.testing.assert_allclose(ysoft.sum(1), 1.0, rtol=1e-5)
        assert a.artifacts[f"distilled_lr/client_{i}"].shape == (K,)
    # the server's aggregate is the element-wise mean of the last uploads (Eq. 4)
    mean_x = np.mean([a.artifacts[f"distilled_x/client_{i}"] for i in range(3)], 0)
    np.testing.assert_allclose(a.artifacts["aggregated_x"], mean_x, rtol=1e-5, atol=1e-6)
    assert np.array_equal(a.artifacts["distilled_slot_class"], np.arange(K) % C)
    assert a.ledger.epsilon(1e-5) == math.inf
    assert any("no formal DP" in w for w in a.warnings)
    for (_, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(pa, pb)
    c = train("flip", fed, TINY, seed=6)
    assert not np.array_equal(c.artifacts["aggregated_x"], a.artifacts["aggregated_x"])


def test_record_every_keeps_earlier_uploads_and_lr_halves(fed):
    cfg = {**TINY, "rounds": 3, "local_epochs": 1, "record_every": 1, "lr_decay_every": 2}
    r = train("flip", fed, cfg, seed=0)
    # gamma halved every lr_decay_every rounds (paper: every 40)
    assert [x["distill_lr"] for x in r.rounds] == [0.05, 0.05, 0.025]
    assert (
        "distilled_x_round_1/client_0" in r.artifacts
        and "distilled_x_round_2/client_2" in r.artifacts
    )
    assert "distilled_x_round_3/client_0" not in r.artifacts  # the last round is under distilled_x/


def test_flip_quick_config_registered():
    spec = get_trainer("flip")
    assert not spec.formal_dp
    assert spec.quick_config()["rounds"] < spec.defaults()["rounds"]


# ----------------------------------------------------------------------------- the paper's attackers
def test_attack_config_defaults_are_the_papers_and_reductions_are_listed(fed):
    a = flip.FlipAttackConfig()
    assert (a.shadows, a.catboost_iterations, a.catboost_depth) == (128, 10_000, 1)  # Sec. VI-D2
    assert a.mia_rounds == [1, 25, 50, 75, 100] and a.table2_rounds == "all"
    assert a.reductions() == []
    small = flip.FlipAttackConfig(shadows=8, catboost_iterations=200, table2_rounds="last")
    assert small.reductions() == [
        "shadows 8 (paper 128)",
        "catboost_iterations 200 (paper 10000)",
        "table2_rounds last (paper: every round's release)",
    ]
    res = train("flip", fed, {**TINY, "attack": {"shadows": 8}}, seed=0)
    assert any(
        "scaled down from the paper's" in w and "shadows 8 (paper 128)" in w for w in res.warnings
    )
    assert not any("scaled down" in w for w in train("flip", fed, TINY, seed=0).warnings)


@pytest.mark.parametrize("rounds", ["all", "last"])
def test_table2_attack_uses_every_rounds_release(rounds):
    from privkit.audit.instantiations import flip_table2_attack

    full = build_federation(FederationConfig(clients=2, partition="iid", seed=0))
    fed = full.with_clients([c[::8] for c in full.clients], "tiny")
    cfg = {
        **TINY,
        "rounds": 3,
        "local_epochs": 1,
        "attack": {"table2_rounds": rounds, "table2_classifier": "logreg"},
    }
    res = flip_table2_attack(fed, cfg, p1=0, p2=1, s1=3, s2=8)
    K = TINY["k"] * 2  # binary tasks: k samples per class
    per_run = fed.num_clients * K * (3 if rounds == "all" else 1)
    assert res.n_test == 2 * per_run  # the two p2 runs' shared samples
    assert "every round's" in res.notes if rounds == "all" else "the last round's" in res.notes


def test_mia_rounds_keep_the_aggregate_that_rebuilds_that_rounds_model(fed):
    cfg = {**TINY, "rounds": 3, "attack": {"mia_rounds": [1, 3]}}
    res = train("flip", fed, cfg, seed=4)
    assert {k for k in res.artifacts if k.endswith(("_round_1", "_round_3"))} == {
        f"aggregated_{n}_round_{t}" for n in ("x", "label_logits", "lr") for t in (1, 3)
    }
    assert not any(k.endswith("_round_2") for k in res.artifacts)
    # the last kept round is the released model itself
    last = flip.model_at_round(fed, flip.FlipConfig(**cfg), 4, res.artifacts, 3)
    for a, b in zip(last.parameters(), res.model.parameters()):
        torch.testing.assert_close(a, b)
    with pytest.raises(Exception, match="found 2"):
        flip.model_at_round(fed, flip.FlipConfig(**cfg), 4, res.artifacts, 2)
