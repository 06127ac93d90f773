"""Bug zoo: bugs the field has shipped in DP training code, reproduced in a user's own torch loop,
an opacus training or a Flower app, and audited exactly as a user would.

Each bug is reproduced in a small user-style pipeline: a two-layer MLP on the first 1000 records of
scikit-learn's ``load_digits`` (N 1000, expected batch 50, q 0.05, sigma 1.5, clip 1, 100 steps,
delta 1e-5: the claim is epsilon 1.67), and audited with what a user has:

* the configuration check :func:`privkit.check.check_training`, on the objects the pipeline builds
  (its loader, opacus' engine, optimizer and model, Flower's mod or strategy), before training;
* white-box canary records (:meth:`attacks.whitebox.GradientCanaries.records` / ``through`` /
  ``observe`` in the loop, :func:`attacks.whitebox.attach_to_opacus` with ``data_loader=`` in
  opacus): 200 Dirac canaries drawn by the user's own sampler, clipped by the user's own clipping,
  released with the user's noise; ``canaries.audit(delta=1e-5)`` at 95%.

Per bug: its source (paper, issue or PR), the claimed epsilon, the true epsilon or a bound on it
(privkit's accountants at the noise, rate and steps that really ran; ``inf`` with the reason where
no finite bound exists), the catch rate over the seeds, the tests that caught it (the failed
parts' names), and the correct twin's false-violation rate over the same seeds (the same pipeline
without the bug). A seed is caught when the configuration check finds a mismatch that changes the
epsilon or the white-box audit says ``violation``. Bugs the audit cannot catch say why and what
would.

Usage: ``python benchmarks/bug_zoo.py [--seeds 10] [--bugs NAME ...] [--workers 2] [--quick]
[--json]``; writes benchmarks/results/bug_zoo.json and prints the Markdown table of
docs/bug-zoo.md (``--json``: the JSON). ``--quick``: 3 seeds, 60 steps.
tests/attacks/test_bug_zoo.py runs a fast form of it in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

DELTA = 1e-5
N_RECORDS = 1000
Q = 0.05  # expected batch 50 of 1000: 20 batches per epoch
SIGMA = 1.5
CLIP = 1.0
STEPS = 100
CANARIES = 200
MICRO_BATCHES = 4
RESULTS = Path(__file__).resolve().parent / "results" / "bug_zoo.json"

INF_NO_NOISE = "consecutive releases share their noise: their difference is noise-free"


# ----------------------------------------------------------------------------- pipelines
@dataclass(frozen=True)
class Loop:
    """A user's torch.func DP-SGD loop and what it gets wrong (defaults: nothing).

    sampler : ``poisson`` (opacus' UniformWithReplacementSampler at ``rate_factor * Q``) or
        ``shuffle`` (``DataLoader(shuffle=True)``, fixed batches of ``Q * N``).
    clip : ``example`` (each example to ``clip_factor * CLIP``), ``off`` or ``batch`` (the batch's
        summed gradient to ``CLIP``).
    noise : ``once`` (one draw per step at ``noise_factor * SIGMA * CLIP``), ``micro`` (one draw of
        ``SIGMA * CLIP / MICRO_BATCHES`` per micro-batch, summed) or ``reseeded`` (a generator
        seeded anew in every step).
    normalise : ``fixed`` (the release is the noisy sum) or ``realised`` (divided by the realised
        batch size, times the expected one).
    claimed_steps : the steps the user's accountant counts (default: all of them).
    """

    sampler: str = "poisson"
    rate_factor: float = 1.0
    clip: str = "example"
    clip_factor: float = 1.0
    noise: str = "once"
    noise_factor: float = 1.0
    normalise: str = "fixed"
    claimed_steps: int | None = None


@dataclass(frozen=True)
class Opacus:
    """An opacus training (``make_private``, hooks) and what it gets wrong.

    sampler : ``poisson`` (opacus' default), ``shuffle`` (``poisson_sampling=False`` over a
        shuffling loader) or ``weighted`` (a WeightedRandomSampler balancing a rare class, kept by
        ``poisson_sampling=False``); ``weighted-poisson``: the same loader with opacus' default
        ``poisson_sampling=True`` (opacus replaces the sampler: the weights are lost, opacus #600,
        and the claim holds).
    """

    sampler: str = "poisson"


@dataclass(frozen=True)
class Flower:
    """A Flower app's DP configuration: a ``LocalDpMod`` in the ClientApp (``mod=(C, sensitivity,
    epsilon)``) or a central-DP wrapper around the ServerApp's strategy (``strategy``:
    ``adaptive`` or ``fixed``), checked under ``neighbouring``."""

    mod: tuple[float, float, float] | None = None
    strategy: str | None = None
    neighbouring: str = "replace_one"


def _digits(n: int = N_RECORDS):
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:n] / 16, dtype=torch.float32), torch.tensor(y[:n])


def _mlp(seed: int):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _whitebox(res) -> dict:
    conf = res.conformance
    failed = [f"white-box {p}" for p in conf.failed]
    if res.one_run.verdict == "violation":
        failed.append("white-box one-run bound")
    return {
        "verdict": res.verdict,
        "failed": failed,
        "claimed_epsilon": conf.claimed_epsilon,
        "holds_epsilon": conf.holds_epsilon,
        "holds_note": conf.holds_note,
        "one_run_lower_bound": res.epsilon_lower_bound,
    }


def _config(check) -> dict:
    bad = [f for f in check.findings if f.changes_epsilon]
    return {
        "verdict": "violation" if bad else "consistent",
        "failed": [f"config {f.kind}" for f in bad],
        "findings": [str(f) for f in check.findings],
    }


def _canaries(model, rate: float, steps: int, seed: int):
    """The user's white-box audit: canaries claiming Poisson at ``rate``, SIGMA, ``steps``."""
    from attacks.whitebox import GradientCanaries

    return GradientCanaries.for_parameters(
        list(model.parameters()),
        CANARIES,
        clip_norm=CLIP,
        sample_rate=rate,
        noise_multiplier=SIGMA,
        steps=steps,
        seed=seed,
    )


