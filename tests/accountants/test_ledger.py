"""Ledger: composition per client and worst client, mixed ledgers, errors, JSON round trip."""

import itertools
import math

import dp_accounting as dpa
import pytest

import accountants as acc
from accountants.composition import advanced_composition


def _fedauxfdp(clients=3):
    """FedAUXfdp Table 2 budget: scores (0.1, 1e-5) + class heads (0.5, 1e-5), classic Gaussian."""
    ledger = acc.Ledger()
    s1 = acc.classic_gaussian_sigma(0.1, 1e-5)
    s2 = acc.classic_gaussian_sigma(0.5, 1e-5)
    for c in range(clients):
        ledger.add(c, dpa.GaussianDpEvent(s1), "scores", neighbouring="replace_one")
        ledger.add(c, dpa.GaussianDpEvent(s2), "class-head", neighbouring="replace_one")
    return ledger, s1, s2


def test_fedauxfdp_best_is_tighter_than_paper_basic():
    ledger, s1, s2 = _fedauxfdp()
    best = ledger.epsilon(2e-5)
    assert best < 0.6  # the paper's basic composition (0.6, 2e-5)
    # Two Gaussians compose into one with 1/s^2 = 1/s1^2 + 1/s2^2 (exact): PLD must be within its grid.
    exact = acc.gaussian_epsilon(1 / math.sqrt(s1**-2 + s2**-2), 2e-5)
    assert exact <= best <= exact + 2e-3
    assert ledger.account(2e-5).accountant == "pld"
    # labels: the scoring part alone is one Gaussian at (0.1, 1e-5) classic => analytic eps < 0.1
    assert ledger.epsilon(1e-5, labels=["scores"]) == pytest.approx(
        acc.gaussian_epsilon(s1, 1e-5), abs=2e-4
    )


def test_basic_and_advanced_by_hand():
    ledger = acc.Ledger()
    for e, d in [(0.3, 1e-6), (0.2, 2e-6), (0.5, 1e-6)]:
        ledger.add("a", acc.EpsilonDeltaEvent(e, d), "m")
    assert ledger.epsilon(1e-5, accountant="basic") == pytest.approx(1.0)
    assert ledger.epsilon(4e-6, accountant="basic") == pytest.approx(1.0)
    assert (
        ledger.epsilon(3.9e-6, accountant="basic") == math.inf
    )  # fixed deltas alone exceed target
    adv, tot = advanced_composition([(0.3, 1e-6), (0.2, 2e-6), (0.5, 1e-6)], 6e-6)
    assert ledger.epsilon(1e-5, accountant="advanced") == pytest.approx(adv)
    assert tot <= 1e-5


def test_mixed_ledger_splits_delta():
    ledger = acc.Ledger()
    ev = acc.dpsgd_event(0.01, 1.0, 1000)
    ledger.add(0, ev, "dp-sgd")
    ledger.add(0, acc.EpsilonDeltaEvent(0.5, 2e-6), "extra")
    ledger.add(0, acc.NfdpSubsampleEvent(10**6, 1, False), "nfdp")  # exact (0, 1e-6)
    res = ledger.account(1e-5, accountant="rdp")
    assert res.fixed_epsilon == pytest.approx(0.5) and res.fixed_delta == pytest.approx(3e-6)
    assert res.tight_delta == pytest.approx(7e-6)
    rdp = dpa.rdp.RdpAccountant()
    rdp.compose(ev)
    assert res.epsilon == pytest.approx(0.5 + rdp.get_epsilon(7e-6), rel=1e-12)
    summary = ledger.summary(1e-5)
    assert set(summary["clients"]["0"]) == {"basic", "advanced", "rdp", "pld", "best"}
    assert summary["clients"]["0"]["best"] == min(
        v for k, v in summary["clients"]["0"].items() if k != "best"
    )


