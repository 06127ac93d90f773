"""privkit.flower.CanaryClients: canary clients audit a Flower federation's client-level DP claim
against its ledger (Andrew et al., ICLR 2024), in-process.

The federation: 5 ordinary clients, each moving a 1000-parameter model by a fixed random vector of
norm 2 (twice the clip norm), and 60 canary clients; Flower's FedAvg samples 13 of the 65 nodes per
round (q = 0.2) for 16 rounds; the fixed-clipping wrapper clips to C = 1 and adds noise of
multiplier z = 1 to the mean of 13. Flower draws its clients with ``random`` and its noise with
``numpy.random``: each run seeds both (and restores them after)."""

from __future__ import annotations

import contextlib
import random

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import stats

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

from privkit.flower import Accounted, CanaryClients, run_inprocess
from privkit.flower.canary_clients import CANARY_KEY, canary_mod

DIM, ORDINARY, CANARIES, SAMPLED, ROUNDS = 1000, 5, 60, 13, 16
NODES = ORDINARY + CANARIES
DELTA = 1e-5


@contextlib.contextmanager
def seeded(seed: int):
    """Flower's client draw (``random``) and noise (``numpy.random``) seeded, then restored."""
    py, npy = random.getstate(), np.random.get_state()
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def fedavg(nodes: int = NODES, sampled: int = SAMPLED) -> FedAvg:
    return FedAvg(
        fraction_train=sampled / nodes,
        fraction_evaluate=0.0,
        min_train_nodes=sampled,
        min_available_nodes=nodes,
    )


def federation(
    seed: int,
    *,
    side: str = "client",
    noise: float = 1.0,
    mods: list | None = None,
    weight=lambda pid: 1,
    rounds: int = ROUNDS,
    dim: int = DIM,
    client_sampling: str = "without_replacement",
) -> CanaryClients:
    """Run the federation; ``noise`` scales the wrapper's noise multiplier *after* privkit read it
    (the ledger keeps z = 1: the bug of a federation adding less noise than it claims); ``mods``:
    the ClientApp's mods (default ``fixedclipping_mod`` on the client side, then ``canary_mod``)."""
    rng = np.random.default_rng(1000 + seed)
    steps = rng.standard_normal((NODES, dim))
    steps *= 2.0 / np.linalg.norm(steps, axis=1, keepdims=True)
    if mods is None:
        mods = ([fixedclipping_mod] if side == "client" else []) + [CanaryClients.mod]
    client = ClientApp(mods=mods)
    server, sink = ServerApp(), {}

    @client.train()
    def train(msg, context):
        pid = int(context.node_config["partition-id"])
        arrays = [a + steps[pid] for a in msg.content["arrays"].to_numpy_ndarrays()]
        metrics = MetricRecord({"num-examples": weight(pid), "loss": 0.5})
        return Message(
            RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg
        )

    @server.main()
    def main(grid, context):
        cls = (
            DifferentialPrivacyClientSideFixedClipping
            if side == "client"
            else DifferentialPrivacyServerSideFixedClipping
        )
        dp = cls(fedavg(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=SAMPLED)
        accounted = Accounted(dp, delta=DELTA, client_sampling=client_sampling)
        dp.noise_multiplier *= noise
        strategy = CanaryClients(accounted, canaries=CANARIES, seed=seed)
        strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(dim)]), num_rounds=rounds)
        sink["strategy"] = strategy

    with seeded(seed):
        run_inprocess(server, client, num_nodes=NODES)
    return sink["strategy"]


# ----------------------------------------------------------------------------- the client mod


def _train_message(arrays, config: dict) -> Message:
    content = RecordDict({"arrays": ArrayRecord(arrays), "config": ConfigRecord(config)})
    return Message(content=content, dst_node_id=1, message_type="train")


def _context() -> Context:
    return Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config={})


def _app_reply(msg, context):
    arrays = [a + 1.0 for a in msg.content["arrays"].to_numpy_ndarrays()]
    seen = sorted(next(iter(msg.content.config_records.values())).keys())
    metrics = MetricRecord({"num-examples": 3, "keys": len(seen)})
    return Message(RecordDict({"a": ArrayRecord(arrays), "m": metrics}), reply_to=msg)


