"""White-box gradient canaries: what the auditor observes, the score statistics, and the audit of
DP-SGD through privkit's DpSgdStep and through opacus (noise removed: caught; correct: not)."""

import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from accountants import dpsgd_epsilon
from attacks.whitebox import GradientCanaries, attach_to_opacus
from privkit.mechanisms.dp_sgd_step import DpSgdStep

DELTA = 1e-5
SEEDS = 2 if os.environ.get("PRIVKIT_SLOW") == "small" else 4  # negative-control seeds per epsilon


def _data(n=256, d=12, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, k, (n,), generator=g)
    x = torch.randn(n, d, generator=g) + y[:, None].float()
    return x, y


def _model(seed=0, d=12, k=3, hidden=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, k)
    )


def _loss(logits, target, aux):
    return F.cross_entropy(logits, target)


def _dpsgd(
    sigma,
    claimed_sigma,
    *,
    seed,
    steps=60,
    q=0.05,
    m=400,
    kind="dirac",
    know_batch=True,
    hidden=32,
    model=None,
    data=None,
):
    """privkit's DP-SGD step with gradient canaries; returns the canaries after ``steps`` steps
    (of ``model`` on ``data`` where given, else of this file's MLP on its data)."""
    x, y = _data(seed=seed) if data is None else data
    model = _model(seed, hidden=hidden) if model is None else model
    step = DpSgdStep(clip_norm=1.0, noise_multiplier=sigma, sample_rate=q, dataset_size=len(y))
    can = GradientCanaries.for_parameters(
        list(model.parameters()),
        m,
        clip_norm=1.0,
        sample_rate=q,
        noise_multiplier=claimed_sigma,
        kind=kind,
        seed=seed,
        know_batch=know_batch,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    gen, noise = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
    for _ in range(steps):
        b = step.sample(gen)
        step.apply(model, opt, x[b], y[b], _loss, noise, canaries=can)
    return can


def test_coins_are_fair_over_seeds():
    coins = np.array(
        [
            GradientCanaries(1000, 50, clip_norm=1.0, sample_rate=0.1, seed=s).included
            for s in range(300)
        ]
    )
    assert stats.binomtest(int(coins.sum()), coins.size, 0.5).pvalue > 1e-3
    per_pos = coins.sum(0)
    assert stats.chi2.sf(float((((per_pos - 150) ** 2) / 75).sum()), 50) > 1e-3


def test_without_noise_the_auditor_sees_each_canary_s_appearances_exactly():
    can = _dpsgd(0.0, 1.0, seed=0, steps=40)
    s = can.scores("sum")
    # excluded canaries: exactly nothing; included: one clip norm per step the sampling picked them
    assert np.all(s[~can.included] == 0.0)
    np.testing.assert_allclose(s[can.included], can.appearances[can.included], atol=1e-4)
    assert np.all(can.appearances[~can.included] == 0)
    # the canaries' own Poisson sampling: Bin(40, 0.05) per included canary
    k = can.appearances[can.included]
    assert stats.ttest_1samp(k, 40 * 0.05).pvalue > 1e-3


def test_noise_reaches_the_auditor_as_the_claimed_gaussian():
    sigma, steps = 2.0, 30
    can = _dpsgd(sigma, sigma, seed=1, steps=steps)
    s = can.scores("sum")[~can.included]  # excluded canaries: sum of `steps` N(0, sigma^2) draws
    var = s.var(ddof=1)
    n = s.size
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], n - 1) / (n - 1) * steps * sigma**2
    assert lo < var < hi
    assert abs(s.mean()) < 4 * math.sqrt(steps) * sigma / math.sqrt(n)


def test_likelihood_ratio_statistic_matches_its_formula():
    can = GradientCanaries(10, 2, clip_norm=2.0, sample_rate=0.25, noise_multiplier=1.5, seed=0)
    xs = [torch.tensor([0.5, -1.0] + [0.0] * 8), torch.tensor([3.0, 0.2] + [0.0] * 8)]
    coords = can._coords.numpy()  # the directions the test writes into
    expected = np.zeros(2)
    for v in xs:
        released = torch.zeros(10)
        released[coords] = v[:2]
        can.inject(torch.zeros(10))
        can.observe(released)  # the clean sum injected was 0
        x = v[:2].numpy() / 2.0
        expected += np.log(0.75 + 0.25 * np.exp((x - 0.5) / 1.5**2))
    np.testing.assert_allclose(can.scores("lr"), expected, rtol=1e-6)  # float32 inputs


def test_inject_and_observe_alternate():
    can = GradientCanaries(10, 2, clip_norm=1.0, sample_rate=0.5, seed=0)
    can.inject(torch.zeros(10))
    with pytest.raises(RuntimeError, match="inject called twice"):
        can.inject(torch.zeros(10))
    with pytest.raises(ValueError, match="dim = 10"):
        GradientCanaries(10, 2, clip_norm=1.0, sample_rate=0.5).inject(torch.zeros(11))
    with pytest.raises(ValueError, match="dim = 10"):
        GradientCanaries(10, 2, clip_norm=1.0, sample_rate=0.5).observe(torch.zeros(11))
    with pytest.raises(ValueError, match="n must be <= dim"):
        GradientCanaries(10, 11, clip_norm=1.0, sample_rate=0.5)
    with pytest.raises(ValueError, match="one entry per included canary"):
        can.vector(np.ones(can.included_ids.size + 1))


