"""Trainers I end to end on a small federation: ledgers, artifacts, determinism, persistence."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting import gaussian_mechanism

from accountants import NonPrivateEvent
from privkit.data import FederationConfig, build_federation
from privkit.trainers import TrainResult, get_trainer, train
from privkit.trainers.heads import head_to_linear
from privkit.trainers.pretrain import clear_cache

TINY = {"arch": "mlp", "feature_dim": 32, "pretrain_epochs": 1, "student_epochs": 1}
FED_TINY = {"rounds": 2, "participation": 1.0, "distill_epochs": 1}


@pytest.fixture(scope="module")
def fed():
    base = build_federation(FederationConfig(clients=4, alpha=0.01, seed=3))
    pool = np.concatenate(base.clients)
    y = base.private.y[pool]
    # two single-class clients (common at alpha=0.01) and two mixed ones, 60 records each
    clients = [pool[y == 0][:60], pool[y == 1][:60], pool[y >= 2][:60], pool[y >= 2][60:120]]
    return base.with_clients(clients, "tiny")


def quick(method: str, **extra) -> dict:
    spec = get_trainer(method)
    cfg = spec.quick_config()
    cfg.update({k: v for k, v in {**TINY, **FED_TINY}.items() if k in spec.config_cls.model_fields})
    cfg.update(extra)
    return cfg


def classic_multiplier(eps: float, delta: float) -> float:
    # sigma / sensitivity of the classic Gaussian mechanism (Dwork & Roth Thm A.1)
    return math.sqrt(2 * math.log(1.25 / delta)) / eps


def test_fixture_has_single_class_clients(fed):
    held = [len(np.unique(fed.client_arrays(i)[1])) for i in range(fed.num_clients)]
    assert min(held) == 1  # the DP-head methods below must cope with them


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "feddf"])
def test_parameter_sharing_methods_record_non_private_updates(fed, method):
    res = train(method, fed, quick(method), seed=0)
    assert 0.0 <= res.test_accuracy <= 1.0 and [r["round"] for r in res.rounds] == [1, 2]
    for c in res.ledger.clients:
        entries = res.ledger.entries(c)
        assert len(entries) == 2  # full participation, 2 rounds
        assert all(
            isinstance(e.event, NonPrivateEvent) and e.label == "model-update" for e in entries
        )
    assert math.isinf(res.ledger.epsilon(1e-5))
    assert math.isinf(res.claims["epsilon"])
    if method == "feddf":
        soft = res.artifacts["soft_labels"]
        assert soft.shape == (len(fed.distill), fed.num_classes)
        np.testing.assert_allclose(soft.sum(1), 1, atol=1e-5)


def test_fedprox_proximal_term_changes_the_model(fed):
    a = train("fedavg", fed, quick("fedavg"), seed=0).model.state_dict()
    b = train("fedprox", fed, quick("fedprox", mu=10.0), seed=0).model.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_reused_client_copies_train_as_fresh_deep_copies(fed):
    """A run's clients train spare modules overwritten in place round after round (copy_into);
    each trained copy must equal a fresh deepcopy trained alone, after the round's later clients
    have trained (they must not touch it)."""
    from privkit.methods import make_config
    from privkit.trainers.fedavg import FederatedRun, local_update

    cfg = make_config("fedprox", quick("fedprox", rounds=3))
    run = FederatedRun(fed, cfg, 0, mu=cfg.mu)
    while (selected := run.next_round()) is not None:
        trained = [run.train_local(i) for i in selected]
        for i, (local, loss) in zip(selected, trained):
            x, y = fed.client_arrays(i)
            ref, ref_loss = local_update(
                run.model, x, y, cfg, mu=run.mu, seed=run.local_seed(i), device=run.device
            )
            got, want = local.state_dict(), ref.state_dict()
            assert loss == ref_loss and all(torch.equal(got[k], want[k]) for k in want)
        run.finish_round(trained)
    assert len(run.spares) == fed.num_clients  # full participation: 3 rounds, 4 modules


def test_fedprox_term_is_half_mu_squared_distance_with_gradient_mu_times_drift():
    from privkit.trainers.fedavg import _prox_term

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    term = _prox_term(0.3, anchor)(model, None, torch.zeros(1))
    drift = {k: p.detach() - anchor[k] for k, p in model.named_parameters()}
    assert float(term) == pytest.approx(0.15 * sum(float((d**2).sum()) for d in drift.values()))
    term.backward()
    for (
        k,
        p,
    ) in model.named_parameters():  # d/dtheta (mu/2)||theta - theta_t||^2 = mu (theta - theta_t)
        torch.testing.assert_close(p.grad, 0.3 * drift[k])


def test_fedprox_larger_mu_keeps_the_model_closer_to_where_it_started(fed):
    # FedProx's point: the proximal term limits client drift. With plain SGD (the FedProx paper's
    # local solver) the averaged model's distance from the initial model shrinks as mu grows, and
    # even the FedAUX grid's mu=0.01 changes the weights (accuracy may still agree to every digit:
    # a few local steps move theta by ~1e-2, so the term's gradient is ~1e-4).
    cfg = {"optimizer": "sgd", "lr": 0.1, "rounds": 1, "local_epochs": 3}
    start = train("fedavg", fed, quick("fedavg", **{**cfg, "lr": 1e-12}), seed=0).model
    init = torch.cat([p.detach().flatten() for p in start.parameters()])

    def dist(model) -> float:
        return float((torch.cat([p.detach().flatten() for p in model.parameters()]) - init).norm())

    avg = train("fedavg", fed, quick("fedavg", **cfg), seed=0).model
    prox = [
        train("fedprox", fed, quick("fedprox", **cfg, mu=mu), seed=0).model
        for mu in (0.01, 1.0, 10.0)
    ]
    d = [dist(avg)] + [dist(m) for m in prox]
    assert d[0] > d[1] > d[2] > d[3]
    assert not torch.equal(avg.head.weight, prox[0].head.weight)


def test_fedaux_scores_are_dp_and_models_are_not(fed):
    res = train(
        "fedaux",
        fed,
        quick("fedaux", score_epsilon=0.1, score_delta=1e-5, calibration="classic"),
        seed=0,
    )
    K = fed.num_clients
    assert res.artifacts["scores"].shape == (K, len(fed.distill))
    assert res.artifacts["score_heads"].shape[0] == K
    for c in res.ledger.clients:
        scores = [e for e in res.ledger.entries(c) if e.label == "scores"]
        assert len(scores) == 1 and scores[0].neighbouring == "replace_one"
        ev = scores[0].event
        assert isinstance(ev, dpa.GaussianDpEvent)
        assert ev.noise_multiplier == pytest.approx(classic_multiplier(0.1, 1e-5))
    assert math.isinf(res.ledger.epsilon(1e-5))  # client models sent in the clear
    eps_scores = res.ledger.epsilon(1e-5, labels=["scores"])
    # independent: dp-accounting's exact Gaussian epsilon at the same noise multiplier
    exact = gaussian_mechanism.get_epsilon_gaussian(classic_multiplier(0.1, 1e-5), 1e-5)
    assert eps_scores == pytest.approx(exact, rel=1e-3)
    assert eps_scores <= 0.1
    assert res.claims["epsilon"] == 0.1 and math.isinf(res.claims["pipeline_epsilon"])
    assert any("Eq. 10" in w for w in res.warnings) and any("Eq. 4" in w for w in res.warnings)


def test_fedauxfdp_ledger_and_claim(fed):
    cfg = quick(
        "fedauxfdp",
        class_epsilon=0.5,
        score_epsilon=0.1,
        class_delta=1e-5,
        score_delta=1e-5,
        class_lambda=0.01,
        calibration="classic",
    )  # the paper's mechanism
    res = train("fedauxfdp", fed, cfg, seed=0)
    K, C = fed.num_clients, fed.num_classes
    assert res.artifacts["heads"].shape == (K, C, 32 + 1)
    assert res.artifacts["scores"].shape == (K, len(fed.distill))
    assert res.artifacts["soft_labels"].shape == (len(fed.distill), C)
    for c in res.ledger.clients:
        by_label = {e.label: e for e in res.ledger.entries(c)}
        assert set(by_label) == {"class-head", "scores"}
        assert by_label["class-head"].event.noise_multiplier == pytest.approx(
            classic_multiplier(0.5, 1e-5)
        )
        assert by_label["scores"].event.noise_multiplier == pytest.approx(
            classic_multiplier(0.1, 1e-5)
        )
    assert res.claims["epsilon"] == pytest.approx(0.6) and res.claims["delta"] == pytest.approx(
        2e-5
    )
    # the accountant's figure for the same two releases is below the paper's basic-composition sum
    assert res.ledger.epsilon(2e-5) < 0.6
    mech = res.claims["mechanisms"]["class-head"]["clients"]
    assert all(
        m["sensitivity_paper"] == pytest.approx(2 * math.sqrt(C) / (0.01 * m["n"])) for m in mech
    )
    assert all(
        m["sensitivity_cfree"] == pytest.approx(2 * math.sqrt(2) / (0.01 * m["n"])) for m in mech
    )


def test_cfree_bound_needs_less_noise(fed):
    paper = train("fedauxfdp", fed, quick("fedauxfdp", sensitivity_bound="paper"), seed=0)
    cfree = train("fedauxfdp", fed, quick("fedauxfdp", sensitivity_bound="cfree"), seed=0)
    s_p = [m["sigma"] for m in paper.claims["mechanisms"]["class-head"]["clients"]]
    s_c = [m["sigma"] for m in cfree.claims["mechanisms"]["class-head"]["clients"]]
    np.testing.assert_allclose(np.array(s_p) / np.array(s_c), math.sqrt(fed.num_classes / 2))


@pytest.mark.parametrize("method", ["fedavg-dphead", "fedd-dphead"])
def test_dp_head_baselines_spend_the_whole_budget_on_one_release(fed, method):
    res = train(
        method,
        fed,
        quick(method, class_epsilon=0.5, score_epsilon=0.1, calibration="classic"),
        seed=0,
    )
    for c in res.ledger.clients:
        (entry,) = res.ledger.entries(c)
        assert entry.label == "class-head"
        assert entry.event.noise_multiplier == pytest.approx(classic_multiplier(0.6, 2e-5))
    assert "scores" not in res.artifacts
    if method == "fedavg-dphead":  # server head = mean of the clients' DP heads
        weight, bias = head_to_linear(res.artifacts["heads"].astype(np.float64).mean(0))
        np.testing.assert_allclose(res.model.head.weight.detach().numpy(), weight, atol=1e-5)
        np.testing.assert_allclose(res.model.head.bias.detach().numpy(), bias, atol=1e-5)


@pytest.mark.parametrize("method", ["fedauxfdp", "fedaux"])
def test_same_seed_same_models(fed, method):
    clear_cache()  # pretraining itself must be reproducible, not just cached
    cfg = {
        **quick(method),
        "reproducible_noise": True,
    }  # release mode draws the DP noise from the OS
    a = train(method, fed, cfg, seed=5)
    clear_cache()
    b = train(method, fed, cfg, seed=5)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    np.testing.assert_array_equal(a.artifacts["scores"], b.artifacts["scores"])
    c = train(method, fed, cfg, seed=6)
    assert not np.array_equal(a.artifacts["scores"], c.artifacts["scores"])


def test_save_load_round_trip(fed, tmp_path):
    res = train("fedauxfdp", fed, quick("fedauxfdp"), seed=0)
    res.save(tmp_path)
    back = TrainResult.load(tmp_path)
    x, _ = fed.test_arrays()
    with torch.no_grad():
        xa = torch.as_tensor(x[:50])
        torch.testing.assert_close(res.model.eval()(xa), back.model.eval()(xa))
        torch.testing.assert_close(
            res.client_models[0].eval()(xa), back.client_models[0].eval()(xa)
        )
    assert back.ledger.epsilon(2e-5) == pytest.approx(res.ledger.epsilon(2e-5))
    np.testing.assert_array_equal(back.artifacts["heads"], res.artifacts["heads"])


def test_one_shot_mode_and_config_errors():
    cfg = get_trainer("fedavg").config_cls.model_validate({"one_shot": True})
    assert (cfg.rounds, cfg.participation, cfg.local_epochs) == (1, 1.0, 40)
    with pytest.raises(ValueError, match="freeze"):
        get_trainer("fedavg").config_cls.model_validate({"freeze": True, "pretrain": False})
    with pytest.raises(ValueError, match="pretrain and freeze"):
        get_trainer("fedauxfdp").config_cls.model_validate({"freeze": False})
    with pytest.raises(ValueError):
        get_trainer("fedauxfdp").config_cls.model_validate({"sensitivity_bound": "loose"})


def test_fedd_baseline_distils_the_mean_logit_ensemble(fed):
    """FedD (FedAUX Eq. 2) labels with softmax(mean of the clients' logits). On a shared frozen h0
    that is the mean head's output, i.e. FedAvg+P's released model: checked through that model."""
    from privkit.trainers.common import predict_logits

    # reproducible noise: both baselines then release the very same DP heads
    fedd = train("fedd-dphead", fed, {**quick("fedd-dphead"), "reproducible_noise": True}, seed=4)
    favg = train(
        "fedavg-dphead", fed, {**quick("fedavg-dphead"), "reproducible_noise": True}, seed=4
    )
    assert np.array_equal(fedd.artifacts["heads"], favg.artifacts["heads"])  # same DP releases
    # the baseline's claimed budget is what it spends: its epsilon >= 1 release is calibrated with the
    # analytic Gaussian, whose exact epsilon (dp-accounting RDP/PLD of the ledger) meets the claim
    claim = favg.claims
    assert claim["epsilon"] >= 1
    assert favg.ledger.epsilon(claim["delta"], accountant="pld") <= claim["epsilon"] * (1 + 1e-3)
    assert not any("classes_held" in c for c in claim["mechanisms"]["class-head"]["clients"])
    x_distill, _ = fed.public_arrays("distill")
    expected = torch.softmax(
        torch.from_numpy(predict_logits(favg.model, x_distill, torch.device("cpu"))), 1
    )
    assert np.allclose(fedd.artifacts["soft_labels"], expected.numpy(), atol=1e-5)
    prob = train("fedd-dphead", fed, quick("fedd-dphead", ensemble="probabilities"), seed=4)
    assert not np.allclose(prob.artifacts["soft_labels"], fedd.artifacts["soft_labels"], atol=1e-3)


def test_stacked_clients_started_from_the_global_model_train_as_its_copies(fed):
    """An audit's reference run hands its stacked clients its spare modules as the last round
    left them (``local_module``) and starts them from its global model itself; round after round
    each trained client equals, bit for bit, the same client trained stacked from a copy of the
    global model in its own module (``local_copy``), and so does the averaged model."""
    from privkit.batched.exact_mlp import model_for, train_exact
    from privkit.batched.many_fedavg import local_epochs
    from privkit.methods import make_config
    from privkit.trainers.fedavg import FederatedRun

    cfg = make_config("fedprox", quick("fedprox", rounds=3, participation=0.5))
    fast, copies = FederatedRun(fed, cfg, 0, mu=cfg.mu), FederatedRun(fed, cfg, 0, mu=cfg.mu)
    while (selected := fast.next_round()) is not None:
        assert copies.next_round() == selected
        (got,) = local_epochs([fast], [selected], fast=frozenset({id(fast)}))
        models = []
        for i in selected:
            x, y = fed.client_arrays(i)
            models.append(
                model_for(
                    copies.local_copy(),
                    x,
                    y,
                    epochs=cfg.local_epochs,
                    batch_size=cfg.batch_size,
                    seed=copies.local_seed(i),
                    device=copies.device,
                )
            )
        per_epoch = [len(m.batches) // cfg.local_epochs for m in models]
        totals = train_exact(
            copies.model,
            models,
            optimizer=cfg.optimizer,
            lr=cfg.lr,
            mu=[cfg.mu] * len(models),
            anchors=[copies.anchor] * len(models),
            loss_from=[(cfg.local_epochs - 1) * k for k in per_epoch],
            stacked=True,
        )
        want = [(s, t / len(m.y)) for s, m, t in zip(copies.spares, models, totals)]
        for (local, loss), (module, want_loss) in zip(got, want):
            assert loss == want_loss
            a, b = local.state_dict(), module.state_dict()
            assert all(torch.equal(a[k], b[k]) for k in b)
        fast.finish_round(got)
        copies.finish_round([(m, loss) for m, loss in want])
    a, b = fast.model.state_dict(), copies.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)
