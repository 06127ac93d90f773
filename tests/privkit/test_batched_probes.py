"""Batched runs are audited too (issue 31): an audit's probes and mutations reach the batched
DP-SGD engines (:func:`privkit.batched.many.local_dp_sgd` for the federated methods,
:mod:`privkit.batched.many_dpsgd` for opacus' centralised DP-SGD) through the same mechanism code
as the single run.

* Seeded, a probed batched run is its single run: the same probe sets, the same canary
  appearances (sampled from the same noise stream before the noise), the same observations and
  final weights up to float rounding (the batched engines' tolerance, 1e-5), with or without a
  mutation; several runs on the model axis each reach the probes at their own row. The batched
  forms releasing by output perturbation (FedMD-LDP, FedAUX) take the probes in the single run's
  own code, bit for bit. None of these falls back to training one run after the other.
* An audit's reference run trained batched with a planted bug is caught by the mechanism audit's
  verdict (:func:`privkit.audit.mechanism_audit.probe_verdict`), for the bug's own reason, while
  the correct run conforms: on every one of several seeds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import tiny_federation_config

from privkit.audit.mechanism_audit import probe_verdict
from privkit.batched.many import train_many
from privkit.data import build_federation
from privkit.mechanisms import mutations
from privkit.mechanisms.probes import ProbePlan, probing
from privkit.methods import get_trainer
from privkit.trainers import train

TOL = 1e-5  # the batched engines' agreement with the single run (test_batched_federations)
DELTA = 1e-5
FEDERATED = {"rounds": 3, "local_steps": 4, "client_fraction": 1.0}
CONFIGS = {
    "dp-fedavg": FEDERATED,
    "fedkadp": FEDERATED,
    "fedkd-dp": FEDERATED,
    "dpsgd": {"epochs": 2, "batch_size": 32},
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module runs on one torch thread (conftest's ``one_torch_thread``)."""


@pytest.fixture(scope="module")
def fed():
    return build_federation(tiny_federation_config(clients=3))


def _batched(monkeypatch, method: str, feds: list, cfg: dict, seeds: list, **kw) -> list:
    """``train_many`` that must train batched: the one-after-the-other loop (``train``) is refused,
    so a batched path that fell back to it inside an audit would fail here."""
    from privkit.methods import contract

    def loop(*args, **kwargs):
        raise AssertionError(f"{method} fell back to training one run after the other")

    with monkeypatch.context() as m:
        m.setattr(contract, "train", loop)
        return train_many(method, feds, cfg, seeds, **kw)


def _config(method: str, reproducible: bool = True) -> dict:
    return {
        **get_trainer(method).quick_config(),
        **CONFIGS[method],
        "device": "cpu",
        "reproducible_noise": reproducible,
    }


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("mutation", ["correct", "noise x1/2", "clipping off"])
@pytest.mark.parametrize("method", list(CONFIGS))
def test_a_probed_batched_run_is_its_single_run(fed, monkeypatch, method, mutation):
    cfg, mut = _config(method), mutations.MUTATIONS[mutation]
    plan = ProbePlan(canaries=64, clients=(0, 2), seed=3)
    with probing(plan) as alone, mutations.mutated(mut):
        single = train(method, fed, cfg, seed=7)
    with probing(plan) as together, mutations.mutated(mut):
        (batched,) = _batched(monkeypatch, method, [fed], cfg, [7])
    assert sorted(alone.probes) == sorted(together.probes) == [(0, "dp-sgd"), (2, "dp-sgd")]
    for key, a in alone.probes.items():
        b = together.probes[key]
        assert a.steps == b.steps > 0  # every release observed, none twice
        np.testing.assert_array_equal(a.appearances, b.appearances)  # the same sampling bits
        assert a.appearances.sum() > 0
        np.testing.assert_allclose(np.stack(b._proj), np.stack(a._proj), rtol=0, atol=1e-5)
        np.testing.assert_allclose(b._noise_ss, a._noise_ss, rtol=1e-4)
    assert _max_diff(single.model, batched.model) <= TOL
    assert single.ledger.to_dict() == batched.ledger.to_dict()


