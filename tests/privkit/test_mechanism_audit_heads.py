"""Mechanism audits of the output-perturbation heads (FedAUX's scores, FedAUXfdp's class heads and
scores, the DP-head baselines): the Gaussian output-perturbation primitive is today's release
outside an audit, and under probes the audit catches each mechanism bug for the right reason
(noise test for too little noise, sensitivity test for an unbounded record influence)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from audit_helpers import tiny_federation_config

from privkit.audit.mechanism_audit import audit_mechanisms
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_random import aes_generator
from privkit.mechanisms.output_perturbation import gaussian_output_perturbation
from privkit.mechanisms.probes import ProbePlan, probing
from privkit.trainers.heads import (
    HeadData,
    fit_binary_head,
    fit_multinomial_head,
    head_features,
    head_sensitivity,
    probe_record_influence,
    release_head,
)

DELTA = 1e-5
# CPU-sized: a 2-epoch h0 (cached per process) and a 1-epoch student; the heads are what is audited
HEADS = {"pretrain_epochs": 2, "student_epochs": 1, "keep_client_models": False}
FEDAUX = {"rounds": 1, "local_epochs": 1, "distill_epochs": 1}


@pytest.fixture(scope="module")
def fed():
    from privkit.data import build_federation

    torch.set_num_threads(1)
    return build_federation(tiny_federation_config())


def _config(method: str) -> dict:
    from privkit.methods import get_trainer

    return {**get_trainer(method).quick_config(), **(FEDAUX if method == "fedaux" else HEADS)}


# ----------------------------------------------------------------------------- the primitive
def test_primitive_outside_an_audit_is_todays_release():
    clean = np.random.default_rng(0).normal(size=(3, 5))
    released = gaussian_output_perturbation(
        clean,
        sigma=0.3,
        sensitivity=0.1,
        rng=np.random.default_rng(7),
        client=0,
        label="class-head",
    )
    np.testing.assert_array_equal(
        released, clean + np.random.default_rng(7).normal(0.0, 0.3, size=clean.shape)
    )


def test_primitive_on_the_release_stream_is_the_grid_release():
    """Release mode (the AES stream): the grid release of privkit.mechanisms.grid_noise, its noise covering the
    rounding of a 15-number release of sensitivity 0.1, its bits from OpenSSL's AES-CTR keyed by
    the stream."""
    import torch

    from privkit.mechanisms.grid_noise import CipherBits, Grid, grid_release

    clean = np.random.default_rng(0).normal(size=(3, 5))
    released = gaussian_output_perturbation(
        clean, sigma=0.3, sensitivity=0.1, rng=aes_generator(key=123), client=0, label="class-head"
    )
    grid = Grid.for_release(0.3, 0.1, 15)
    want = grid_release(torch.from_numpy(clean), grid, CipherBits(aes_generator(key=123))).numpy()
    np.testing.assert_array_equal(released, want)
    assert np.all(released / grid.gamma == np.round(released / grid.gamma))


def test_release_head_noise_is_todays_for_a_fixed_rng():
    rng = np.random.default_rng(1)
    X, y = head_features(rng.normal(size=(80, 6))), rng.integers(0, 3, 80)
    fit = fit_multinomial_head(X, y, 3, 0.1)
    rel = release_head(
        fit,
        kind="multinomial",
        lam=0.1,
        epsilon=1.0,
        delta=DELTA,
        calibration="analytic",
        rng=np.random.default_rng(5),
        num_classes=3,
        client=0,
        label="class-head",
        data=HeadData(X, X[:, :-1], None, labels=y),
    )
    np.testing.assert_array_equal(
        rel.weights,
        fit.weights + np.random.default_rng(5).normal(0.0, rel.sigma, fit.weights.shape),
    )


def test_primitive_under_probes_adds_bounded_canaries_and_scaled_noise():
    clean = np.zeros(40)
    with (
        probing(ProbePlan(canaries=10, seed=3)) as session,
        mutations.mutated(mutations.MUTATIONS["noise x1/2"]),
    ):
        released = gaussian_output_perturbation(
            clean,
            sigma=2.0,
            sensitivity=0.5,
            rng=np.random.default_rng(2),
            client=0,
            label="scores",
        )
    can = session.probes[(0, "scores")]
    assert can.steps == 1 and can.sample_rate == 1.0 and can.noise_multiplier == pytest.approx(4.0)
    noise = np.random.default_rng(2).normal(0.0, 1.0, size=40)  # half of the claimed sigma
    bump = released - noise
    # each included canary adds exactly the sensitivity (its raw influence, 4x, bounded to it)
    np.testing.assert_allclose(
        np.sort(bump[np.abs(bump) > 1e-6]), np.full(can.included_ids.size, 0.5), rtol=1e-6
    )


# ----------------------------------------------------------------------------- the sensitivity test
@pytest.mark.parametrize("kind", ["binary", "multinomial"])
def test_probe_records_respect_the_bound_unless_the_normalisation_is_off(kind):
    rng = np.random.default_rng(4)
    h, lam, C = rng.normal(size=(120, 8)) * 0.8, 0.01, 4
    # labels a head can learn: a far-away record's influence without the normalisation saturates
    # near the move that flips its margin (about the head's weight norm), which must exceed the
    # sensitivity for the bug to show, as it does for any head worth releasing with noise
    y = np.argmax(h @ rng.normal(size=(8, C)), axis=1)
    results = {}
    for name in ("correct", "clipping off"):
        with mutations.mutated(mutations.MUTATIONS[name]):
            X = head_features(h)
            if kind == "binary":
                neg = head_features(rng.normal(size=(60, 8)) * 0.8 + 1.0)
                fit, data = fit_binary_head(X, neg, lam), HeadData(X, h, negatives=neg)
                sens = head_sensitivity("binary", fit.n, lam)
            else:
                fit, data = fit_multinomial_head(X, y, C, lam), HeadData(X, h, labels=y)
                sens = head_sensitivity("multinomial", fit.n, lam, C, "cfree")
            norms, tol = probe_record_influence(
                fit, data, kind=kind, lam=lam, sensitivity=sens, num_classes=C
            )
        assert norms.shape == (8,) and 0 <= tol < 1e-4  # the solver's guarantee: tight
        results[name] = norms.max() / sens
    assert results["correct"] <= 1 + tol  # the theorem, up to the solver's precision
    assert results["clipping off"] > 1.1  # unnormalised far-away records move the head beyond it


# ----------------------------------------------------------------------------- audits of the methods
METHODS = {
    "fedauxfdp": {"class-head", "scores"},
    "fedavg-dphead": {"class-head"},
    "fedd-dphead": {"class-head"},
    "fedaux": {"scores"},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_correct_heads_conform_and_ledger_bugs_do_not_apply(fed, method):
    rec = audit_mechanisms(method, fed, _config(method), delta=DELTA, seed=0, mutation="correct")
    assert rec["status"] == "consistent", rec["message"]
    assert {p["mechanism"] for p in rec["probes"]} == METHODS[method]
    for p in rec["probes"]:
        tests = p["audit"]["conformance"]["tests"]
        assert set(tests) == {"releases", "noise", "influence", "sensitivity"}
        assert tests["sensitivity"]["measured"] <= 1.0  # exact influence of the probe records
    if method == "fedaux":  # DP scores audited although the pipeline has no formal guarantee
        assert rec["formal_dp"] is False and "scores" in rec["scope"]
    for name in (
        "ledger steps x1/2",
        "ledger rate x1/2",
    ):  # one Gaussian release each: nothing to halve
        assert (
            audit_mechanisms(method, fed, _config(method), delta=DELTA, seed=0, mutation=name)[
                "status"
            ]
            == "not-applicable"
        )


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(
    "mutation, reason",
    [("noise x1/2", "noise"), ("noise x1/N", "noise"), ("clipping off", "sensitivity")],
)
def test_mechanism_bugs_are_violations_for_the_right_reason(fed, method, mutation, reason):
    rec = audit_mechanisms(method, fed, _config(method), delta=DELTA, seed=0, mutation=mutation)
    assert rec["status"] == "violation", rec["message"]
    for p in rec["probes"]:  # every probed release of the method carries the bug
        assert reason in p["rejected"], (p["mechanism"], p["rejected"])
        if reason == "noise":  # the bound still holds: only the noise is wrong
            assert "sensitivity" not in p["rejected"]


# ----------------------------------------------------------------------------- FedMD-LDP's rows
def test_row_releases_in_float32_are_todays_and_each_row_is_observed():
    clean = np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32)
    out = gaussian_output_perturbation(
        clean,
        sigma=0.5,
        sensitivity=1.0,
        rng=np.random.default_rng(3),
        client=0,
        label="ldp predictions",
        rows=True,
        dtype=np.float32,
    )
    want = clean + np.random.default_rng(3).normal(0.0, 0.5, size=clean.shape).astype(np.float32)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, want)
    with probing(ProbePlan(canaries=4)) as session:
        gaussian_output_perturbation(
            clean,
            sigma=0.5,
            sensitivity=1.0,
            rng=np.random.default_rng(3),
            client=0,
            label="ldp predictions",
            rows=True,
            dtype=np.float32,
        )
    (can,) = session.probes.values()
    assert can.dim == 4 and can.steps == 6  # one release per shared vector, as the ledger counts


@pytest.mark.parametrize(
    "mutation, reason",
    [("correct", None), ("noise x1/2", "noise"), ("ledger steps x1/2", "releases")],
)
def test_fedmd_ldp_predictions_are_audited_at_the_mechanism(fed, mutation, reason):
    from privkit.methods import get_trainer

    cfg = {**get_trainer("fedmd-ldp").quick_config(), "rounds": 2, "init_epochs": 1}
    r = audit_mechanisms("fedmd-ldp", fed, cfg, delta=DELTA, mutation=mutation, canaries=50)
    assert [p["mechanism"] for p in r["probes"]] == ["ldp predictions"]
    assert r["status"] == ("consistent" if reason is None else "violation"), r["message"]
    if reason:
        assert r["probes"][0]["rejected"] == [reason]


def test_accounted_epsilon_on_the_runs_pld_grid(fed):
    """A pipeline's controls account on its headline grid: the record says which grid, and its
    epsilon is the method's ledger's worst-client epsilon on that grid (and on the ledger's own
    grid without one)."""
    from accountants import PLD_VDI
    from privkit.methods import get_trainer

    spec = get_trainer("fedavg-dphead")
    cfg = spec.config_cls.model_validate({**_config("fedavg-dphead"), "reproducible_noise": True})
    ledger = spec.fn(fed, cfg, 0).ledger
    for grid in (None, 1e-2):
        rec = audit_mechanisms(
            "fedavg-dphead", fed, _config("fedavg-dphead"), delta=DELTA, seed=0, pld_grid=grid
        )
        ledger.value_discretization_interval = PLD_VDI if grid is None else grid
        assert rec["pld_grid"] == ledger.value_discretization_interval
        assert rec["accounted_epsilon"] == ledger.epsilon(DELTA)