def test_canary_mod_replaces_the_model_and_keeps_the_apps_metrics(task):
    sent = [np.zeros((2, 3), dtype=np.float32), np.ones(4, dtype=np.float32)]
    update = np.arange(10, dtype=np.float64)
    msg = _train_message(sent, {"lr": 0.1, CANARY_KEY: update.tobytes()})
    reply = canary_mod(msg, _context(), _app_reply)
    out = reply.content["a"].to_numpy_ndarrays()
    np.testing.assert_array_equal(out[0], np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(out[1], 1 + np.arange(6, 10, dtype=np.float32))
    assert [a.dtype for a in out] == [np.float32, np.float32]
    # the app saw its own config only, and its metrics (weight included) travel unchanged
    assert dict(reply.content["m"]) == {"num-examples": 3, "keys": 1}


def test_canary_mod_passes_other_messages_through(task):
    msg = _train_message([np.zeros(3)], {"lr": 0.1})
    out = canary_mod(msg, _context(), _app_reply).content["a"].to_numpy_ndarrays()
    np.testing.assert_array_equal(out[0], np.ones(3))


def test_canary_mod_names_a_wrong_update_size(task):
    msg = _train_message([np.zeros(3)], {CANARY_KEY: np.zeros(4).tobytes()})
    with pytest.raises(ValueError, match=r"one entry per model parameter \(3\); found 4"):
        canary_mod(msg, _context(), _app_reply)


def test_fixedclipping_mod_clips_a_canary_to_the_clip_norm(task):
    update = 4.0 * np.eye(5)[2]  # raw norm 4, clip norm 0.5
    msg = _train_message([np.zeros(5)], {"clipping_norm": 0.5, CANARY_KEY: update.tobytes()})
    app = ClientApp(mods=[fixedclipping_mod, canary_mod])
    app.train()(_app_reply)
    reply = app(msg, _context())
    np.testing.assert_allclose(reply.content["a"].to_numpy_ndarrays()[0], 0.5 * np.eye(5)[2])


# ----------------------------------------------------------------------------- the claim
def test_claim_is_read_from_the_ledger():
    strategy = federation(0, rounds=4)
    claim, eps = strategy.claim()
    # Flower samples 13 of 65 nodes: q = 0.2; privkit's replace-one multiplier z / 2 = 0.5 is per
    # 2C, so the noise on the sum of the round's updates is 1 clip norm
    np.testing.assert_allclose(claim.sample_rates, np.full(4, 13 / 65))
    np.testing.assert_allclose(claim.noise_multipliers, np.ones(4))
    assert claim.sensitivity == 1.0
    rdp = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dpa.SampledWithoutReplacementDpEvent(NODES, SAMPLED, dpa.GaussianDpEvent(0.5)), 4)
    assert eps == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-9)
    assert strategy.nodes == list(range(ORDINARY + 1, NODES + 1))  # in-process node ids 1..65
    assert [r["replies"] for r in strategy.rounds] == [SAMPLED] * 4


def test_a_ledger_without_amplification_is_read_with_flowers_draw():
    # client_sampling="none": each sampled client is charged Gaussian(z / 2) per round it took part;
    # the claim's rate is Flower's draw, its epsilon the most-sampled canary node's
    strategy = federation(0, rounds=4, client_sampling="none")
    claim, eps = strategy.claim()
    np.testing.assert_allclose(claim.sample_rates, np.full(4, 13 / 65))
    np.testing.assert_allclose(claim.noise_multipliers, np.ones(4))
    ledger = strategy.accounted.ledger
    most = max(len(ledger.entries(n)) for n in strategy.nodes if str(n) in ledger.clients)
    rdp = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    rdp.compose(dpa.GaussianDpEvent(0.5), most)
    assert eps == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-9)
    assert strategy.audit().verdict == "consistent"


def test_an_included_canary_moves_the_release_by_one_clip_norm_per_round():
    # no noise at all: an included canary's total component is its number of appearances (each
    # clipped to C = 1), up to the other sampled clients' updates along it: 13 of norm at most 1 in
    # random directions of 20000 parameters, about sqrt(13 / 20000) = 0.025 per round, 0.06 in 6
    strategy = federation(3, noise=0.0, rounds=6, dim=20_000)
    c = strategy.canaries
    totals = c.evidence().projections.sum(0)
    np.testing.assert_allclose(totals[c.included], c.appearances[c.included], atol=0.3)
    assert np.abs(totals[~c.included]).max() < 0.3
    assert c.appearances[c.included].max() >= 2


# ----------------------------------------------------------------------------- the audit
def _caught(results) -> int:
    return sum(r.verdict == "violation" for r in results)


def test_a_correct_federation_is_flagged_at_no_more_than_the_nominal_rate():
    # 20 seeds, half with client-side and half with server-side clipping; at 95% confidence the
    # count of violations is at most Binomial(20, 0.05): reject validity at the 1% level
    seeds = range(20)
    results = [federation(s, side=("client", "server")[s % 2]).audit() for s in seeds]
    flagged = _caught(results)
    critical = int(stats.binom.isf(0.01, len(seeds), 0.05))  # P(X > critical) <= 1%
    assert flagged <= critical, [r.message for r in results if r.verdict == "violation"]


