"""The account stage's epsilon at the paper's delta (``privacy.json``'s ``epsilon_at_claim_delta``)."""

import json

import pytest

import accountants as acc
from privkit.pipeline.stages import account_method


def _run(tmp_path, claim_delta: float):
    """A run directory whose ledger mixes adaptive DP-SGD rounds, an (epsilon, delta)-only entry
    and two equal clients, and whose paper claims (2.0, ``claim_delta``)."""
    ledger = acc.Ledger()
    for c, sigmas in enumerate(([0.9, 1.2], [1.0], [1.2, 1.0, 0.9], [0.9, 0.9])):
        for r, s in enumerate(sigmas):
            ledger.add(c, acc.dpsgd_event(0.05, s, 20), f"round {r}", round=r)
    ledger.add(1, acc.EpsilonDeltaEvent(0.3, 1e-7), "extra")
    ledger.add("twin", acc.dpsgd_event(0.05, 0.9, 20), "round 0", round=0)
    ledger.add("twin", acc.dpsgd_event(0.05, 0.9, 20), "round 1", round=1)
    ledger.save(tmp_path / "ledger.json")
    claims = {"epsilon": 2.0, "delta": claim_delta}
    (tmp_path / "train.json").write_text(json.dumps({"method": "x", "claims": claims}))
    return ledger


@pytest.mark.parametrize("claim_delta", [1e-5, 1e-7])
def test_epsilon_at_the_claims_delta_is_the_summarys_worst_best(tmp_path, claim_delta):
    """At another delta than the stage's it is Ledger.account's (no second summary): the worst
    client's best epsilon of a whole summary at that delta, the same float; under one accountant
    it stays that accountant's."""
    ledger = _run(tmp_path, claim_delta)
    out = account_method(tmp_path, 1e-5, pld_grid=1e-3)
    ledger.value_discretization_interval = 1e-3
    assert out["epsilon_at_claim_delta"] == ledger.summary(claim_delta)["worst"]["best"]
    rdp = account_method(tmp_path, 1e-5, accountant="rdp", pld_grid=1e-3)
    assert rdp["epsilon_at_claim_delta"] == ledger.epsilon(claim_delta, accountant="rdp")