def run_loop(setup: Loop, seed: int, steps: int = STEPS) -> dict:
    """One training of the user's loop with ``setup``'s bugs, checked and audited as a user would."""
    import torch
    from torch.func import functional_call, grad, vmap
    from torch.utils.data import DataLoader, TensorDataset

    from privkit.check import check_training

    torch.set_num_threads(1)
    x, y = _digits()
    data = TensorDataset(x, y)
    model = _mlp(seed)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = int(Q * len(data))
    g = torch.Generator().manual_seed(seed)
    if setup.sampler == "shuffle":
        loader = DataLoader(data, batch_size=batch, shuffle=True, generator=g)
    else:
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        sampler = UniformWithReplacementSampler(
            num_samples=len(data), sample_rate=Q * setup.rate_factor, generator=g
        )
        loader = DataLoader(data, batch_sampler=sampler)
    claimed_steps = setup.claimed_steps or steps
    # the user's own accounting: Poisson at rate Q, noise SIGMA, claimed_steps steps
    config = _config(
        check_training(
            loader, delta=DELTA, steps=claimed_steps, noise_multiplier=SIGMA, sample_rate=Q
        )
    )
    canaries = _canaries(model, Q, claimed_steps, seed)
    loader = canaries.records(loader)

    def loss(p, xb, yb):
        out = functional_call(model, p, (xb[None],))
        return torch.nn.functional.cross_entropy(out, yb[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    noise_gen = torch.Generator().manual_seed(seed + 1000)
    step = 0
    while step < steps:
        for xb, yb in loader:
            if step >= steps:
                break
            grads = canaries.through(per_example(params, xb, yb))
            rows = len(xb)
            norms = torch.sqrt(sum(v.reshape(rows, -1).pow(2).sum(1) for v in grads.values()))
            limit = CLIP * setup.clip_factor
            factor = (
                torch.ones_like(norms)
                if setup.clip in ("off", "batch")
                else (limit / (norms + 1e-6)).clamp(max=1.0)
            )
            if setup.noise == "reseeded":  # the bug: a generator seeded inside the step
                noise_gen = torch.Generator().manual_seed(seed)
            if setup.noise == "micro":  # noise per micro-batch, sigma / k each, then summed
                chunks = torch.arange(rows) % MICRO_BATCHES
                noisy = {k: torch.zeros(v.shape[1:]) for k, v in grads.items()}
                for c in range(MICRO_BATCHES):
                    sel = chunks == c
                    for k, v in grads.items():
                        part = torch.einsum("b,b...->...", factor[sel], v[sel])
                        std = SIGMA * CLIP / MICRO_BATCHES
                        noisy[k] = (
                            noisy[k] + part + torch.randn(part.shape, generator=noise_gen) * std
                        )
            else:
                summed = {k: torch.einsum("b,b...->...", factor, v) for k, v in grads.items()}
                if setup.clip == "batch":  # the bug: the batch's sum clipped, not each example
                    total = torch.sqrt(sum(v.pow(2).sum() for v in summed.values()))
                    scale = min(1.0, CLIP / (float(total) + 1e-6))
                    summed = {k: v * scale for k, v in summed.items()}
                std = setup.noise_factor * SIGMA * CLIP
                noisy = {
                    k: v + torch.randn(v.shape, generator=noise_gen) * std
                    for k, v in summed.items()
                }
            if setup.normalise == "realised":  # divided by the realised batch size
                release = {k: v / max(rows, 1) * batch for k, v in noisy.items()}
            else:
                release = noisy
            canaries.observe(list(release.values()))
            params = {k: params[k] - 0.5 * release[k] / batch for k in params}
            step += 1
    return {"config": config, "whitebox": _whitebox(canaries.audit(delta=DELTA))}


def _imbalanced():
    """Digits with class 0 cut to 10 records (the rare class a weighted sampler balances)."""
    import torch

    x, y = _digits()
    zeros = torch.nonzero(y == 0).reshape(-1)
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[zeros[10:]] = False
    x, y = x[keep], y[keep]
    counts = torch.bincount(y, minlength=10).double()
    return x, y, 1.0 / counts[y]


def run_opacus(setup: Opacus, seed: int, steps: int = STEPS) -> dict:
    """One opacus training with ``setup``'s sampler, checked and audited as a user would."""
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

    from attacks.whitebox import attach_to_opacus
    from privkit.check import check_training

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    if setup.sampler.startswith("weighted"):
        x, y, w = _imbalanced()
        data = TensorDataset(x, y)
        sampler = WeightedRandomSampler(w, len(data), replacement=True, generator=g)
        loader = DataLoader(data, batch_size=int(Q * len(data)), sampler=sampler)
    else:
        data = TensorDataset(*_digits())
        loader = DataLoader(data, batch_size=int(Q * len(data)), shuffle=True, generator=g)
    model = _mlp(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():  # opacus warns that secure mode is off: not for release
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            poisson_sampling=setup.sampler in ("poisson", "weighted-poisson"),
        )
    q = 1 / len(loader)  # the rate opacus accounts
    config = _config(check_training(engine, model, optimizer, loader, delta=DELTA, steps=steps))
    canaries = _canaries(model, q, steps, seed)
    loader = attach_to_opacus(optimizer, canaries, data_loader=loader)
    criterion = torch.nn.CrossEntropyLoss()
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while step < steps:
            for xb, yb in loader:
                if step >= steps:
                    break
                optimizer.zero_grad()
                criterion(model(xb), yb).backward()
                optimizer.step()
                step += 1
    return {"config": config, "whitebox": _whitebox(canaries.audit(delta=DELTA))}


def _flower_objects(setup: Flower):
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideAdaptiveClipping,
        DifferentialPrivacyClientSideFixedClipping,
        FedAvg,
    )

    if setup.mod is not None:
        from flwr.clientapp import ClientApp
        from flwr.clientapp.mod import LocalDpMod

        clip, sensitivity, epsilon = setup.mod
        mod = LocalDpMod(clipping_norm=clip, sensitivity=sensitivity, epsilon=epsilon, delta=DELTA)
        return mod, ClientApp(mods=[mod])
    if setup.strategy == "adaptive":
        return DifferentialPrivacyClientSideAdaptiveClipping(
            FedAvg(), noise_multiplier=1.0, num_sampled_clients=20
        ), None
    return DifferentialPrivacyClientSideFixedClipping(
        FedAvg(), noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=20
    ), None


def run_flower(setup: Flower, seed: int, steps: int = STEPS) -> dict:
    """The configuration check of a Flower app's DP (deterministic: it reads the configuration;
    no white-box audit of the app here, see the module's docs)."""
    from privkit.check import check_training

    obj, app = _flower_objects(setup)
    check = check_training(
        app if app is not None else obj, delta=DELTA, neighbouring=setup.neighbouring
    )
    return {"config": _config(check), "whitebox": None}


RUNNERS: dict[type, Callable] = {Loop: run_loop, Opacus: run_opacus, Flower: run_flower}


# ----------------------------------------------------------------------------- epsilons
def poisson_epsilon(q: float, sigma: float, steps: int) -> float:
    """PLD epsilon of ``steps`` Poisson-subsampled Gaussian steps at DELTA (privkit's accountant)."""
    from accountants.dpsgd import dpsgd_epsilon

    return float(dpsgd_epsilon(q, sigma, steps, DELTA, accountant="pld"))


def claimed(steps: int = STEPS) -> float:
    return poisson_epsilon(Q, SIGMA, steps)


def _exact(value: float, how: str) -> dict:
    return {"epsilon": value, "kind": "exact", "how": how}


def _upper(value: float, how: str, lower: float | None = None) -> dict:
    return {"epsilon": value, "kind": "upper bound", "lower": lower, "how": how}


def _unbounded(why: str, reference: float | None = None) -> dict:
    return {"epsilon": math.inf, "kind": "no finite bound", "how": why, "reference": reference}


def _shuffle_bracket(steps: int) -> dict:
    from accountants.samplers import sampler_accounting

    acc = sampler_accounting("shuffle", Q, SIGMA, steps, DELTA)
    return _upper(
        float(acc.epsilon),
        "accountants.samplers.sampler_accounting('shuffle'): Gaussian per epoch without "
        "amplification; certified lower bound by Chua et al.'s attack",
        None if acc.epsilon_lower is None else float(acc.epsilon_lower),
    )


def _weighted_rate() -> float:
    """The rate opacus accounts for the weighted loader: 1 / len(loader)."""
    n = len(_imbalanced()[1])
    return 1 / math.ceil(n / int(Q * n))


def _weighted_truth(steps: int) -> dict:
    _, y, w = _imbalanced()
    share = float(w.max() / w.sum())
    batch = int(Q * len(y))
    p = -math.expm1(batch * math.log1p(-share))
    return _unbounded(
        "sampling with replacement has no sound accountant (a record drawn twice in one batch "
        f"moves the sum by 2C); the rare class's records join a step with probability {p:.3f}, "
        f"{p / _weighted_rate():.1f}x the accounted rate: Poisson at that rate would give the "
        "reference epsilon (not a bound)",
        poisson_epsilon(min(p, 1.0), SIGMA, steps),
    )


def _flower_truth(setup: Flower) -> tuple[float, dict]:
    """(claimed, true) of one round for one client, from :func:`privkit.flower.check_flower_dp`."""
    from privkit.flower import check_flower_dp

    obj, _ = _flower_objects(setup)
    kw = {} if setup.mod is not None else {"delta": DELTA}
    check = check_flower_dp(obj, neighbouring=setup.neighbouring, **kw)
    claim = check.claimed_epsilon if check.claimed_epsilon is not None else check.epsilon
    return float(claim), _exact(
        float(check.epsilon),
        f"privkit.flower.check_flower_dp: the Gaussian's exact epsilon at the noise multiplier "
        f"{check.noise_multiplier:.4g} that runs ({setup.neighbouring}), one round, one client",
    )


# ----------------------------------------------------------------------------- the zoo
@dataclass(frozen=True)
class Bug:
    """One bug of the zoo: its pipeline setup, correct twin, source and epsilons."""

    name: str
    title: str
    source: str
    setup: Loop | Opacus | Flower
    twin: Loop | Opacus | Flower
    truth: Callable[[int], dict]
    claim: Callable[[int], float] = claimed
    uncaught: str = ""  # why the audit cannot catch it, and what would
    notes: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def pipeline(self) -> str:
        return {Loop: "torch loop", Opacus: "opacus", Flower: "Flower app"}[type(self.setup)]


CHUA = (
    "Chua et al., ICML 2024 (How private are DP-SGD implementations?); Annamalai, Balle, Hayes "
    "& De Cristofaro, NDSS 2026"
)

BUGS: tuple[Bug, ...] = (
    Bug(
        "shuffle-as-poisson",
        "shuffled fixed-size batches accounted as Poisson (user loop)",
        CHUA,
        Loop(sampler="shuffle"),
        Loop(),
        _shuffle_bracket,
    ),
    Bug(
        "opacus-shuffle",
        "opacus poisson_sampling=False: shuffled batches, accounted as Poisson",
        CHUA + "; opacus/privacy_engine.py documents it as 'a good approximation'",
        Opacus(sampler="shuffle"),
        Opacus(),
        _shuffle_bracket,
    ),
    Bug(
        "opacus-weighted-sampler",
        "opacus with a WeightedRandomSampler kept (poisson_sampling=False), accounted at "
        "1 / len(loader)",
        "meta-pytorch/opacus #813 (sample rate from len(loader)), PRs #814/#815; #600",
        Opacus(sampler="weighted"),
        Opacus(sampler="weighted-poisson"),
        _weighted_truth,
        claim=lambda steps: poisson_epsilon(_weighted_rate(), SIGMA, steps),
        notes="twin: the same loader under opacus' default poisson_sampling=True (opacus replaces "
        "the sampler, #600: the weights are lost, the claim holds)",
    ),
    Bug(
        "rate-doubled",
        "sampling rate twice the accounted one (batch size doubled after accounting; a "
        "distributed loader without its sampler)",
        "meta-pytorch/opacus #444 (DPDDP processes twice the expected examples)",
        Loop(rate_factor=2.0),
        Loop(),
        lambda steps: _exact(poisson_epsilon(2 * Q, SIGMA, steps), "PLD at rate 2q"),
    ),
    Bug(
        "noise-reseeded",
        "noise from a generator re-seeded in every step (the same noise in every release)",
        "field-2026 section 1 (other classes); privkit issue 30",
        Loop(noise="reseeded"),
        Loop(),
        lambda steps: _unbounded(INF_NO_NOISE),
    ),
    Bug(
        "noise-per-microbatch",
        f"noise added per micro-batch of gradient accumulation, sigma/{MICRO_BATCHES} each "
        "(noise std x1/2)",
        "jax_privacy docs/sharp_edges_dp_training_pitfalls.md: gradient accumulation",
        Loop(noise="micro"),
        Loop(),
        lambda steps: _exact(
            poisson_epsilon(Q, SIGMA / math.sqrt(MICRO_BATCHES), steps),
            f"PLD at noise sigma / sqrt({MICRO_BATCHES})",
        ),
    ),
    Bug(
        "noise-halved",
        "noise multiplier halved (the noise added is half the accounted one)",
        "privkit issue 30 (the mutation suite's noise x1/2, benchmarks/audit_mutations.md)",
        Loop(noise_factor=0.5),
        Loop(),
        lambda steps: _exact(poisson_epsilon(Q, SIGMA / 2, steps), "PLD at noise sigma / 2"),
    ),
    Bug(
        "clipping-off",
        "per-example clipping left off (noise at the claimed clip norm)",
        "dp-recorder, Cebere et al., PETS 2026 (declared vs real sensitivity)",
        Loop(clip="off"),
        Loop(),
        lambda steps: _unbounded("a record's gradient is unbounded: no sensitivity"),
    ),
    Bug(
        "clip-norm-mismatch",
        "examples clipped to 2C while the noise is sized for C",
        "jax_privacy sharp edges: sensitivity misaligned; dp-recorder, PETS 2026 (declared vs "
        "real sensitivity)",
        Loop(clip_factor=2.0),
        Loop(),
        lambda steps: _exact(
            poisson_epsilon(Q, SIGMA / 2, steps), "PLD at noise sigma / 2 (sensitivity 2C)"
        ),
    ),
    Bug(
        "divide-by-realised-batch",
        "release divided by the realised batch size (not the expected one)",
        "jax_privacy sharp edges: division by the batch size",
        Loop(normalise="realised"),
        Loop(),
        lambda steps: _unbounded(
            "the release's scale depends on the realised batch size, which the target's "
            "presence changes: a mechanism other than the accounted Gaussian, which privkit's "
            "accountants do not bound"
        ),
    ),
    Bug(
        "ledger-steps-per-epoch",
        "ledger counting one step per epoch instead of every local step",
        "KarhouTam/FL-bench PR #200 (trainloader_length=1)",
        Loop(claimed_steps=STEPS * Q),  # replaced per run: steps * Q epochs
        Loop(),
        lambda steps: _exact(claimed(steps), f"PLD over all {steps} steps"),
        claim=lambda steps: claimed(max(1, round(steps * Q))),
    ),
    Bug(
        "batch-clipping",
        "the batch's summed gradient clipped to C instead of each example",
        "field-2026 section 1 (other classes); jax_privacy sharp edges: cross-example operations",
        Loop(clip="batch"),
        Loop(),
        lambda steps: _upper(
            poisson_epsilon(Q, SIGMA / 2, steps),
            "PLD at noise sigma / 2: one record moves the clipped sum by up to 2C (tight for an "
            "adversarial data set)",
        ),
        uncaught="in a data set of benign records one record's influence on the clipped sum "
        "never exceeds C (a canary of raw norm 4C is clipped with its batch to at most C), "
        "and the noise, sampling and releases are as claimed; only the worst case, other "
        "records whose sum points against the target, moves the release by 2C. What would "
        "catch it: an adversarial data set (crafted records whose gradients cancel or oppose "
        "the canary's, Nasr et al. 2021), or a code-level check that clipping is per example",
    ),
    Bug(
        "flower-localdp-classic-formula",
        "Flower LocalDpMod's classic Gaussian formula at epsilon >= 1 (epsilon 10)",
        "flwr LocalDpMod (add_localdp_gaussian_noise_to_params); Dwork & Roth 2014 Thm A.1 holds "
        "for epsilon < 1",
        Flower(mod=(1.0, 2.0, 10.0)),
        Flower(mod=(1.0, 2.0, 0.5)),
        lambda steps: _flower_truth(Flower(mod=(1.0, 2.0, 10.0)))[1],
        claim=lambda steps: _flower_truth(Flower(mod=(1.0, 2.0, 10.0)))[0],
    ),
    Bug(
        "flower-localdp-sensitivity",
        "Flower LocalDpMod with sensitivity = clipping_norm under replace-one (the update moves "
        "by 2C)",
        "flwr LocalDpMod docs; jax_privacy sharp edges: sensitivity vs the neighbouring relation",
        Flower(mod=(1.0, 1.0, 0.5)),
        Flower(mod=(1.0, 2.0, 0.5)),
        lambda steps: _flower_truth(Flower(mod=(1.0, 1.0, 0.5)))[1],
        claim=lambda steps: _flower_truth(Flower(mod=(1.0, 1.0, 0.5)))[0],
        notes="Flower's own example LocalDpMod(1, 1, 10, 1e-5) has both LocalDpMod bugs: 25.44 "
        "per round, not 10",
    ),
    Bug(
        "flower-adaptive-zero-out",
        "Flower adaptive clipping under zero-out: the clip count's sensitivity is 1, not 1/2",
        "flwr DifferentialPrivacyClientSideAdaptiveClipping; Andrew et al., NeurIPS 2021 "
        "(centred bits)",
        Flower(strategy="adaptive", neighbouring="add_remove"),
        Flower(strategy="fixed", neighbouring="add_remove"),
        lambda steps: _flower_truth(Flower(strategy="adaptive", neighbouring="add_remove"))[1],
        claim=lambda steps: _flower_truth(Flower(strategy="adaptive", neighbouring="add_remove"))[
            0
        ],
        notes="twin: fixed clipping at the same noise multiplier 1",
    ),
)
BY_NAME = {b.name: b for b in BUGS}


def _setup_for(setup, steps: int):
    if isinstance(setup, Loop) and setup.claimed_steps is not None:
        return replace(setup, claimed_steps=max(1, round(steps * Q)))
    return setup


def one(task: tuple[str, str, int, int]) -> dict:
    """Run one (bug or its twin, seed): what the configuration check and the white-box audit say."""
    name, which, seed, steps = task
    bug = BY_NAME[name]
    setup = _setup_for(bug.setup if which == "bug" else bug.twin, steps)
    t0 = time.perf_counter()
    try:
        out = RUNNERS[type(setup)](setup, seed, steps)
    except Exception as exc:  # recorded, never hidden
        return {
            "bug": name,
            "which": which,
            "seed": seed,
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.perf_counter() - t0,
        }
    parts = [p for p in (out["config"], out["whitebox"]) if p is not None]
    return {
        "bug": name,
        "which": which,
        "seed": seed,
        "status": "violation" if any(p["verdict"] == "violation" for p in parts) else "consistent",
        "caught_by": [f for p in parts for f in p["failed"]],
        **out,
        "seconds": time.perf_counter() - t0,
    }


def _key(bug: Bug, which: str) -> tuple:
    """Runs shared between bugs: every loop bug's twin is the same correct loop."""
    setup = bug.setup if which == "bug" else bug.twin
    return (type(setup).__name__, repr(setup))


def tasks_for(bugs, seeds: int, steps: int) -> tuple[list[tuple], dict]:
    """The distinct runs (a twin shared by several bugs runs once) and which bug uses each."""
    runs: dict[tuple, tuple] = {}
    uses: dict[tuple, tuple] = {}
    for bug in bugs:
        for which in ("bug", "twin"):
            for s in range(seeds):
                k = (*_key(bug, which), s)
                runs.setdefault(k, (bug.name, which, s, steps))
                uses[(bug.name, which, s)] = k
    return list(runs.values()), {u: list(runs).index(k) for u, k in uses.items()}


def _count(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] != "error"]
    return {
        "seeds": len(rows),
        "errors": sorted({r["error"] for r in rows if r["status"] == "error"}),
        "violations": sum(r["status"] == "violation" for r in ok),
        "whitebox_violations": sum(
            r["whitebox"] is not None and r["whitebox"]["verdict"] == "violation" for r in ok
        ),
        "config_violations": sum(r["config"]["verdict"] == "violation" for r in ok),
        "rate": (sum(r["status"] == "violation" for r in ok) / len(ok)) if ok else None,
    }


