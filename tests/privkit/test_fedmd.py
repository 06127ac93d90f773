"""FedMD-NFDP, FedMD-NP and FedMD-LDP: privacy ledger against the theorems and a peer accountant,
determinism, the digest/revisit data flow, and the knowledge modes."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from scipy.special import softmax

from accountants import NfdpSubsampleEvent, NonPrivateEvent
from privkit.data import FederationConfig, build_federation
from privkit.errors import PrivkitError
from privkit.models import build_from_spec
from privkit.trainers import TrainResult, fedmd, get_trainer, train

TINY = {
    "arch": "mlp",
    "feature_dim": 16,
    "rounds": 2,
    "init_epochs": 1,
    "pretrain_epochs": 1,
    "public_subset": 40,
    "digest_epochs": 1,
    "revisit_epochs": 1,
    "revisit_batch_size": 8,
    "device": "cpu",
    "labels": "shared",  # every class on both sides: n is the party's whole dataset
}


@pytest.fixture(scope="module")
def fed():
    full = build_federation(FederationConfig(clients=3, partition="iid", seed=1))
    # Small parties of different sizes keep the runs fast and make n differ per party.
    return full.with_clients([c[:s] for c, s in zip(full.clients, (60, 45, 30))], "small")


def _run(method, fed, seed=0, **over):
    return train(method, fed, {**TINY, **over}, seed=seed)


# ----------------------------------------------------------------------------- ledger / claims
@pytest.mark.parametrize("replacement", [True, False])
def test_nfdp_ledger_one_event_per_party_matching_theorems(fed, replacement):
    k = 7
    res = _run("fedmd-nfdp", fed, k=k, replacement=replacement)
    assert res.ledger.clients == ["0", "1", "2"]
    for i, idx in enumerate(fed.clients):
        n = len(idx)
        (entry,) = res.ledger.entries(i)  # exactly one event, nothing per round
        assert entry.round is None
        assert entry.event == NfdpSubsampleEvent(n=n, k=k, replacement=replacement)
        claim = res.claims["per_client"][i]
        # Theorem 2 / Theorem 1 closed forms, natural logarithm.
        if replacement:
            eps, delta = k * math.log((n + 1) / n), 1 - ((n - 1) / n) ** k
        else:
            eps, delta = math.log((n + 1) / (n + 1 - k)), k / n
        assert claim["epsilon"] == pytest.approx(eps, rel=1e-12)
        assert claim["delta"] == pytest.approx(delta, rel=1e-12)
        assert claim["epsilon_table2_log10"] == pytest.approx(eps / math.log(10), rel=1e-12)
        # The exact profile is flat at the theorem's delta: epsilon 0 just above it, inf below it.
        assert res.ledger.epsilon(min(delta * 1.001, 0.999), client=i) == 0.0
        assert res.ledger.epsilon(delta * 0.999, client=i) == math.inf
    worst_delta = max(c["delta"] for c in res.claims["per_client"])
    assert res.claims["delta"] == worst_delta
    assert any("delta >= 1/n" in w for w in res.warnings)
    assert any("log10" in w for w in res.warnings)


def test_table2_log10_convention_reproduces_the_papers_numbers():
    # FedMD-NFDP Table 2, FEMNIST n=2880: k=2880 prints 0.4342 / 0.6321; k=300 prints 0.0452 / 0.0989.
    c = fedmd.nfdp_claim(2880, 2880, True)
    assert round(c["epsilon_table2_log10"], 4) == 0.4342
    assert round(c["epsilon"], 4) == 0.9998  # the theorem's (natural-log) value
    assert math.floor(c["delta"] * 1e4) / 1e4 == 0.6321
    c = fedmd.nfdp_claim(2880, 300, True)
    assert round(c["epsilon_table2_log10"], 4) == 0.0452
    assert round(c["delta"], 4) == 0.0989
    # CIFAR n=300, k=60: 0.0867 / 0.1815.
    c = fedmd.nfdp_claim(300, 60, True)
    assert (round(c["epsilon_table2_log10"], 4), round(c["delta"], 4)) == (0.0867, 0.1815)


def test_np_ledger_is_non_private(fed):
    res = _run("fedmd-np", fed)
    for i in range(fed.num_clients):
        (entry,) = res.ledger.entries(i)
        assert isinstance(entry.event, NonPrivateEvent)
    assert res.ledger.epsilon(1e-5) == math.inf


@pytest.mark.parametrize("knowledge, sens", [("softmax", math.sqrt(2)), ("logits", 2 * 3.0)])
def test_ldp_noise_calibrated_to_nfdp_epsilon_by_peer_accountant(fed, knowledge, sens):
    res = _run("fedmd-ldp", fed, knowledge=knowledge, match_k=5, logit_clip=3.0)
    rounds, m_pub = TINY["rounds"], TINY["public_subset"]
    assert res.claims["sensitivity"] == pytest.approx(sens)
    for i, idx in enumerate(fed.clients):
        n = len(idx)
        target_eps, target_delta = 5 * math.log((n + 1) / n), 1 - ((n - 1) / n) ** 5
        entries = res.ledger.entries(i)
        assert isinstance(entries[0].event, NonPrivateEvent)  # the released party model
        gauss = entries[1:]
        assert [e.round for e in gauss] == list(range(1, rounds + 1))
        z = gauss[0].event.event.noise_multiplier
        assert all(e.event.count == m_pub for e in gauss)
        sigma = res.claims["per_client"][i]["sigma"]
        assert z == pytest.approx(sigma / sens, rel=1e-12)
        # Peer check: dp-accounting's PLD on the composition of all rounds x queries.
        acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
        acc.compose(dpa.GaussianDpEvent(z), rounds * m_pub)
        assert acc.get_epsilon(target_delta) == pytest.approx(target_eps, rel=2e-3)
        assert res.ledger.epsilon(
            target_delta, client=i, labels=["ldp predictions"]
        ) == pytest.approx(target_eps, rel=2e-3)
    assert res.ledger.epsilon(0.5) == math.inf  # the party model itself is not private


# ----------------------------------------------------------------------------- determinism / IO
def test_same_seed_same_result_and_roundtrip(fed, tmp_path):
    # reproducible-noise mode: the NFDP subsample is then a function of the seed (and stored)
    a = _run("fedmd-nfdp", fed, seed=3, k=9, reproducible_noise=True)
    b = _run("fedmd-nfdp", fed, seed=3, k=9, reproducible_noise=True)
    c = _run("fedmd-nfdp", fed, seed=4, k=9, reproducible_noise=True)
    assert a.rounds == b.rounds
    for ma, mb in zip(a.client_models, b.client_models):
        for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items()):
            assert ka == kb and torch.equal(va, vb)
    for key in a.artifacts:
        assert np.array_equal(a.artifacts[key], b.artifacts[key])
    assert any(not np.array_equal(a.artifacts[k], c.artifacts[k]) for k in a.artifacts)
    # heterogeneous parties, each rebuildable from its spec; save/load keeps everything
    assert len({repr(s) for s in a.client_model_specs}) == 3
    a.save(tmp_path)
    back = TrainResult.load(tmp_path)
    assert back.client_accuracy == a.client_accuracy
    x, _ = fed.test_arrays()
    with torch.no_grad():
        for m, spec, m2 in zip(a.client_models, a.client_model_specs, back.client_models):
            rebuilt = build_from_spec(spec)
            rebuilt.load_state_dict(m.state_dict())
            xt = torch.as_tensor(x[:5])
            assert torch.allclose(rebuilt(xt), m.eval()(xt)) and torch.allclose(m2(xt), m(xt))


# ----------------------------------------------------------------------------- data flow
def test_subset_drawn_once_revisit_uses_it_digest_uses_public(fed, monkeypatch):
    calls = {"revisit": [], "digest": []}
    real_revisit, real_digest = fedmd.revisit, fedmd.digest

    def spy_revisit(model, x, y, **kw):
        calls["revisit"].append((x.copy(), y.copy(), kw["epochs"]))
        return real_revisit(model, x, y, **kw)

    def spy_digest(model, x, consensus, mode, **kw):
        calls["digest"].append((x.copy(), consensus.copy(), mode))
        return real_digest(model, x, consensus, mode, **kw)

    monkeypatch.setattr(fedmd, "revisit", spy_revisit)
    monkeypatch.setattr(fedmd, "digest", spy_digest)
    k = 11
    # reproducible mode: only then does the run keep the (otherwise secret) subset indices
    res = _run(
        "fedmd-nfdp", fed, k=k, replacement=False, knowledge="argmax", reproducible_noise=True
    )
    N, R = fed.num_clients, TINY["rounds"]
    # initialisation + R revisits per party, always on the same k records of that party
    assert len(calls["revisit"]) == N * (R + 1)
    assert [c[2] for c in calls["revisit"][:N]] == [TINY["init_epochs"]] * N
    for i in range(N):
        sub = res.artifacts[f"subset_indices/client_{i}"]
        assert len(sub) == k == len(np.unique(sub)) and np.isin(sub, fed.clients[i]).all()
        mine = [calls["revisit"][i]] + [calls["revisit"][N + (t * N) + i] for t in range(R)]
        for x, y, _ in mine:
            assert np.array_equal(x, fed.private.x[sub]) and np.array_equal(y, fed.private.y[sub])
    # digest: public rows only, same X_p for every party in a round, argmax votes averaged
    pub = {r.tobytes() for r in fed.public.x}
    assert len(calls["digest"]) == N * R
    for t in range(R):
        round_calls = calls["digest"][t * N : (t + 1) * N]
        x0, cons0, mode = round_calls[0]
        assert mode == "argmax" and len(x0) == TINY["public_subset"]
        assert all(r.tobytes() in pub for r in x0)
        assert all(np.array_equal(c[0], x0) and np.array_equal(c[1], cons0) for c in round_calls)
        np.testing.assert_allclose(cons0.sum(1), 1.0, rtol=1e-6)
        np.testing.assert_allclose(cons0 * N, np.round(cons0 * N), atol=1e-5)  # vote shares


def test_np_revisits_all_private_data(fed, monkeypatch):
    seen = []
    real = fedmd.revisit
    monkeypatch.setattr(
        fedmd, "revisit", lambda m, x, y, **kw: seen.append(len(y)) or real(m, x, y, **kw)
    )
    _run("fedmd-np", fed, rounds=1)
    assert seen[:3] == [len(c) for c in fed.clients]


# ----------------------------------------------------------------------------- knowledge modes
def test_knowledge_modes_and_aggregation():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(6, 4)).astype(np.float32) for _ in range(3)]
    np.testing.assert_array_equal(fedmd.share_knowledge(logits[0], "logits"), logits[0])
    np.testing.assert_allclose(
        fedmd.share_knowledge(logits[0], "softmax"), softmax(logits[0], axis=1), rtol=1e-5
    )
    votes = fedmd.share_knowledge(logits[0], "argmax")
    assert np.array_equal(votes.argmax(1), logits[0].argmax(1)) and np.array_equal(
        votes.sum(1), np.ones(6)
    )
    agg = fedmd.aggregate_knowledge([fedmd.share_knowledge(z, "argmax") for z in logits])
    np.testing.assert_allclose(
        agg, np.mean([fedmd.share_knowledge(z, "argmax") for z in logits], 0)
    )
    noisy = np.array([[0.5, -0.2, 0.7], [-1.0, -2.0, -0.1]], np.float32)
    proj = fedmd.project_to_simplex_rows(noisy)
    np.testing.assert_allclose(proj, [[0.5 / 1.2, 0, 0.7 / 1.2], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-6)
    clipped = fedmd.clip_rows(np.array([[3.0, 4.0], [0.3, 0.4]], np.float32), 1.0)
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)
    with pytest.raises(PrivkitError, match="knowledge must be one of"):
        fedmd.share_knowledge(logits[0], "votes")


@pytest.mark.parametrize("mode", ["logits", "softmax"])
def test_digest_moves_predictions_towards_consensus(mode):
    torch.manual_seed(0)
    model = build_from_spec(
        {"arch": "mlp", "input_shape": [1, 8, 8], "num_classes": 4, "feature_dim": 16}
    )
    x = np.random.default_rng(1).random((64, 1, 8, 8)).astype(np.float32)
    teacher = build_from_spec(
        {"arch": "mlp", "input_shape": [1, 8, 8], "num_classes": 4, "feature_dim": 32}
    )
    with torch.no_grad():  # a realisable consensus: another network's (sharpened) outputs
        target_logits = (teacher(torch.as_tensor(x)) * 10).numpy()
    target = (
        target_logits if mode == "logits" else softmax(target_logits, axis=1).astype(np.float32)
    )
    dev = torch.device("cpu")

    def gap():
        out = fedmd.predict_logits(model, x, dev)
        if mode == "logits":
            return np.abs(out - target).mean()
        p = softmax(out, axis=1)
        return (target * (np.log(target) - np.log(p))).sum(1).mean()

    before = gap()
    fedmd.digest(model, x, target, mode, epochs=30, batch_size=16, lr=1e-2, device=dev, seed=0)
    assert gap() < 0.5 * before


def test_bad_inputs_name_the_value(fed):
    with pytest.raises(PrivkitError, match=r"k must be <= n .* found k=100, n=60"):
        _run("fedmd-nfdp", fed, k=100, replacement=False)
    with pytest.raises(PrivkitError, match="released_party must be < 3"):
        _run("fedmd-np", fed, released_party=5)


def test_quick_configs_registered():
    for name in ("fedmd-nfdp", "fedmd-np", "fedmd-ldp"):
        spec = get_trainer(name)
        q = spec.quick_config()
        assert q["rounds"] < spec.defaults()["rounds"]
    d = get_trainer("fedmd-nfdp").defaults()
    assert (
        d["rounds"],
        d["init_epochs"],
        d["digest_epochs"],
        d["revisit_epochs"],
        d["public_subset"],
    ) == (20, 20, 2, 1, 5000)


# ----------------------------------------------------------------------------- disjoint label spaces
@pytest.fixture(scope="module")
def mixed():
    # Client indices are sorted and mnist5k is ordered by label, so a prefix holds one class; a
    # random subset of each client holds all classes.
    full = build_federation(FederationConfig(clients=3, partition="iid", seed=1))
    rng = np.random.default_rng(0)
    return full.with_clients(
        [np.sort(rng.choice(c, s, replace=False)) for c, s in zip(full.clients, (80, 60, 50))],
        "mixed",
    )


def test_disjoint_labels_pretraining_alone_knows_no_private_class(mixed):
    fed = mixed
    # The paper's setting: public and private labels are disjoint, so the pretrained model never
    # predicts a private class (accuracy 0 on the private test records) and chance is that of the
    # private classes. With shared labels, pretraining alone already solves much of the task.
    over = {"rounds": 0, "init_epochs": 0, "pretrain_epochs": 3}
    shared = _run("fedmd-np", fed, **over)
    disjoint = _run("fedmd-np", fed, **{**over, "labels": "disjoint"})
    assert shared.test_accuracy > 2 * shared.chance_accuracy
    assert disjoint.test_accuracy == 0.0
    _, yt = fed.test_arrays()
    priv = yt[yt >= 5]
    assert disjoint.chance_accuracy == pytest.approx(np.bincount(priv).max() / len(priv))
    assert any("disjoint label spaces" in w for w in disjoint.warnings)


def test_disjoint_labels_each_side_sees_only_its_classes(mixed, monkeypatch):
    fed = mixed
    seen = {"pretrain": [], "revisit": []}
    real_pre, real_rev = fedmd.pretrain_parties, fedmd.revisit
    monkeypatch.setattr(
        fedmd,
        "pretrain_parties",
        lambda *a, public, **kw: (
            seen["pretrain"].append(np.unique(public[1])) or real_pre(*a, public=public, **kw)
        ),
    )
    monkeypatch.setattr(
        fedmd,
        "revisit",
        lambda m, x, y, **kw: seen["revisit"].append(y.copy()) or real_rev(m, x, y, **kw),
    )
    res = _run(
        "fedmd-nfdp",
        fed,
        k=7,
        labels="disjoint",
        public_classes=[0, 1, 2],
        private_classes=[6, 7, 8, 9],
        reproducible_noise=True,
    )  # keeps the subset indices
    assert all(set(u) <= {0, 1, 2} for u in seen["pretrain"]) and seen["pretrain"]
    assert all(set(np.unique(y)) <= {6, 7, 8, 9} for y in seen["revisit"])
    for i in range(fed.num_clients):
        _, y = fed.client_arrays(i)
        n = int(
            np.isin(y, [6, 7, 8, 9]).sum()
        )  # the theorems' n: the party's private-class records
        (entry,) = res.ledger.entries(i)
        assert entry.event == NfdpSubsampleEvent(n=n, k=7, replacement=True)
        assert set(fed.private.y[res.artifacts[f"subset_indices/client_{i}"]]) <= {6, 7, 8, 9}
    # test accuracy is over the private-class test records only
    xt, yt = fed.test_arrays()
    keep = np.isin(yt, [6, 7, 8, 9])
    logits = res.model(torch.as_tensor(xt[keep])).detach().numpy()
    assert res.test_accuracy == pytest.approx(float((logits.argmax(1) == yt[keep]).mean()))


def test_disjoint_label_choices_are_validated(mixed):
    fed = mixed
    with pytest.raises(PrivkitError, match=r"must be disjoint .* found both holding \[2\]"):
        _run("fedmd-np", fed, labels="disjoint", public_classes=[0, 1, 2], private_classes=[2, 3])
    with pytest.raises(
        PrivkitError, match=r"private_classes must be distinct classes in \[0, 10\); found \[12\]"
    ):
        _run("fedmd-np", fed, labels="disjoint", private_classes=[12])
    with pytest.raises(PrivkitError, match="need labels='disjoint'"):
        _run("fedmd-np", fed, public_classes=[0])


# ----------------------------------------------------------------------------- the audit's soft labels
MIXED_PARTIES = [
    {"arch": "mlp", "feature_dim": 16},
    {"arch": "cnn", "width": 4, "feature_dim": 16},
    {"arch": "mlp", "feature_dim": 8, "depth": 2},
]


@pytest.mark.parametrize(
    "over",
    [{}, {"arch": "cnn", "width": 4}, {"party_models": MIXED_PARTIES}],
    ids=["mlps", "cnns", "mixed"],
)
def test_party_models_are_own_copies_of_their_pretrained_model(fed, over):
    """Every party starts from its architecture's pretrained model: the same values, buffers
    included, in tensors of its own (training one party moves no other, nor the pretrained
    model), every parameter trainable."""
    config = fedmd.FedMDNpConfig.model_validate({**TINY, **over})
    specs, jobs = fedmd.pretraining(fed, config, seed=5)
    for job in jobs.values():  # moved off its initialisation, as pretraining would
        with torch.no_grad():
            for q in job.model.parameters():
                q.add_(torch.randn_like(q))
    models = fedmd.party_models(specs, jobs, torch.device("cpu"))
    seen = set()
    for spec, m in zip(specs, models):
        source = jobs[repr(sorted(spec.items()))].model
        want = source.state_dict()
        got = m.state_dict()
        assert list(got) == list(want)
        for k, v in got.items():
            assert v.device.type == "cpu" and torch.equal(v, want[k])
            assert v.data_ptr() != want[k].data_ptr() and v.data_ptr() not in seen
            seen.add(v.data_ptr())
        assert all(q.requires_grad for q in m.parameters())
        assert type(m) is type(source) and str(m) == str(source)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize(
    "over",
    [{}, {"arch": "cnn", "width": 4}, {"party_models": MIXED_PARTIES}],
    ids=["mlps", "cnns", "mixed"],
)
def test_soft_label_artifacts_are_each_partys_own_and_leave_the_models_alone(fed, over, device):
    """The audit's reconstruction of the soft labels FedMD parties share (the party MLPs and CNNs
    of an architecture in one stacked pass, any other model on its own) gives the probabilities
    of each party's own forward pass up to float rounding, float32, under the same keys; the released
    models it reads keep their device, training mode and parameters."""
    import copy

    from attacks.recipe import torch_logits
    from attacks.signals import probabilities
    from privkit.audit.instantiations import soft_label_artifacts

    config = fedmd.FedMDNpConfig.model_validate({**TINY, **over})
    parties = fedmd.party_model_specs(config, fed.num_clients)
    torch.manual_seed(0)
    models = [
        build_from_spec(fedmd._spec_dict(p, fed.input_shape, fed.num_classes)).to(device)
        for p in parties
    ]
    models[0].eval()  # a released model may come in eval mode
    x = fed.public_arrays("distill")[0][:512]
    want = {
        f"party_predictions/client_{i}": probabilities(torch_logits(copy.deepcopy(m), x))
        for i, m in enumerate(models)
    }
    before = [(m.training, {k: q.clone() for k, q in m.state_dict().items()}) for m in models]
    got = soft_label_artifacts(models, fed)
    assert list(got) == list(want)
    for k, p in want.items():
        assert got[k].dtype == np.float32 and got[k].shape == (len(x), fed.num_classes)
        np.testing.assert_allclose(got[k], p, rtol=0, atol=1e-6)
    for m, (training, state) in zip(models, before):
        assert [q.training for q in m.modules()] == [training] * len(list(m.modules()))
        assert all(q.device.type == device for q in m.parameters())
        assert all(torch.equal(q, state[k]) for k, q in m.state_dict().items())
    assert soft_label_artifacts(models[:2], fed) == {}  # not one model per party
