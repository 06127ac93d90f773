"""Audit power at the demo's budget: broken mechanisms caught, correct DP-SGD not, and how close
each audit mode comes to the accounted epsilon, beside published figures.

Setting: the demo's data and DP method (``privkit demo``: mnist5k pooled over 20 clients, privkit's
DP-SGD with the ``dpsgd`` quick config: CNN width 8, clip 1, lr 0.5, expected batch 128 of
3200 records, 3 epochs, Poisson rate 0.04, 75 steps), trained by the audit controls' loop
(:func:`privkit.audit.controls.train_twin`). Every bound is one-run (Steinke et al. 2023) at 95%
over records included by fair coins, guesses :data:`attacks.canaries.ONE_SIDED_GUESSES`.

Rows, each over ``--seeds`` seeds:

* positive controls: a non-private model (no clipping, no noise; privkit's non-private baseline
  settings, 20 epochs, and the demo's 3 epochs) claiming epsilon 1, audited black-box with 1000
  out-of-distribution canary records; DP-SGD with its noise removed claiming the demo's epsilon,
  audited white-box with 1000 Dirac gradient canaries. Count of ``violation``.
* correct DP-SGD at epsilon 1, 4 and 8 (noise calibrated to each), one run per seed audited three
  ways at once: ``black-box`` (loss threshold on 1000 natural pooled records included by fair
  coins), ``canary`` (1000 out-of-distribution canary records), ``white-box`` (1000 gradient
  canaries). Count of ``violation`` and the ratio empirical / accounted epsilon (median, max).
  White-box bounds also under the f-DP analysis with the Gaussian curve (claim: as private as the
  Gaussian mechanism at (eps, delta)) and with the ledger's own curve (claim: as private as the
  ledger's PLD).
  Measured: the ledger-curve bound sits at about 0.9-0.95 of the claim whatever the evidence once a
  few guesses are right (median = max over seeds; 0 with no signal): the profile family it searches
  jumps there, so it says "not refuted" but is no estimate of how tight the accounting is.
* curve validity on the exact white-box mechanism (no training: each canary's view is its Poisson
  sampled appearances plus N(0, sigma^2) per step, which is what the white-box auditor sees when it
  knows the other records' gradients): false-violation rate of the three analyses over
  ``--sim-seeds`` seeds.

Usage: ``python benchmarks/audit_power.py [--seeds 10] [--sim-seeds 200] [--json]``
(about 20-30 minutes on 2 CPU cores at the defaults; ``--quick``: 2 seeds, 40 simulation seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import numpy as np

DELTA = 1e-5
EPSILONS = (1.0, 4.0, 8.0)
M = 1000  # canaries / audited records per mode

#: Published figures for the same kinds of audit (empirical lower bound vs theoretical epsilon).
PUBLISHED = [
    {
        "mode": "white-box",
        "source": "Steinke, Nasr & Jagielski, NeurIPS 2023 (one run, CIFAR-10 "
        "WRN-16-4, gradient canaries)",
        "epsilon": 4.0,
        "empirical": 1.8,
    },
    {
        "mode": "white-box",
        "source": "Nasr et al., USENIX Security 2023 'Tight auditing' (Dirac "
        "gradient canaries, two runs and tight composition; not one-run)",
        "epsilon": None,
        "empirical": None,
        "note": "empirical ~ theoretical (tight)",
    },
    {
        "mode": "white-box",
        "source": "Yoon, Jeung & No, arXiv 2412.01756v1 (MNIST; protocol: see paper)",
        "epsilon": 10.0,
        "empirical": 6.68,
    },
    {
        "mode": "canary",
        "source": "ML Privacy Meter documentation/dpaudit.md (one run, CIFAR-10, "
        "1000 mislabelled canaries)",
        "epsilon": 68.51,
        "empirical": 0.42,
    },
    {
        "mode": "canary",
        "source": "Annamalai & De Cristofaro, NeurIPS 2024 (black-box, crafted "
        "initial parameters, many runs, MNIST 1000-record sample)",
        "epsilon": 10.0,
        "empirical": 7.0,
        "note": "about 7 (auditing notes)",
    },
    {
        "mode": "black-box",
        "source": "Yoon, Jeung & No, arXiv 2412.01756v1 (MNIST, in-distribution "
        "canaries; protocol: see paper)",
        "epsilon": 10.0,
        "empirical": 4.33,
    },
]


# ---------------------------------------------------------------------------------- set-up
def demo_setting():
    """The demo's federation and its dpsgd trainer config."""
    from privkit.data import build_federation
    from privkit.pipeline import bundled_config, load_run_config

    run = load_run_config(bundled_config("quickstart"))
    fed = build_federation(run.config.federation)
    dp = next(m for m in run.methods if m.method == "dpsgd")
    return fed, dict(dp.trainer)