@pytest.mark.parametrize("method", ["dp-fedavg", "dpsgd"])
def test_a_batch_of_runs_observes_what_its_runs_observe_one_after_the_other(
    fed, monkeypatch, method
):
    """Two runs on the model axis: each one's releases reach the probe set at its own row. The
    runs share the probe set of client 0 (one probing block), the loop observing run 0's steps and
    then run 1's, the batch both runs' step by step (lock-step): every other observation of the
    batch is the loop's run 0, the others its run 1."""
    cfg, seeds = _config(method), [7, 8]
    plan = ProbePlan(canaries=64, clients=(0,), seed=1)
    with probing(plan) as alone, mutations.mutated(mutations.MUTATIONS["clipping off"]):
        singles = [train(method, fed, cfg, seed=s) for s in seeds]
    with probing(plan) as together, mutations.mutated(mutations.MUTATIONS["clipping off"]):
        batched = _batched(monkeypatch, method, [fed, fed], cfg, seeds)
    a, b = alone.probes[(0, "dp-sgd")], together.probes[(0, "dp-sgd")]
    assert a.steps == b.steps > 0 and a.steps % 2 == 0
    loop, batch = np.stack(a._proj), np.stack(b._proj)
    half = a.steps // 2
    for run, rows in enumerate((batch[0::2], batch[1::2])):
        np.testing.assert_allclose(rows, loop[run * half : (run + 1) * half], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(a.appearances, b.appearances)
    assert all(_max_diff(x.model, y.model) <= TOL for x, y in zip(singles, batched))


def test_probes_see_the_mutation_the_batched_run_draws(fed, monkeypatch):
    """The probes' noise estimate follows the noise the batched engine drew: halved noise, a
    quarter of the noise energy per release (the same stream, so the ratio is exact up to
    rounding); a probe set that did not observe the bug's noise could not catch it."""
    cfg = _config("dp-fedavg")
    plan = ProbePlan(canaries=64, clients=(0,), seed=0)
    ss = {}
    for name in ("correct", "noise x1/2"):
        with probing(plan) as session, mutations.mutated(mutations.MUTATIONS[name]):
            _batched(monkeypatch, "dp-fedavg", [fed], cfg, [5])
        ss[name] = np.asarray(session.probes[(0, "dp-sgd")]._noise_ss)
    np.testing.assert_allclose(ss["noise x1/2"] / ss["correct"], 0.25, rtol=2e-2)


# the reason each bug is caught for (the conformance test's rejected list,
# test_mechanism_audit_dpsgd's REASONS)
REASONS = {"correct": [], "noise x1/2": ["noise"], "clipping off": ["influence"]}


@pytest.mark.parametrize("method", ["dp-fedavg", "dpsgd"])
def test_a_mutation_in_a_batched_reference_run_is_caught(fed, monkeypatch, method):
    """An audit's reference run (seeded noise, drawn by the batched engine's joint release) trained
    batched inside the audit's probing block: each planted bug is a violation for its reason, the
    correct run conforms, on each of three seeds."""
    cfg = _config(method, reproducible=False)  # a reference run is seeded all the same
    verdicts: dict[str, list[tuple[str, list[str]]]] = {m: [] for m in REASONS}
    for seed in range(3):
        for name in REASONS:
            plan = ProbePlan(canaries=200, clients=(0,), seed=seed)
            mut = mutations.MUTATIONS[name]
            with probing(plan) as session, mutations.mutated(mut):
                (res,) = _batched(monkeypatch, method, [fed], cfg, [100 + seed], references=[True])
            assert res.reproducible_noise  # the reference run's seeded noise
            rec = probe_verdict(
                session, mutations.mutate_ledger(res.ledger, mut), delta=DELTA, confidence=0.95
            )
            verdicts[name].append((rec["status"], rec["probes"][0]["rejected"]))
    assert verdicts["correct"] == [("consistent", [])] * 3, verdicts
    for name in ("noise x1/2", "clipping off"):
        assert verdicts[name] == [("violation", REASONS[name])] * 3, (name, verdicts)


@pytest.mark.parametrize("method", ["fedmd-ldp", "fedaux"])
def test_output_perturbation_in_batched_runs_takes_the_probes(monkeypatch, method):
    """The batched forms whose DP mechanism is output perturbation (FedMD-LDP's shared
    predictions, FedAUX's scores) run the single run's own release code per run: the same probe
    sets, observing the same releases bit for bit."""
    from test_batched_federations import CASES

    from privkit.data import FederationConfig

    fed = build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))
    plan = ProbePlan(canaries=16, clients=(0,), seed=1)
    with probing(plan) as alone:
        train(method, fed, CASES[method], seed=3)
    with probing(plan) as together:
        _batched(monkeypatch, method, [fed], CASES[method], [3])
    assert sorted(alone.probes) == sorted(together.probes) != []
    for key, a in alone.probes.items():
        b = together.probes[key]
        assert a.steps == b.steps > 0
        np.testing.assert_array_equal(np.stack(b._proj), np.stack(a._proj))