def test_worst_client_and_delta():
    ledger = acc.Ledger()
    ledger.add("a", dpa.GaussianDpEvent(4.0), "g")
    ledger.add("b", dpa.GaussianDpEvent(2.0), "g")
    assert ledger.clients == ["a", "b"]
    assert (
        ledger.epsilon(1e-5) == ledger.epsilon(1e-5, client="b") > ledger.epsilon(1e-5, client="a")
    )
    summary = ledger.summary(1e-5)
    assert summary["worst_client"]["best"] == "b"
    assert summary["worst"]["best"] == summary["clients"]["b"]["best"]
    # delta(eps) inverts epsilon(delta) (exact analytic Gaussian as the reference).
    eps = acc.gaussian_epsilon(2.0, 1e-6)
    assert ledger.delta(eps, client="b", accountant="pld") == pytest.approx(1e-6, rel=0.05)
    assert ledger.delta(eps) >= ledger.delta(eps, client="a")


def test_non_private_is_infinite_never_zero_or_error():
    ledger = acc.Ledger()
    ledger.add(1, dpa.GaussianDpEvent(3.0), "scores")
    ledger.add(1, acc.NonPrivateEvent("client model sent in the clear"), "client-model")
    for kind in ("basic", "advanced", "rdp", "pld", "best"):
        assert ledger.epsilon(1e-5, accountant=kind) == math.inf
        assert ledger.delta(1.0, accountant=kind) == 1.0
    assert ledger.epsilon(1e-5, labels=["scores"]) < math.inf


def test_unsupported_event_names_event_and_label():
    ledger = acc.Ledger()
    wr = dpa.SampledWithReplacementDpEvent(100, 10, dpa.GaussianDpEvent(1.0))
    ledger.add(0, wr, "with-replacement step")
    with pytest.raises(ValueError, match=r"SampledWithReplacementDpEvent.*with-replacement step"):
        ledger.epsilon(1e-5)
    with pytest.raises(ValueError, match="with-replacement step"):
        ledger.epsilon(1e-5, accountant="pld")
    wor = acc.Ledger()
    wor.add(
        0, acc.dpsgd_event(0.1, 2.0, 10, "without-replacement"), "wor", neighbouring="replace_one"
    )
    with pytest.raises(ValueError, match="'pld' cannot handle"):
        wor.epsilon(1e-5, accountant="pld")
    assert wor.epsilon(1e-5) == pytest.approx(
        acc.dpsgd_epsilon(0.1, 2.0, 10, 1e-5, "without-replacement")
    )
    assert "pld" in wor.summary(1e-5)["not_applicable"]


def test_mixed_neighbouring_and_bad_input():
    ledger = acc.Ledger()
    ledger.add(0, dpa.GaussianDpEvent(3.0), "a", neighbouring="replace_one")
    ledger.add(0, dpa.GaussianDpEvent(3.0), "b")
    with pytest.raises(ValueError, match="mixes neighbouring"):
        ledger.epsilon(1e-5)
    with pytest.raises(ValueError, match="neighbouring"):
        ledger.add(0, dpa.GaussianDpEvent(3.0), "c", neighbouring="swap")
    with pytest.raises(ValueError, match="client must be one of"):
        ledger.epsilon(1e-5, client="nobody")
    with pytest.raises(ValueError, match="labels"):
        ledger.epsilon(1e-5, labels=["nope"])
    with pytest.raises(ValueError, match="empty"):
        acc.Ledger().epsilon(1e-5)


def test_epsilon_over_rounds():
    ledger = acc.Ledger()
    step = acc.dpsgd_event(0.01, 1.0, 50)
    for r in range(5):
        for c in range(3):
            ledger.add(c, step, f"round {r}", round=r)
    curve = ledger.epsilon_over_rounds(1e-5, accountant="rdp")
    assert [r for r, _ in curve] == list(range(5))
    assert all(a[1] < b[1] for a, b in itertools.pairwise(curve))
    assert curve[-1][1] == pytest.approx(ledger.epsilon(1e-5, accountant="rdp"), rel=1e-12)
    pld = ledger.epsilon_over_rounds(1e-5, accountant="pld")
    ref = acc.dpsgd_epsilon(
        0.01, 1.0, 150, 1e-5, accountant="pld", value_discretization_interval=1e-3
    )
    assert pld[2][1] == pytest.approx(ref, rel=1e-6)