def _audit(scores, included, claim, seed, curve="generic"):
    from attacks import audit_scores
    from attacks.canaries import ONE_SIDED_GUESSES

    return audit_scores(
        scores,
        included,
        accounted_epsilon=claim,
        delta=DELTA,
        seed=seed,
        guesses=ONE_SIDED_GUESSES,
        inclusion="random",
        curve=curve,
    )


def _training_data(fed, seed: int, natural: bool):
    """Pooled records (1000 of them audited, each in by a fair coin, when ``natural``) plus 1000
    ood canary records (each in by a fair coin); returns (CanaryData, natural coins or None)."""
    from attacks.canaries import insert_canaries
    from attacks.experiment import stream
    from privkit.audit.controls import _ood_fraction

    x, y = fed.pooled_arrays()
    coins = None
    if natural:  # the excluded audited records leave the training data
        rng = stream(seed, "benchmark/natural")
        audited = rng.choice(len(y), M, replace=False)
        coins = rng.random(M) < 0.5
        keep = np.ones(len(y), dtype=bool)
        keep[audited[~coins]] = False
        x, y = x[keep], y[keep]
    data = insert_canaries(
        x,
        y,
        M,
        kind="ood",
        seed=seed,
        num_classes=fed.num_classes,
        ood_fraction=_ood_fraction(int(np.prod(x.shape[1:])), M),
        ood_amplitude=5.0,
    )
    return data, coins


def _natural_scores(model, fed, seed):
    """Loss scores of the 1000 audited natural records (included or not)."""
    from attacks.canaries import canary_scores
    from attacks.experiment import stream
    from attacks.recipe import predict_logits

    x, y = fed.pooled_arrays()
    audited = stream(seed, "benchmark/natural").choice(len(y), M, replace=False)
    return canary_scores(predict_logits(model, x[audited], fed.num_classes), y[audited], "loss")


# ---------------------------------------------------------------------------------- rows
def positive_non_private(fed, cfg, seeds, epochs: int) -> dict:
    from attacks.canaries import canary_scores
    from attacks.recipe import predict_logits
    from privkit.audit.controls import NON_PRIVATE, ControlRecipe, method_recipe, train_twin

    recipe, _, _ = method_recipe(fed, cfg)
    bounds, caught = [], 0
    for seed in seeds:
        data, _ = _training_data(fed, seed, natural=False)
        r = ControlRecipe.of(
            recipe.spec, len(data.y_train), clip_norm=recipe.clip_norm, epochs=epochs, **NON_PRIVATE
        )
        model = train_twin(r, data.x_train, data.y_train, noise_multiplier=None, seed=seed)
        z = predict_logits(model, data.canary_x, fed.num_classes)
        res = _audit(canary_scores(z, data.canary_y, "loss"), data.included, 1.0, seed)
        bounds.append(res.epsilon_lower_bound)
        caught += res.verdict == "violation"
    return {
        "row": f"non-private ({epochs} epochs, lr 0.1, batch 64), claims eps 1",
        "mode": "canary",
        "claimed_epsilon": 1.0,
        "violations": caught,
        "seeds": len(seeds),
        "median_bound": float(np.median(bounds)),
        "min_bound": float(np.min(bounds)),
    }


def _gradient_canaries(recipe, sigma_claimed, seed):
    from attacks.whitebox import GradientCanaries
    from privkit.models import build_from_spec

    params = [p for p in build_from_spec(recipe.spec).parameters() if p.requires_grad]
    return GradientCanaries.for_parameters(
        params,
        M,
        clip_norm=recipe.clip_norm,
        sample_rate=recipe.sample_rate,
        noise_multiplier=sigma_claimed,
        seed=seed,
    )


