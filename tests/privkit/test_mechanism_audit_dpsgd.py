"""Mechanism audits (privkit.audit.mechanism_audit) of the DP-SGD methods: centralised ``dpsgd``
(opacus, canaries at its optimizer) and the federated ``dp-fedavg``, ``fedkadp``, ``fedkd-dp``
(privkit's DpSgdStep).

Each method's correct twin conforms to its ledger, and each mutation of privkit.mechanisms.mutations is a
violation for its own reason (the conformance test's ``rejected``): less noise -> ``noise``;
clipping off or a halved ledger rate -> ``influence``; half the steps in the ledger ->
``releases``. The runs are seeded (reproducible noise), so each case is deterministic. Also: the
dpsgd probes see exactly the releases its ledger counts (empty Poisson batches included), take
opacus' clipping rule, work in release mode, and leave a run outside audits unchanged; fedkadp's
adaptive noise is read per round from its ledger.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import tiny_federation_config

from attacks.conformance import MechanismClaim, claim_from_events
from privkit.audit.mechanism_audit import audit_mechanisms
from privkit.data import build_federation
from privkit.mechanisms import mutations
from privkit.mechanisms.probes import ProbePlan, probing
from privkit.methods import get_trainer
from privkit.trainers import train

DELTA = 1e-5
# three clients, so "noise x1/N" (a third of the noise) differs from "noise x1/2"
CLIENTS = 3
# small and quick: the federated methods run every client every round (client 0, the probed one,
# releases local_steps noisy gradients per round)
FEDERATED = {"rounds": 4, "local_steps": 5, "client_fraction": 1.0}
CONFIGS = {
    "dpsgd": {"epochs": 2, "batch_size": 32},  # noise multiplier calibrated to the quick target
    "dp-fedavg": FEDERATED,
    "fedkadp": FEDERATED,
    "fedkd-dp": FEDERATED,
}
# the reason each mutation must be caught for (the conformance test's rejected list)
REASONS = {
    "correct": [],
    "noise x1/2": ["noise"],
    "noise x1/N": ["noise"],
    "clipping off": ["influence"],
    "ledger steps x1/2": ["releases"],
    "ledger rate x1/2": ["influence"],
}
# a small dpsgd run on a few hundred records (batch size 1: a third of its Poisson batches are empty)
EMPTY_BATCHES = {
    "arch": "mlp",
    "width": 8,
    "feature_dim": 16,
    "epochs": 1,
    "batch_size": 1,
    "noise_multiplier": 1.0,
    "device": "cpu",
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one torch thread (conftest's ``one_torch_thread``)."""


@pytest.fixture(scope="module")
def fed():
    return build_federation(tiny_federation_config(clients=CLIENTS))


@pytest.fixture(scope="module")
def small_fed():
    return build_federation(tiny_federation_config(test_size=0.6, shadow_size=0.3))


def _config(method: str, **over) -> dict:
    return {**get_trainer(method).quick_config(), **CONFIGS[method], "device": "cpu", **over}


