"""An audit's reference runs draw seeded noise, its target run the release mechanism's.

The reference runs are the auditor's own models, never released: they train with
``reproducible_noise=True`` (fast seeded generators) while the audited target run keeps the release
stream (AES-CTR and the exact grid). The attacks read the reference runs only as samples of the
IN/OUT score distributions, so what must hold is that seeded noise gives reference models with
the same statistics as release noise: two-sample tests over many runs of each, with a control
(seeded noise 10% too small) that the same tests must tell apart, so that they have the power to
see a wrong noise scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from audit_helpers import TINY_DPFED, TINY_FEDAVG, TINY_FEDMD
from scipy import stats

from privkit.audit.recipes import FederationRecipe
from privkit.audit.run import model_checkpoints
from privkit.batched.many import train_many
from privkit.data import FederationConfig, build_federation

DPFED = TINY_DPFED
#: runs per arm of the two-sample tests
RUNS = 24
#: a false alarm of each agreement test at most this often (the release runs' noise is secret)
ALPHA = 1e-3


@pytest.fixture(scope="module")
def fed():
    return build_federation(FederationConfig(partition="dirichlet", clients=20, seed=0))


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def test_only_the_target_run_draws_release_noise(fed):
    recipe = FederationRecipe(fed, "dp-fedavg", DPFED, release_seeds=[7])
    assert recipe.reference_noise == "seeded"
    assert [recipe.reference(s) for s in (7, 8)] == [False, True]
    assert recipe.config_for(8)[
        "reproducible_noise"
    ] and "reproducible_noise" not in recipe.config_for(7)
    x, y = fed.private.x[fed.members], fed.private.y[fed.members]
    sets = [np.arange(len(y))] * 3
    first = recipe.fit_many(x, y, sets, [7, 8, 9])
    again = recipe.fit_many(x, y, sets, [7, 8, 9])
    assert [r.result.reproducible_noise for r in first] == [False, True, True]
    # the target's noise is secret (fresh every time), the references' seeded (the same)
    assert _max_diff(first[0].result.model, again[0].result.model) > 1e-3
    assert all(_max_diff(a.result.model, b.result.model) == 0 for a, b in zip(first[1:], again[1:]))
    # the loop path (other executors): seeded references, the release target
    alone = recipe(x, y, 8)
    assert alone.result.reproducible_noise
    assert _max_diff(alone.result.model, recipe(x, y, 8).result.model) == 0
    assert not recipe(x, y, 7).result.reproducible_noise
    # release and seeded runs record the same ledger (the noise laws are the same)
    assert first[0].result.ledger.to_dict() == recipe(x, y, 7).result.ledger.to_dict()


def test_a_config_asking_for_reproducible_noise_seeds_the_target_too(fed):
    config = {**DPFED, "reproducible_noise": True}
    recipe = FederationRecipe(fed, "dp-fedavg", config, release_seeds=[7])
    assert recipe.config_for(7)["reproducible_noise"] and recipe.config_for(8)["reproducible_noise"]
    # and every run, batched, is its single run (the audit is the same on every executor)
    x, y = fed.private.x[fed.members], fed.private.y[fed.members]
    many = recipe.fit_many(x, y, [np.arange(len(y))] * 2, [7, 8])
    for run, seed in zip(many, [7, 8]):
        assert _max_diff(run.result.model, recipe(x, y, seed).result.model) <= 1e-5
    plain = FederationRecipe(fed, "dp-fedavg", DPFED)  # no release seeds: as configured
    assert plain.reference_noise == "as configured" and not plain.reference(8)


def test_checkpoints_of_release_noise_references_are_not_reused(fed, tmp_path):
    seeded = FederationRecipe(fed, "dp-fedavg", DPFED, release_seeds=[7])
    plain = FederationRecipe(fed, "dp-fedavg", DPFED)
    assert model_checkpoints(tmp_path, seeded).key != model_checkpoints(tmp_path, plain).key


def _statistics(
    fed, config: dict, seeds: list[int], reproducible: bool, method: str = "dp-fedavg"
) -> np.ndarray:
    """Per run: the released model's parameter norm (what the noise scale moves) and its mean
    loss on 200 test records (what the membership attacks score)."""
    x, y = fed.test_arrays()
    xq, yq = torch.as_tensor(x[:200]), torch.as_tensor(y[:200])
    runs = train_many(
        method, [fed] * len(seeds), config, seeds, references=[reproducible] * len(seeds)
    )
    assert all(r.reproducible_noise == reproducible for r in runs)
    out = []
    with torch.no_grad():
        for r in runs:
            model = r.model.eval()
            norm = torch.sqrt(sum((p.double() ** 2).sum() for p in model.parameters()))
            out.append((float(norm), float(F.cross_entropy(model(xq), yq))))
    return np.array(out)


def _agree_with_release_and_see_wrong_noise(
    fed, config: dict, runs: int = RUNS, method: str = "dp-fedavg"
) -> None:
    """``runs`` seeded reference runs against as many release runs of ``config``: the same
    parameter norms and query losses (KS), and seeded noise 10% too small told apart (the test's
    power)."""
    torch.set_num_threads(1)
    release = _statistics(fed, config, list(range(100, 100 + runs)), False, method)
    seeded = _statistics(fed, config, list(range(200, 200 + runs)), True, method)
    for i, name in enumerate(("parameter norm", "query loss")):
        p = stats.ks_2samp(release[:, i], seeded[:, i]).pvalue
        assert p > ALPHA, f"{name}: seeded and release noise differ (KS p={p:.2g})"
    wrong = _statistics(
        fed, {**config, "noise_multiplier": 0.9}, list(range(300, 300 + runs)), True, method
    )
    p_wrong = stats.ks_2samp(release[:, 0], wrong[:, 0]).pvalue
    assert p_wrong < 1e-6, f"the test cannot see a 10% wrong noise scale (KS p={p_wrong:.2g})"


def test_seeded_reference_models_have_the_release_models_statistics(fed):
    _agree_with_release_and_see_wrong_noise(fed, DPFED)


def test_reference_models_trained_in_their_records_span_have_the_release_models_statistics(
    fed, monkeypatch
):
    """With 10 local steps the reference clients (about 160 records over about 530 used inputs)
    train their first layer in their records' span (:mod:`privkit.batched.used_inputs`); their
    models keep the release runs' statistics (48 runs an arm), and the same tests tell a 10%
    wrong noise apart."""
    from privkit.batched import used_inputs

    config = {**DPFED, "local_steps": 10}
    rotated: list[bool] = []
    original = used_inputs.Narrowed.of

    def spy(weights, *args, **kw):
        out = original(weights, *args, **kw)
        if weights:  # the jobs that may narrow (the others are passed none)
            rotated.append(out is not None and out.basis is not None)
        return out

    monkeypatch.setattr(used_inputs.Narrowed, "of", staticmethod(spy))
    # 48 runs an arm: a query loss over 10 local steps spreads more than over 3 (one fixed sample
    # of 24 seeded runs can sit two standard errors from the release runs' mean)
    _agree_with_release_and_see_wrong_noise(fed, config, runs=2 * RUNS)
    assert rotated and all(rotated)  # every reference round trained in the span


def test_dpsgd_reference_runs_over_their_used_inputs_have_the_release_models_statistics(fed):
    """Centralised DP-SGD: the seeded reference runs train over the inputs some record uses and
    draw the others' noise after their last step (:class:`~privkit.batched.used_inputs.
    UnusedInputs`); their models keep the release runs' statistics, and the same tests tell a 10%
    wrong noise apart (32 steps at a large learning rate: the noise, not the initialisation,
    sets the parameter norm)."""
    config = {
        "arch": "mlp",
        "feature_dim": 16,
        "epochs": 1,
        "batch_size": 100,
        "lr": 2.0,
        "noise_multiplier": 1.0,
        "clip_norm": 0.5,
        "device": "cpu",
    }
    _agree_with_release_and_see_wrong_noise(fed, config, method="dpsgd")


FEDAVG = {**TINY_FEDAVG, "mu": 0.1}


def test_reference_runs_of_an_adam_method_take_the_stacked_kernels(fed):
    """FedProx (Adam, a proximal term), release mode: the target run keeps the exact per-model
    kernels (bit for bit its single run), the reference runs take the stacked ones (equal up to
    float rounding, which Adam amplifies: at most 1e-3 after three rounds here)."""
    torch.set_num_threads(1)
    feds = [fed, fed]
    exact = train_many("fedprox", feds, FEDAVG, [3, 4])
    mixed = train_many("fedprox", feds, FEDAVG, [3, 4], references=[False, True])
    assert _max_diff(exact[0].model, mixed[0].model) == 0
    assert 0 < _max_diff(exact[1].model, mixed[1].model) <= 1e-3
    assert [r.reproducible_noise for r in mixed] == [False, True]


@pytest.mark.parametrize("method", ["feddf", "fedaux"])
def test_reference_runs_of_feddf_and_fedaux_distil_together(fed, method):
    """FedDF and FedAUX: the target run is its single run bit for bit; a reference run's clients
    and server step (teachers and distillation: ``distil_together``) take the stacked kernels,
    equal to its single run with seeded noise up to float rounding, every round's row recorded
    with its KL."""
    torch.set_num_threads(1)
    cfg = {**TINY_FEDAVG, "distill_epochs": 1, "distill_lr": 1e-3}
    if method == "fedaux":
        cfg["pretrain"] = False
    feds = [fed, fed]
    # the runs as single runs with seeded noise (FedAUX's scores draw noise; a reference run's
    # is seeded), the exact kernels
    exact = train_many(method, feds, {**cfg, "reproducible_noise": True}, [3, 4])
    mixed = train_many(method, feds, cfg, [3, 4], references=[False, True])
    if method == "feddf":  # no noise at all: the release-mode target run is its single run
        assert _max_diff(exact[0].model, mixed[0].model) == 0
    # 3e-6 measured; without the reference runs' distillation, 2e-2
    assert 0 < _max_diff(exact[1].model, mixed[1].model) <= 1e-4
    got, want = mixed[1].rounds, exact[1].rounds
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    np.testing.assert_allclose(
        [r["distill_kl"] for r in got], [r["distill_kl"] for r in want], rtol=1e-4
    )


FEDMD = TINY_FEDMD


def test_fedmd_reference_runs_are_stacked_and_recorded_after_their_last_round(fed):
    """FedMD-NP, release mode: the target run is its single run bit for bit (every round
    recorded); a reference run takes the stacked kernels and stacked shared logits (within float
    rounding that Adam amplifies) and records its parties' accuracies after its last round only,
    about the exact run's."""
    torch.set_num_threads(1)
    feds = [fed, fed]
    exact = train_many("fedmd-np", feds, FEDMD, [3, 4])
    mixed = train_many("fedmd-np", feds, FEDMD, [3, 4], references=[False, True])
    assert _max_diff(exact[0].model, mixed[0].model) == 0
    assert exact[0].rounds == mixed[0].rounds and len(mixed[0].rounds) == FEDMD["rounds"] + 1
    assert 0 < _max_diff(exact[1].model, mixed[1].model) <= 1e-2
    assert [r["round"] for r in mixed[1].rounds] == [FEDMD["rounds"]]
    assert mixed[1].test_accuracy == pytest.approx(exact[1].test_accuracy, abs=0.05)


def _random_models(n: int, soft: bool):
    from privkit.models import build_from_spec, model_spec

    spec = model_spec("mlp", (1, 8, 8), 5, feature_dim=16)
    rng = np.random.default_rng(0)
    out = []
    for j in range(n):
        torch.manual_seed(j)
        k = int(rng.integers(20, 70))
        x = rng.random((k, 1, 8, 8)).astype(np.float32)
        y = rng.dirichlet(np.ones(5), k).astype(np.float32) if soft else rng.integers(0, 5, k)
        out.append((build_from_spec(spec), x, y))
    return out


@pytest.mark.parametrize(
    "optimizer, prox, soft",
    [("sgd", False, False), ("adam", False, False), ("adam", True, False), ("adam", False, True)],
)
def test_stacked_kernels_train_what_the_exact_kernels_train(optimizer, prox, soft):
    import copy

    from privkit.batched.exact_mlp import model_for, train_exact

    torch.set_num_threads(1)
    base = _random_models(6, soft)
    trained, totals = [], []
    for stacked in (False, True):
        mods = [copy.deepcopy(m) for m, _, _ in base]
        models = [
            model_for(
                m, x, y, epochs=3, batch_size=16, seed=j, device=torch.device("cpu"), soft=soft
            )
            for j, (m, (_, x, y)) in enumerate(zip(mods, base))
        ]
        mu = [0.5 * (j % 2) for j in range(len(mods))] if prox else None
        anchors = (
            [{k: v.detach().clone() for k, v in m.named_parameters()} for m, _, _ in base]
            if prox
            else None
        )
        loss_from = None if soft else [len(m.batches) - 2 for m in models]
        lr = 1e-2 if optimizer == "adam" else 0.1
        totals.append(
            train_exact(
                mods[0],
                models,
                optimizer=optimizer,
                lr=lr,
                mu=mu,
                anchors=anchors,
                loss_from=loss_from,
                stacked=stacked,
            )
        )
        trained.append(mods)
    diff = max(_max_diff(a, b) for a, b in zip(*trained))
    moved = min(_max_diff(a, m) for a, (m, _, _) in zip(trained[0], base))
    assert diff <= (1e-6 if optimizer == "sgd" else 1e-4) and moved > 100 * diff
    np.testing.assert_allclose(totals[1], totals[0], rtol=1e-4)


DPSGD = {"arch": "mlp", "feature_dim": 16, "epochs": 1, "batch_size": 64, "lr": 0.5}
DPSGD.update(device="cpu", noise_multiplier=1.0, clip_norm=1.0)


def test_dpsgd_reference_runs_draw_their_noise_together(fed):
    """dpsgd's batched reference runs draw a step's noise in one seeded draw: reproducible, the
    noise's law (the parameter norms of the released models agree with single seeded runs'), and
    the target run beside them still draws release noise."""
    torch.set_num_threads(1)
    feds, seeds = [fed] * 4, [1, 2, 3, 4]
    refs = [False, True, True, True]
    a = train_many("dpsgd", feds, DPSGD, seeds, references=refs)
    b = train_many("dpsgd", feds, DPSGD, seeds, references=refs)
    assert [r.reproducible_noise for r in a] == [False, True, True, True]
    assert _max_diff(a[0].model, b[0].model) > 1e-3  # the target: secret noise
    # seeded: the same up to float rounding (the target's secret batch sizes pad the stacked step)
    assert all(_max_diff(x.model, y.model) <= 1e-5 for x, y in zip(a[1:], b[1:]))
    single = train_many("dpsgd", feds[1:], {**DPSGD, "reproducible_noise": True}, seeds[1:])
    assert all(_max_diff(x.model, y.model) > 1e-3 for x, y in zip(a[1:], single))

    def norm(r):
        return float(torch.sqrt(sum((p.detach() ** 2).sum() for p in r.model.parameters())))

    joint, alone = [norm(r) for r in a[1:]], [norm(r) for r in single]
    assert abs(np.mean(joint) - np.mean(alone)) < 0.05 * np.mean(alone)