def test_the_step_samples_and_clips_canaries_like_records():
    """Without noise, what a DpSgdStep adds for its canaries is each sampled included canary's raw
    gradient (norm 4 clip norms) clipped to one clip norm, at its coordinate, nothing else."""
    x, y = _data()
    model = _model()
    step = DpSgdStep(1.0, 0.0, 0.3, len(y))
    b = torch.arange(30)
    plain = step.noisy_gradient(model, x[b], y[b], _loss, torch.Generator().manual_seed(5))
    can = GradientCanaries.for_parameters(
        list(model.parameters()), 400, clip_norm=1.0, sample_rate=0.3, noise_multiplier=1.0, seed=3
    )
    assert can.raw_norm == 4.0
    with_c = step.noisy_gradient(
        model, x[b], y[b], _loss, torch.Generator().manual_seed(5), canaries=can
    )
    names = [k for k, _ in model.named_parameters()]  # the canaries' flattening order
    diff = torch.cat([(with_c[k] - plain[k]).reshape(-1) for k in names]) * step.expected_batch_size
    expected = torch.zeros_like(diff)
    expected[can._coords[torch.as_tensor(can.appearances > 0)]] = 1.0
    torch.testing.assert_close(diff, expected, atol=1e-5, rtol=0)
    assert not can.appearances[~can.included].any()
    k = int(can.appearances[can.included].sum())  # the step's own sampling, rate 0.3
    assert stats.binomtest(k, int(can.included.sum()), 0.3).pvalue > 1e-3


@pytest.mark.parametrize("kind", ["dirac", "random"])
def test_positive_control_noise_removed_is_a_violation(kind):
    claimed = 1.5  # accounted eps 1.5 at 60 steps of q = 0.05: below the 400 canaries' ceiling 2.76
    eps = dpsgd_epsilon(0.05, claimed, 60, DELTA, accountant="pld")
    for seed in range(3):
        # random directions overlap by ~1/sqrt(dim): they need dim >> canaries (4099 vs 400 here)
        res = _dpsgd(
            0.0, claimed, seed=seed, kind=kind, hidden=256 if kind == "random" else 32
        ).audit(accounted_epsilon=eps, delta=DELTA)
        assert res.verdict == "violation", res.message


@pytest.mark.parametrize("target", [1.0, 4.0, 8.0])
def test_negative_control_correct_dpsgd_is_not_a_violation(target):
    from accountants import calibrate_noise_multiplier

    sigma = calibrate_noise_multiplier(target, DELTA, 0.05, 60, accountant="pld").noise_multiplier
    eps = dpsgd_epsilon(0.05, sigma, 60, DELTA, accountant="pld")
    assert eps <= target + 1e-6
    for seed in range(SEEDS):
        res = _dpsgd(sigma, sigma, seed=seed).audit(accounted_epsilon=eps, delta=DELTA)
        assert res.verdict != "violation", res.message
        assert res.epsilon_lower_bound < eps


def test_not_knowing_the_batch_is_weaker_and_still_catches_missing_noise():
    eps = dpsgd_epsilon(0.05, 1.5, 60, DELTA, accountant="pld")
    known = _dpsgd(0.0, 1.5, seed=4).audit(accounted_epsilon=eps, delta=DELTA)
    blind = _dpsgd(0.0, 1.5, seed=4, know_batch=False).audit(accounted_epsilon=eps, delta=DELTA)
    assert known.verdict == "violation"
    assert blind.epsilon_lower_bound <= known.epsilon_lower_bound


CLAIMED = 2.0  # the noise multiplier the opacus runs claim


def _opacus_run(sigma, *, seed, m=400, epochs=3):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _data(seed=seed)
    model = _model(seed)
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        model, opt, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            poisson_sampling=True,
            noise_generator=torch.Generator().manual_seed(seed + 9),
        )
    q = dl.sample_rate
    can = GradientCanaries.for_parameters(
        opt.params, m, clip_norm=1.0, sample_rate=q, noise_multiplier=CLAIMED, seed=seed
    )
    attach_to_opacus(opt, can)
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            for xb, yb in dl:
                opt.zero_grad()
                if len(yb):
                    F.cross_entropy(model(xb), yb).backward()
                    opt.step()
                    steps += 1
    return can, q, steps


def test_opacus_hook_noise_removed_is_caught_and_correct_is_not():
    can, q, steps = _opacus_run(0.0, seed=0)
    assert can.steps == steps > 0
    s = can.scores("sum")
    assert np.all(np.abs(s[~can.included]) < 1e-5)  # opacus' released sum minus the clean sum
    np.testing.assert_allclose(s[can.included], can.appearances[can.included], atol=1e-4)
    eps = dpsgd_epsilon(q, CLAIMED, steps, DELTA, accountant="pld")
    res = can.audit(accounted_epsilon=eps, delta=DELTA)
    assert res.verdict == "violation", res.message
    can, q, steps = _opacus_run(CLAIMED, seed=1)
    eps = dpsgd_epsilon(q, CLAIMED, steps, DELTA, accountant="pld")
    res = can.audit(accounted_epsilon=eps, delta=DELTA)
    assert res.verdict != "violation" and res.epsilon_lower_bound < eps