def positive_noise_removed(fed, cfg, seeds) -> dict:
    from privkit.audit.controls import claimed_epsilon, method_recipe, train_twin

    recipe, sigma, _ = method_recipe(fed, cfg)
    claim = claimed_epsilon(recipe, sigma, DELTA)
    bounds, caught = [], 0
    for seed in seeds:
        data, _ = _training_data(fed, seed, natural=False)
        wb = _gradient_canaries(replace(recipe, n=len(data.y_train)), sigma, seed)
        train_twin(
            replace(recipe, n=len(data.y_train)),
            data.x_train,
            data.y_train,
            noise_multiplier=0.0,
            seed=seed,
            gradient_canaries=wb,
        )
        res = _audit(wb.scores(), wb.included, claim, seed)
        bounds.append(res.epsilon_lower_bound)
        caught += res.verdict == "violation"
    return {
        "row": f"DP-SGD, noise removed, claims the demo's eps {claim:.3f}",
        "mode": "white-box",
        "claimed_epsilon": claim,
        "violations": caught,
        "seeds": len(seeds),
        "median_bound": float(np.median(bounds)),
        "min_bound": float(np.min(bounds)),
    }


def correct_dpsgd(fed, cfg, seeds, target: float) -> list[dict]:
    from accountants import Ledger, calibrate_noise_multiplier, dpsgd_event, ledger_curve
    from attacks.canaries import canary_scores
    from attacks.recipe import predict_logits
    from privkit.audit.controls import claimed_epsilon, method_recipe, train_twin

    recipe, _, _ = method_recipe(fed, cfg)
    sigma = calibrate_noise_multiplier(
        target, DELTA, recipe.sample_rate, recipe.steps
    ).noise_multiplier
    eps = claimed_epsilon(recipe, sigma, DELTA)
    ledger = Ledger()
    ledger.add(0, dpsgd_event(recipe.sample_rate, sigma, recipe.steps), "dp-sgd")
    lcurve = ledger_curve(ledger)
    rows = {
        k: []
        for k in ("black-box", "canary", "white-box", "white-box/gaussian", "white-box/ledger")
    }
    for seed in seeds:
        data, coins = _training_data(fed, seed, natural=True)
        r = replace(recipe, n=len(data.y_train))
        wb = _gradient_canaries(r, sigma, seed)
        model = train_twin(
            r, data.x_train, data.y_train, noise_multiplier=sigma, seed=seed, gradient_canaries=wb
        )
        z = predict_logits(model, data.canary_x, fed.num_classes)
        rows["black-box"].append(_audit(_natural_scores(model, fed, seed), coins, eps, seed))
        rows["canary"].append(
            _audit(canary_scores(z, data.canary_y, "loss"), data.included, eps, seed)
        )
        rows["white-box"].append(_audit(wb.scores(), wb.included, eps, seed))
        rows["white-box/gaussian"].append(
            _audit(wb.scores(), wb.included, eps, seed, curve="gaussian")
        )
        rows["white-box/ledger"].append(_audit(wb.scores(), wb.included, eps, seed, curve=lcurve))
    out = []
    for mode, results in rows.items():
        b = np.array([x.epsilon_lower_bound for x in results])
        out.append(
            {
                "row": f"correct DP-SGD at eps {target:g}",
                "mode": mode,
                "accounted_epsilon": eps,
                "noise_multiplier": sigma,
                "claim_tested": results[0].claim_tested,
                "violations": int(sum(x.verdict == "violation" for x in results)),
                "seeds": len(seeds),
                "median_bound": float(np.median(b)),
                "max_bound": float(b.max()),
                "median_ratio": float(np.median(b) / eps),
                "max_ratio": float(b.max() / eps),
            }
        )
    return out