def test_json_round_trip(tmp_path):
    ledger, _, _ = _fedauxfdp(2)
    ledger.add(5, acc.dpsgd_event(0.02, 1.3, 200), "round 1: dp-sgd", round=1)
    ledger.add(5, acc.EpsilonDeltaEvent(0.2, 1e-7), "extra", round=2)
    ledger.add(6, acc.NfdpSubsampleEvent(5000, 50, True), "nfdp")
    ledger.add(7, acc.NonPrivateEvent("clear"), "fedaux")
    path = ledger.save(tmp_path / "ledger.json")
    import json

    assert json.loads(path.read_text())["schema_version"] == acc.SCHEMA_VERSION
    back = acc.Ledger.load(path)
    assert back.clients == ledger.clients
    for c in ledger.clients:
        assert back.entries(c) == ledger.entries(c)
    assert back.summary(1e-3) == ledger.summary(1e-3)
    with pytest.raises(ValueError, match="schema_version"):
        acc.Ledger.from_dict({"schema_version": 99, "clients": {}})


def test_summary_restricted_to_some_accountants_matches_the_full_summary():
    """A subset of accountants gives the same per-client values; 'best' is the minimum over the
    subset only; worst client and relation come out as in the full summary."""
    ledger = acc.Ledger()
    for c, (q, sigma, steps) in enumerate([(0.1, 1.5, 20), (0.2, 1.2, 10), (0.05, 2.0, 50)]):
        ledger.add(
            c,
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps
            ),
            label="dp-sgd",
        )
        ledger.add(c, dpa.GaussianDpEvent(3.0), label="head")
    ref = ledger.summary(1e-5)
    both = ledger.summary(1e-5, accountants=["rdp", "pld"])
    assert both["not_applicable"] == {} and set(both["clients"]) == set(ref["clients"])
    for c, row in both["clients"].items():
        assert set(row) == {"rdp", "pld", "best"}
        for kind in ("rdp", "pld"):
            assert row[kind] == pytest.approx(ref["clients"][c][kind], rel=1e-9), (c, kind)
        assert row["best"] == min(row["rdp"], row["pld"])
    assert both["worst"]["pld"] == pytest.approx(ref["worst"]["pld"])
    assert both["worst_client"]["pld"] == ref["worst_client"]["pld"]
    assert both["neighbouring"] == ref["neighbouring"]
    sub = ledger.summary(1e-5, accountants=["rdp"])
    assert all(
        r["best"] == r["rdp"] == pytest.approx(ref["clients"][c]["rdp"])
        for c, r in sub["clients"].items()
    )
    with pytest.raises(
        ValueError,
        match="accountants must be a non-empty subset of basic, advanced, "
        "rdp, pld; found \\['prv'\\]",
    ):
        ledger.summary(1e-5, accountants=["prv"])


def _every_clients_worst(ledger, delta):
    """The worst client under the best accountant, every client's best computed (the definition)."""
    results = [ledger.account(delta, client=k) for k in ledger.clients]
    return max(results, key=lambda r: r.epsilon)


def _mixed_ledger(seed: int) -> acc.Ledger:
    """Nine clients of 1-5 DP-SGD rounds with adaptive multipliers, some with an (epsilon,
    delta)-only entry, and two equal clients (a tie)."""
    import random

    rng = random.Random(seed)
    ledger = acc.Ledger()
    ledger.value_discretization_interval = 1e-3
    sigmas = [0.9, 1.0, 1.2]
    for c in range(9):
        for r in range(rng.randint(1, 5)):
            ledger.add(c, acc.dpsgd_event(0.05, rng.choice(sigmas), 20), f"round {r}", round=r)
        if c % 4 == 3:
            ledger.add(c, acc.EpsilonDeltaEvent(0.3, 1e-7), "extra")
    for r in range(3):  # two clients with equal entries: a tie between them
        for c in ("tie-a", "tie-b"):
            ledger.add(c, acc.dpsgd_event(0.05, 0.9, 20), f"round {r}", round=r)
    return ledger


