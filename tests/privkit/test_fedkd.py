"""FedKD+DP (Wu et al. 2022 with DP-SGD): SVD compression against Eckart-Young, the mutual-distillation
loss against a hand-written one, the per-client ledger against dp-accounting, determinism."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
import torch.nn.functional as F

from privkit.data import FederationConfig, build_federation
from privkit.models import build_model
from privkit.trainers import train
from privkit.trainers.fedkd import MentorMentee, compress, energy_threshold, mutual_loss

TINY = {
    "arch": "mlp",
    "feature_dim": 16,
    "mentor_feature_dim": 24,
    "mentor_depth": 1,
    "rounds": 3,
    "local_steps": 2,
    "batch_size": 32,
    "client_fraction": 0.25,
    "noise_multiplier": 2.0,
    "target_epsilon": 1e6,
    "lr": 0.1,
    "device": "cpu",
}


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(clients=20, seed=0))


def test_compress_keeps_the_fewest_singular_values_reaching_the_energy():
    # singular values 3, 2, 1, 0.5: cumulative energy 9, 13, 14, 14.25 of 14.25 = .632, .912, .982, 1
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(50, 4, dtype=torch.float64))
    g = (u * torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64)) @ v.T
    out, sent, full = compress({"w": g, "b": torch.ones(7, dtype=torch.float64)}, 0.95)
    assert full == 4 * 50 + 7
    assert sent == 3 * (4 + 50 + 1) + 7  # three factors kept, the bias sent as it is
    # Eckart-Young: the best rank-3 approximation misses exactly the dropped singular value
    assert float((out["w"] - g).norm() ** 2) == pytest.approx(0.25, rel=1e-9)
    assert torch.equal(out["b"], torch.ones(7, dtype=torch.float64))
    # an energy the first factor already reaches keeps one; a matrix whose factors cost more
    # than itself is sent dense (exact)
    assert compress({"w": g}, 0.6)[1] == 4 + 50 + 1
    dense, sent_dense, _ = compress({"w": g[:, :3]}, 0.99)
    assert sent_dense == 12 and torch.equal(dense["w"], g[:, :3])


def _svd_reference(g: torch.Tensor, energy: float) -> tuple[torch.Tensor, int]:
    """The truncated reconstruction by torch.linalg.svd, and the number of factors kept."""
    a = g.reshape(g.shape[0], -1).double()
    u, sig, vh = torch.linalg.svd(a, full_matrices=False)
    cum = torch.cumsum(sig**2, 0) / (sig**2).sum()
    k = min(int((cum < energy - 1e-12).sum()) + 1, len(sig))
    return ((u[:, :k] * sig[:k]) @ vh[:k]).reshape(g.shape), k


@pytest.mark.parametrize("shape", [(64, 784), (784, 64), (10, 64), (16, 3, 5, 5)])
@pytest.mark.parametrize("energy", [0.5, 0.95, 0.98])
def test_compress_equals_the_svd_truncation(shape, energy):
    # updates like a client's: a low-rank signal under DP-like noise, wide, tall and conv-shaped
    gen = torch.Generator().manual_seed(hash((shape, energy)) % 2**31)
    rows, cols = shape[0], math.prod(shape[1:])
    r = min(rows, cols)
    signal = torch.randn(rows, 3, generator=gen) @ torch.randn(3, cols, generator=gen)
    g = (signal + 0.3 * torch.randn(rows, cols, generator=gen)).reshape(shape)
    want, k = _svd_reference(g, energy)
    out, sent, full = compress({"w": g}, energy)
    assert full == g.numel()
    if k * (rows + cols + 1) >= g.numel():  # dense: exact
        assert sent == g.numel() and torch.equal(out["w"], g)
    else:
        assert sent == k * (rows + cols + 1) and k < r
        assert out["w"].dtype == g.dtype
        err = float((out["w"].double() - want).abs().max())
        assert err <= 4 * torch.finfo(torch.float32).eps * float(want.abs().max())


def test_energy_threshold_rises_linearly_from_start_to_end():
    assert energy_threshold(0, 10, 0.95, 0.98) == pytest.approx(0.95)
    assert energy_threshold(5, 10, 0.95, 0.98) == pytest.approx(0.965)
    assert energy_threshold(10, 10, 0.95, 0.98) == pytest.approx(0.98)


def test_mutual_loss_gradients_are_each_models_own_loss():
    torch.manual_seed(1)
    mentor = build_model("mlp", (1, 8, 8), 5, feature_dim=12, depth=2)
    mentee = build_model("mlp", (1, 8, 8), 5, feature_dim=6)
    pair = MentorMentee(mentor, mentee)
    x, y = torch.rand(7, 1, 8, 8), torch.randint(0, 5, (7,))
    loss_fn = mutual_loss(5, hidden=True)
    total = sum(loss_fn(pair(x[i : i + 1]), y[i : i + 1], None) for i in range(7))
    got = torch.autograd.grad(total, list(pair.parameters()))

    # by hand: L_t = CE_t + w (KL(s||t) + MSE(h_t, W h_s)), gradient to the mentor only, and
    # L_s = CE_s + w (KL(t||s) + MSE(W h_s, h_t)), gradient to the mentee and W only
    want = [torch.zeros_like(p) for p in pair.parameters()]
    params = list(pair.parameters())
    t_params = list(mentor.parameters())
    s_params = list(mentee.parameters()) + list(pair.w_h.parameters())
    for i in range(7):
        xi, yi = x[i : i + 1], y[i : i + 1]
        h_t, h_s = mentor.features(xi), mentee.features(xi)
        t, s, proj = mentor.head(h_t), mentee.head(h_s), pair.w_h(h_s)
        ce_t, ce_s = F.cross_entropy(t, yi), F.cross_entropy(s, yi)
        w = 1.0 / float((ce_t + ce_s).detach())
        p_s, p_t = F.softmax(s, 1).detach(), F.softmax(t, 1).detach()
        l_t = ce_t + w * (
            (p_s * (p_s.log() - F.log_softmax(t, 1))).sum() + F.mse_loss(h_t, proj.detach())
        )
        l_s = ce_s + w * (
            (p_t * (p_t.log() - F.log_softmax(s, 1))).sum() + F.mse_loss(proj, h_t.detach())
        )
        for part, group in ((l_t, t_params), (l_s, s_params)):
            grads = torch.autograd.grad(part, group)
            for p, g in zip(group, grads):
                want[[id(q) for q in params].index(id(p))] += g
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-7)


def test_ledger_is_one_poisson_gaussian_per_round_taken_part_in(fed):
    res = train("fedkd-dp", fed, TINY, seed=0)
    taken = {}
    for r in res.rounds:
        for k in r["clients"]:
            taken[k] = taken.get(k, 0) + 1
    for k, count in taken.items():
        entries = res.ledger.entries(k)
        assert len(entries) == count
        q = min(1.0, TINY["batch_size"] / len(fed.clients[k]))
        want = dpa.SelfComposedDpEvent(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(TINY["noise_multiplier"])),
            TINY["local_steps"],
        )
        assert all(e.event == want for e in entries)
        # peer accountant on the composition of the rounds this client took part in
        acc = dpa.rdp.RdpAccountant()
        acc.compose(want, count)
        assert res.ledger.epsilon(1e-5, client=k, accountant="rdp") == pytest.approx(
            acc.get_epsilon(1e-5)
        )
    assert res.claims["epsilon"] == pytest.approx(
        max(res.ledger.epsilon(1e-5, client=k, accountant="rdp") for k in taken)
    )
    assert len(res.client_models) == fed.num_clients  # one mentor per client
    assert all(0 < r["upload_fraction"] <= 1 for r in res.rounds)


def test_stops_before_the_round_that_would_pass_the_budget(fed):
    full = train("fedkd-dp", fed, {**TINY, "rounds": 4}, seed=1)
    eps = [r["epsilon"] for r in full.rounds]  # worst client after each round (non-decreasing)
    target = (eps[0] + min(e for e in eps if e > eps[0])) / 2
    stop = next(t for t, e in enumerate(eps) if e > target)  # same seed: same clients sampled
    capped = train("fedkd-dp", fed, {**TINY, "rounds": 4, "target_epsilon": target}, seed=1)
    assert len(capped.rounds) == stop and capped.claims["epsilon"] <= target
    assert f"stopped before round {stop + 1}" in capped.claims["stop"]


def test_same_seed_same_result(fed):
    # reproducible-noise mode; release mode draws the DP noise and sampling from OS entropy
    cfg = {**TINY, "rounds": 2, "reproducible_noise": True}
    a = train("fedkd-dp", fed, cfg, seed=3)
    b = train("fedkd-dp", fed, cfg, seed=3)
    for v, w in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        torch.testing.assert_close(v, w, rtol=0, atol=0)
    c = train("fedkd-dp", fed, cfg, seed=4)
    assert not torch.equal(a.model.head.weight, c.model.head.weight)
    assert math.isfinite(a.test_accuracy)


def test_bad_energy_order_names_the_fields(fed):
    with pytest.raises(ValueError, match=r"energy_start must be <= energy_end; found 0\.99 > 0\.9"):
        train("fedkd-dp", fed, {**TINY, "energy_start": 0.99, "energy_end": 0.9})