def _audit(method: str, fed, mutation: str, seed: int, **kw) -> dict:
    return audit_mechanisms(
        method, fed, _config(method), delta=DELTA, seed=seed, mutation=mutation, **kw
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mutation", list(REASONS))
@pytest.mark.parametrize("method", list(CONFIGS))
def test_correct_conforms_and_each_mutation_is_caught_for_its_reason(fed, method, mutation, seed):
    rec = _audit(method, fed, mutation, seed)
    assert [(p["client"], p["mechanism"]) for p in rec["probes"]] == [(0, "dp-sgd")]
    probe = rec["probes"][0]
    want = REASONS[mutation]
    assert rec["status"] == ("consistent" if not want else "violation"), rec["message"]
    assert probe["rejected"] == want, rec["message"]


def _ledger_steps(ledger, client: int, clip_norm: float) -> int:
    """The number of releases ``client``'s dp-sgd entries account for."""
    return claim_from_events(
        [e.event for e in ledger.entries(client) if "dp-sgd" in e.label], clip_norm
    ).steps


@pytest.mark.parametrize("reproducible", [True, False])
def test_dpsgd_probes_see_every_release_the_ledger_counts(small_fed, reproducible):
    """Every opacus step is one release, an empty Poisson batch's (noise only) too, observed by the
    probe set of every probed client."""
    with probing(ProbePlan(canaries=50, clients=None)) as session:
        res = train(
            "dpsgd", small_fed, {**EMPTY_BATCHES, "reproducible_noise": reproducible}, seed=0
        )
    n = len(small_fed.pooled_arrays()[1])
    assert res.claims["steps"] == n  # batch size 1: one batch per record, (1 - 1/n)^n of them empty
    assert sorted(session.probes) == [(k, "dp-sgd") for k in range(small_fed.num_clients)]
    for (client, _), can in session.probes.items():
        assert can.steps == _ledger_steps(res.ledger, client, can.clip_norm) == n
        assert can.sample_rate == res.claims["sample_rate"] == 1.0 / n


@pytest.mark.parametrize("clipping", [True, False])
def test_dpsgd_canaries_are_sampled_and_clipped_by_the_mechanism(small_fed, clipping):
    """Almost no noise (std 1e-4 clip norms): each included canary's component is 0 or its clipped raw gradient (opacus'
    rule ``min(1, C / (norm + 1e-6))``, or the raw norm with clipping off) in each release, sampled
    at the loader's rate; excluded canaries and untouched coordinates see nothing, the other probe
    set's canaries included (they are subtracted as other records)."""
    # noise std 1e-4 clip norms; the per-epoch epsilon of so little noise is the RDP accountant's
    cfg = {
        **EMPTY_BATCHES,
        "batch_size": 8,
        "epochs": 3,
        "noise_multiplier": 1e-4,
        "calibration_accountant": "rdp",
        "reproducible_noise": True,
    }
    mut = (
        mutations.CORRECT
        if clipping
        else mutations.for_federation("clipping off", small_fed.num_clients)
    )
    with probing(ProbePlan(canaries=100, clients=None)) as session, mutations.mutated(mut):
        res = train("dpsgd", small_fed, cfg, seed=0)
    q = res.claims["sample_rate"]
    for can in session.probes.values():
        ev = can.evidence()
        c = can.clip_norm
        size = (
            min(1.0, c / (can.raw_norm + 1e-6)) * can.raw_norm / c if clipping else can.raw_norm / c
        )
        inc = ev.projections[:, ev.included]
        hit = np.abs(inc - size) < 1e-3
        assert np.all(hit | (np.abs(inc) < 1e-3))
        # the included canaries' draws: Bernoulli(q), within 4 standard errors
        assert abs(hit.mean() - q) < 4 * np.sqrt(q * (1 - q) / hit.size)
        assert np.abs(ev.projections[:, ~ev.included]).max() < 1e-3
        assert (ev.noise_squares / ev.noise_coordinates).max() < 1e-6  # mean square: 1e-8 expected


def test_dpsgd_in_release_mode_takes_probes_and_mutations(fed):
    """Release mode (privkit's AES stream for opacus' batches and noise): the audit runs the same way.
    At confidence 1 - 1e-6 a correct run is flagged at most once in a million; half the noise
    still is caught."""
    kw = {"reproducible_noise": False, "confidence": 1 - 1e-6}
    assert _audit("dpsgd", fed, "correct", 0, **kw)["status"] == "consistent"
    rec = _audit("dpsgd", fed, "noise x1/2", 0, **kw)
    assert rec["status"] == "violation" and rec["probes"][0]["rejected"] == ["noise"]


def _weights(res) -> dict:
    return {k: v.clone() for k, v in res.model.state_dict().items()}


def test_dpsgd_outside_audits_is_unchanged(fed):
    """The correct mechanism and the ledger-only mutations (mechanism untouched), and a probing
    block that probes no client, train bit-identical weights to a plain run."""
    cfg = {**_config("dpsgd"), "reproducible_noise": True}
    plain = _weights(train("dpsgd", fed, cfg, seed=3))
    runs = []
    with mutations.mutated(mutations.CORRECT):
        runs.append(train("dpsgd", fed, cfg, seed=3))
    with mutations.mutated(mutations.for_federation("ledger steps x1/2", fed.num_clients)):
        runs.append(train("dpsgd", fed, cfg, seed=3))
    with probing(ProbePlan(canaries=10, clients=())) as session:
        runs.append(train("dpsgd", fed, cfg, seed=3))
    assert not session.probes
    for res in runs:
        got = _weights(res)
        assert all(torch.equal(plain[k], got[k]) for k in plain)


def test_fedkadp_adaptive_noise_is_claimed_round_by_round(fed):
    """fedkadp lowers sigma between rounds (Eq. 20; here every round, by 0.8; the target epsilon lets
    all rounds run): the claim read from the ledger has each round's sigma, so the correct run
    conforms, while the same canaries tested against the first round's sigma throughout see less
    noise than claimed."""
    over = {"metric_dp": 0.0, "decay": 0.8, "target_epsilon": 40.0}
    cfg = _config("fedkadp", **over)
    with probing(ProbePlan(canaries=1000, seed=0)) as session, mutations.mutated(mutations.CORRECT):
        res = train("fedkadp", fed, {**cfg, "reproducible_noise": True}, seed=0)
    sigmas = [row["sigma"] for row in res.rounds]
    assert len(res.rounds) == cfg["rounds"] and len(set(sigmas)) == cfg["rounds"]
    can = session.probes[(0, "dp-sgd")]
    claim = claim_from_events(
        [e.event for e in res.ledger.entries(0) if "dp-sgd" in e.label], can.clip_norm
    )
    np.testing.assert_allclose(claim.noise_multipliers, np.repeat(sigmas, cfg["local_steps"]))
    assert can.audit(delta=DELTA, claim=claim).verdict == "consistent"
    fixed = MechanismClaim.repeated(
        float(claim.sample_rates[0]), sigmas[0], claim.steps, can.clip_norm
    )
    assert can.audit(delta=DELTA, claim=fixed).conformance.rejected == ["noise"]
    # and through audit_mechanisms (the same run: same seed, canaries and reproducible noise)
    rec = audit_mechanisms("fedkadp", fed, cfg, delta=DELTA, seed=0, mutation="correct")
    assert rec["status"] == "consistent", rec["message"]


def test_twins_with_the_same_ledger_are_accounted_once(monkeypatch):
    """The noise-halved twin usually holds the correct twin's ledger: its accounted epsilon is the
    first one's, reused, and a ledger that differs in any event is accounted afresh."""
    import dp_accounting as dpa

    from accountants import Ledger
    from privkit.audit import mechanism_audit

    calls = []
    real = Ledger.epsilon
    monkeypatch.setattr(
        Ledger, "epsilon", lambda self, d, *a, **k: calls.append(d) or real(self, d)
    )

    def ledger(sigma):
        out = Ledger()
        out.add(0, dpa.GaussianDpEvent(sigma), "release")
        return out

    first = mechanism_audit._worst_epsilon(ledger(1.0), 1e-5)
    assert mechanism_audit._worst_epsilon(ledger(1.0), 1e-5) == first and len(calls) == 1
    assert mechanism_audit._worst_epsilon(ledger(2.0), 1e-5) < first and len(calls) == 2
    assert mechanism_audit._worst_epsilon(ledger(2.0), 1e-6) > 0 and len(calls) == 3