def summarise(bug: Bug, rows: list[dict], twin_rows: list[dict], steps: int) -> dict:
    """One bug's entry of the JSON: epsilons, catch rate and what caught it, the twin's rate."""
    true = bug.truth(steps)
    claim = float(bug.claim(steps))
    caught_by: dict[str, int] = {}
    for r in rows:
        for f in r.get("caught_by", []):
            caught_by[f] = caught_by.get(f, 0) + 1
    ratio = true["epsilon"] / claim if claim > 0 else math.inf
    holds = [r["whitebox"]["holds_epsilon"] for r in rows if r.get("whitebox")]
    holds = [h for h in holds if h is not None]
    return {
        "title": bug.title,
        "source": bug.source,
        "pipeline": bug.pipeline,
        "setup": repr(bug.setup),
        "twin": repr(bug.twin),
        "claimed_epsilon": claim,
        "true_epsilon": true,
        "ratio": ratio,
        "must_catch": ratio >= 1.5 and not bug.uncaught,
        "caught": _count(rows),
        "caught_by": dict(sorted(caught_by.items(), key=lambda kv: -kv[1])),
        "holds_epsilon_median": float(np.median(holds)) if holds else None,
        "holds_note": next(
            (
                r["whitebox"]["holds_note"]
                for r in rows
                if r.get("whitebox") and r["whitebox"]["holds_note"]
            ),
            "",
        ),
        "config_findings": next(
            (r["config"]["findings"] for r in rows if r.get("config") and r["config"]["findings"]),
            [],
        ),
        "twin_false_violations": _count(twin_rows),
        "twin_flagged_by": sorted({f for r in twin_rows for f in r.get("caught_by", [])}),
        "uncaught_reason": bug.uncaught,
        "notes": bug.notes,
        "seeds": [{k: r.get(k) for k in ("seed", "status", "caught_by", "seconds")} for r in rows],
    }