@pytest.mark.parametrize("seed", range(3))
def test_account_and_delta_split_give_the_summarys_worst_best_and_split(seed):
    """What `privkit train`'s headline takes instead of a whole summary (seconds per client of
    basic and advanced composition): the worst client's best epsilon, and each client's delta
    split, as the summary gives them, with and without a non-private client."""
    ledger = _mixed_ledger(seed)
    for delta in (1e-5, 1e-9):
        summary = ledger.summary(delta)
        assert ledger.account(delta).epsilon == summary["worst"]["best"]
        assert ledger.delta_split(delta) == summary["delta_split"]
    ledger.add("clear", acc.NonPrivateEvent("sent in the clear"), "model")
    summary = ledger.summary(1e-5)
    assert ledger.account(1e-5).epsilon == summary["worst"]["best"] == math.inf
    assert ledger.delta_split(1e-5) == summary["delta_split"]
    assert ledger.delta_split(1e-5)["clear"]["non_private"]


@pytest.mark.parametrize("seed", range(4))
def test_worst_client_pruned_by_rdp_is_every_clients_worst(seed):
    """``epsilon(delta)`` takes the clients' best in decreasing order of their RDP epsilon and stops
    where the rest's RDP epsilon is below the worst found; it must give the worst of every
    client's best: the same epsilon, accountant and client, ties included (the first in client
    order), with (epsilon, delta)-only entries, a non-private client and adaptive multipliers."""
    ledger = _mixed_ledger(seed)
    calls = []
    original = ledger._account_one

    def spy(key, entries, delta, accountant):
        calls.append((key, accountant))
        return original(key, entries, delta, accountant)

    ledger._account_one = spy
    got = ledger.account(1e-5)
    best_calls = sum(1 for _, a in calls if a == "best")
    ledger._account_one = original
    want = _every_clients_worst(ledger, 1e-5)
    assert (got.epsilon, got.accountant, got.client) == (want.epsilon, want.accountant, want.client)
    assert best_calls < len(ledger.clients)  # some clients could not be the worst
    ledger.add("clear", acc.NonPrivateEvent("sent in the clear"), "model")
    assert ledger.epsilon(1e-5) == math.inf == _every_clients_worst(ledger, 1e-5).epsilon


def test_worst_client_of_equal_clients_is_the_first_in_client_order():
    ledger = acc.Ledger()
    for c, rounds in (("small", 1), ("z", 4), ("y", 4)):
        for r in range(rounds):
            ledger.add(c, acc.dpsgd_event(0.05, 1.0, 20), f"round {r}", round=r)
    assert ledger.account(1e-5).client == "z" == _every_clients_worst(ledger, 1e-5).client


def test_clients_of_the_same_events_ask_their_accountant_once(monkeypatch):
    """Clients whose entries are the same events share one cached composition, and each question
    to it (an epsilon, a delta, a bracket's lower end, at one argument) is computed once: the
    summary, delta and worst-client bracket of 6 such clients ask as many as one client's, and
    answer what one client accounted alone (every cache cleared between them) answers."""
    from accountants import ledger as L

    def ledger_of(clients):
        led = acc.Ledger()
        for c in clients:
            led.add(c, acc.dpsgd_event(0.02, 1.1, 300), "dp-sgd")
            led.add(c, acc.EpsilonDeltaEvent(0.1, 1e-7), "extra")
        return led

    asked: list[tuple[str, float]] = []
    made = L._new_accountant

    def counting(kind, relation, vdi):
        a = made(kind, relation, vdi)
        for method in ("get_epsilon", "get_delta", "epsilon_with_fixed"):
            real = getattr(a, method, None)
            if real is None:
                continue
            setattr(a, method, lambda *x, real=real, m=method: asked.append((m, x)) or real(*x))
        return a

    monkeypatch.setattr(L, "_new_accountant", counting)
    answers = {}
    for clients in ([0], list(range(6))):
        L._CACHE.clear()
        asked.clear()
        led = ledger_of(clients)
        answers[len(clients)] = (
            led.summary(1e-5),
            led.delta(2.0),
            led.pld_bracket(1e-5, worst_only=True)["worst"],
        )
        if len(clients) == 1:
            alone = len(asked)
        else:
            assert len(asked) == alone
    one, six = answers[1], answers[6]
    assert set(six[0]["clients"]) == {str(c) for c in range(6)}
    for row in six[0]["clients"].values():
        assert row == one[0]["clients"]["0"]
    assert six[0]["worst"] == one[0]["worst"] and six[1:] == one[1:]
    assert ("epsilon_with_fixed", (1e-5, ((0.1, 1e-7),))) in asked  # the bracket's lower end