@pytest.mark.parametrize(
    ("side", "noise", "failing"),
    [("client", 0.5, "noise"), ("server", 0.5, "noise"), ("client", 0.0, "noise")],
    ids=["client-side noise x1/2", "server-side noise x1/2", "noise removed"],
)
def test_less_noise_than_the_ledger_claims_is_caught(side, noise, failing):
    results = [federation(s, side=side, noise=noise).audit() for s in range(10)]
    assert _caught(results) >= 9
    assert all(failing in r.conformance.rejected for r in results if r.verdict == "violation")


def test_clipping_removed_is_caught(monkeypatch):
    # the server-side wrapper skips its clipping (noise still calibrated to C): canaries of raw norm
    # 4C move the release by 4 clip norms per appearance
    import flwr.serverapp.strategy.dp_fixed_clipping as flower_dp

    monkeypatch.setattr(flower_dp, "compute_clip_model_update", lambda **_: None)
    results = [federation(s, side="server").audit() for s in range(10)]
    assert _caught(results) >= 9
    assert all("influence" in r.conformance.rejected for r in results if r.verdict == "violation")


def test_a_ledger_that_undercounts_the_rounds_is_caught():
    from accountants import Ledger

    strategy = federation(1, rounds=5)
    kept = Ledger()
    for client in strategy.accounted.ledger.clients:
        for e in strategy.accounted.ledger.entries(client):
            if e.round != 5:
                kept.add(client, e.event, e.label, round=e.round, neighbouring=e.neighbouring)
    strategy.accounted.ledger = kept
    audit = strategy.audit()
    assert audit.verdict == "violation" and audit.conformance.rejected == ["releases"]
    assert "5 releases observed, 4 claimed" in audit.message


def test_audit_result_names_the_claim_it_tested():
    audit = federation(2, rounds=3).audit(confidence=0.9)
    assert audit.confidence == 0.9 and audit.conformance.confidence == pytest.approx(0.95)
    note = audit.conformance.notes[-1]
    assert "60 canary clients" in note and "rate m/n = 0.2" in note and "replace_one" in note
    assert any("not subtracted" in n for n in audit.conformance.notes)
    assert audit.accounted_epsilon == pytest.approx(federation(2, rounds=3).claim()[1])


# ----------------------------------------------------------------------------- errors
def _dp(cls=DifferentialPrivacyClientSideFixedClipping, **kw):
    return cls(fedavg(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=SAMPLED, **kw)


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (lambda: fedavg(), {}, "must be or wrap privkit.flower.Accounted .*; found FedAvg"),
        (lambda: Accounted(fedavg(), delta=DELTA), {}, "fixed-clipping DP wrappers .*found none"),
        (
            lambda: Accounted(
                DifferentialPrivacyClientSideAdaptiveClipping(
                    fedavg(), noise_multiplier=1.0, num_sampled_clients=SAMPLED
                ),
                delta=DELTA,
            ),
            {},
            "clip at a fixed norm .*; found DifferentialPrivacyClientSideAdaptiveClipping",
        ),
        (
            lambda: Accounted(
                _dp(), delta=DELTA, neighbouring="add_remove", client_sampling="none"
            ),
            {},
            "neighbouring must be 'replace_one' .*; found 'add_remove'",
        ),
        (
            lambda: Accounted(_dp(), delta=DELTA),
            {"raw_norm": 1.0},
            "raw_norm must exceed the clip norm 1 .*; found 1.0",
        ),
        (lambda: Accounted(_dp(), delta=DELTA), {"canaries": 1}, "canaries must be .*found 1"),
    ],
    ids=["no ledger", "no dp", "adaptive", "add_remove", "raw_norm", "canaries"],
)
def test_bad_arguments_are_named(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CanaryClients(make(), **{"canaries": 4, **kwargs})


def test_audit_before_any_release_says_so():
    with pytest.raises(ValueError, match="no release was observed"):
        CanaryClients(Accounted(_dp(), delta=DELTA), canaries=4).audit()


def test_unequal_weights_are_refused():
    strategy = federation(0, weight=lambda pid: 1 + pid % 2, rounds=1)
    with pytest.raises(
        ValueError, match=r"client weights must be equal .*; found \[1.0, 2.0\] in round 1"
    ):
        strategy.audit()


def test_canaries_outside_the_clipping_mod_have_no_claim_to_test():
    # client-side clipping with canary_mod *before* fixedclipping_mod: the canaries' updates are not
    # clipped, and Accounted records those clients as non-private
    strategy = federation(0, rounds=2, mods=[CanaryClients.mod, fixedclipping_mod])
    with pytest.raises(ValueError, match=r"as non-private in round 1 .*fixedclipping_mod"):
        strategy.audit()