def run_zoo(
    names=None, seeds: int = 10, steps: int = STEPS, workers: int = 1, progress: bool = False
) -> dict:
    """Run the zoo (``names``: a subset) over ``seeds`` seeds; the JSON's ``bugs`` dict."""
    bugs = [BY_NAME[n] for n in (names or BY_NAME)]
    tasks, use = tasks_for(bugs, seeds, steps)
    results: list[dict | None] = [None] * len(tasks)
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for i, row in enumerate(pool.map(one, tasks)):
                results[i] = row
                _report(progress, i, tasks, row)
    else:
        for i, t in enumerate(tasks):
            results[i] = one(t)
            _report(progress, i, tasks, results[i])
    out = {}
    for bug in bugs:
        rows = [results[use[(bug.name, "bug", s)]] for s in range(seeds)]
        twin = [results[use[(bug.name, "twin", s)]] for s in range(seeds)]
        out[bug.name] = summarise(bug, rows, twin, steps)
    return out


def _report(progress: bool, i: int, tasks: list, row: dict) -> None:
    if progress:
        print(
            f"[{i + 1}/{len(tasks)}] {row['bug']} {row['which']} seed {row['seed']}: "
            f"{row['status']} {', '.join(row.get('caught_by', [])) or row.get('error', '')} "
            f"({row['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )


# ----------------------------------------------------------------------------- output
def _eps(x) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2f}"