def curve_validity(fed, cfg, sim_seeds: int) -> list[dict]:
    """False violations of the three analyses on the exact white-box canary mechanism."""
    from accountants import Ledger, calibrate_noise_multiplier, dpsgd_event, ledger_curve
    from attacks.experiment import stream
    from privkit.audit.controls import method_recipe

    recipe, _, _ = method_recipe(fed, cfg)
    q, steps = recipe.sample_rate, recipe.steps
    out = []
    for target in EPSILONS:
        sigma = calibrate_noise_multiplier(target, DELTA, q, steps).noise_multiplier
        ledger = Ledger()
        ledger.add(0, dpsgd_event(q, sigma, steps), "dp-sgd")
        eps = ledger.epsilon(DELTA)
        curves = {"generic": "generic", "gaussian": "gaussian", "ledger": ledger_curve(ledger)}
        res = {k: [] for k in curves}
        for seed in range(sim_seeds):
            rng = stream(seed, "benchmark/simulation")
            inc = rng.random(M) < 0.5
            x = ((rng.random((steps, M)) < q) & inc) + sigma * rng.standard_normal((steps, M))
            lr = np.logaddexp(math.log1p(-q), math.log(q) + (x - 0.5) / sigma**2).sum(0)
            for k, c in curves.items():
                r = _audit(lr, inc, eps, seed, curve=c)
                res[k].append((r.epsilon_lower_bound, r.verdict == "violation"))
        for k, v in res.items():
            a = np.array(v)
            out.append(
                {
                    "epsilon": eps,
                    "curve": k,
                    "seeds": sim_seeds,
                    "false_violations": int(a[:, 1].sum()),
                    "median_bound": float(np.median(a[:, 0])),
                    "max_bound": float(a[:, 0].max()),
                }
            )
    return out


# ---------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--sim-seeds", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="2 seeds, 40 simulation seeds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.sim_seeds = 2, 40
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    fed, cfg = demo_setting()
    seeds = list(range(args.seeds))
    positives = [
        positive_non_private(fed, cfg, seeds, 20),
        positive_non_private(fed, cfg, seeds, 3),
        positive_noise_removed(fed, cfg, seeds),
    ]
    correct = [row for eps in EPSILONS for row in correct_dpsgd(fed, cfg, seeds, eps)]
    validity = curve_validity(fed, cfg, args.sim_seeds)
    out = {
        "setting": "privkit demo: mnist5k pooled (3200 records), dpsgd quick (CNN width 8, clip 1, "
        "lr 0.5, expected batch 128, 3 epochs, q 0.04, 75 steps), delta 1e-5, 95% one-run "
        f"bounds, {M} canaries / audited records per mode",
        "positive_controls": positives,
        "correct_dpsgd": correct,
        "curve_validity": validity,
        "published": PUBLISHED,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(out["setting"])
    print("\npositive controls (must be violation in >= 9 of 10)")
    for r in positives:
        print(
            f"  {r['row']:58s} {r['mode']:9s} violations {r['violations']}/{r['seeds']}  "
            f"bound median {r['median_bound']:.3f} min {r['min_bound']:.3f}"
        )
    print("\ncorrect DP-SGD (must be violation in none)")
    for r in correct:
        print(
            f"  {r['row']:26s} {r['mode']:20s} accounted {r['accounted_epsilon']:.3f} violations "
            f"{r['violations']}/{r['seeds']}  bound median {r['median_bound']:.3f} max {r['max_bound']:.3f}"
            f"  ratio median {r['median_ratio']:.3f} max {r['max_ratio']:.3f}"
        )
    print(
        "\ncurve validity on the exact white-box mechanism (false violations; the ledger curve's bound"
        "\nsits just below the claim whatever the evidence: not an estimate of tightness)"
    )
    for r in validity:
        print(
            f"  eps {r['epsilon']:.3f} {r['curve']:8s} {r['false_violations']}/{r['seeds']}  bound median "
            f"{r['median_bound']:.3f} max {r['max_bound']:.3f}"
        )
    print("\npublished figures")
    for p in PUBLISHED:
        ratio = p["empirical"] / p["epsilon"] if p.get("epsilon") and p.get("empirical") else None
        print(
            f"  {p['mode']:9s} eps {p['epsilon']} -> {p['empirical']} "
            f"(ratio {ratio:.3f})  {p['source']}"
            if ratio is not None
            else f"  {p['mode']:9s} {p.get('note', '')}  {p['source']}"
        )
    print(f"\n{out['seconds']} s")


if __name__ == "__main__":
    main()