def _truth_cell(t: dict) -> str:
    if t["kind"] == "no finite bound":
        ref = (
            "" if t.get("reference") is None else f" (Poisson at its rate: {_eps(t['reference'])})"
        )
        return "inf" + ref
    if t["kind"] == "upper bound":
        low = "" if t.get("lower") is None else f", >= {_eps(t['lower'])} certified"
        return f"<= {_eps(t['epsilon'])}{low}"
    return _eps(t["epsilon"])


def markdown(bugs: dict, seeds: int) -> str:
    head = (
        "| bug | source | pipeline | claimed epsilon | true epsilon | caught | caught by | "
        "twin flagged |\n|---|---|---|--:|---|--:|---|--:|\n"
    )
    lines = []
    for name, b in bugs.items():
        c, t = b["caught"], b["twin_false_violations"]
        by = ", ".join(f"{k} ({v})" for k, v in b["caught_by"].items()) or (
            "not caught" + (": see below" if b["uncaught_reason"] else "")
        )
        lines.append(
            f"| {name} | {b['source']} | {b['pipeline']} | {_eps(b['claimed_epsilon'])} | "
            f"{_truth_cell(b['true_epsilon'])} | {c['violations']}/{c['seeds']} | {by} | "
            f"{t['violations']}/{t['seeds']} |"
        )
    return f"Caught / seeds ({seeds} seeds each)\n\n" + head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--bugs", nargs="*", default=list(BY_NAME))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 seeds, 60 steps")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    unknown = [b for b in args.bugs if b not in BY_NAME]
    if unknown:
        print(
            f"--bugs must name bugs of the zoo ({', '.join(BY_NAME)}); found {unknown[0]}",
            file=sys.stderr,
        )
        return 2
    if args.seeds < 1 or args.steps < 20:
        print(
            f"--seeds must be >= 1 and --steps >= 20; found {args.seeds}, {args.steps}",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.seeds, args.steps = 3, 60
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    bugs = run_zoo(args.bugs, args.seeds, args.steps, args.workers, progress=not args.json)
    result = {
        "schema_version": 1,
        "benchmark": "bug_zoo",
        "delta": DELTA,
        "seeds": args.seeds,
        "setting": {
            "data": f"load_digits, first {N_RECORDS} records",
            "model": "MLP 64-32-10",
            "sample_rate": Q,
            "noise_multiplier": SIGMA,
            "clip_norm": CLIP,
            "steps": args.steps,
            "canaries": CANARIES,
            "confidence": 0.95,
        },
        "wall_seconds": time.perf_counter() - t0,
        "bugs": bugs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float))
    print(json.dumps(result, default=float) if args.json else markdown(bugs, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
