"""Validity and power of the white-box mechanism audit (conformance test + one-run bound).

Rows, each over ``--seeds`` independent audits:

* ``simulated``: probes at a Poisson-subsampled Gaussian mechanism (:func:`attacks.validity.probe_evidence`)
  tested with :func:`attacks.conformance.conformance_test` at 95%: exactly as claimed (three
  (q, sigma, steps) settings, with and without the other records' contribution known), more private
  than claimed (1.5x the noise, half the influence, half the sampling rate, fewer releases), and the
  bugs (noise x0.5, x0.8, x0.9, clipping off = influence x4, the sampling rate doubled, twice the
  releases). Valid rows must flag at most 5% (one-sided binomial test at 1% must not reject);
  bug rows report their catch rate.
* ``dp-sgd``: privkit's :class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep` training a small MLP with
  Dirac gradient canaries at the mechanism, audited with :meth:`attacks.whitebox.GradientCanaries.audit`
  (conformance + one-run bound with claim-optimised guesses, 95% together): correct, noise halved.
* ``permutation``: the probes listed in another order give identical p-values.

Usage: ``python benchmarks/mechanism_validity.py [--seeds 1000] [--dpsgd-seeds 200] [--json]``;
writes benchmarks/results/mechanism_validity.json. Exit status 1 if a validity row fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from scipy import stats

DELTA = 1e-5
RESULTS = Path(__file__).resolve().parent / "results" / "mechanism_validity.json"
SETTINGS = [
    {"q": 0.1, "sigma": 1.2, "steps": 40},
    {"q": 0.02, "sigma": 0.8, "steps": 200},
    {"q": 1.0, "sigma": 3.0, "steps": 5},
]
VALID = [
    ("exact claim", {}),
    ("exact claim, batch unknown", {"clean_known": False}),
    ("more noise (1.5x)", {"noise": 1.5}),
    ("less influence (0.5x)", {"influence": 0.5}),
    ("fewer releases than claimed", {"extra_claimed": 10}),
]
BUGS = [
    ("noise x0.5", {"noise": 0.5}),
    ("noise x0.8", {"noise": 0.8}),
    ("noise x0.9", {"noise": 0.9}),
    ("clipping off (influence x4)", {"influence": 4.0}),
    ("sampling rate x2", {"rate": 2.0}),
    ("ledger counts half the releases", {"claimed_fraction": 0.5}),
]


def simulated_row(name: str, setting: dict, change: dict, seeds: int, valid: bool) -> dict:
    from attacks.conformance import MechanismClaim, conformance_test
    from attacks.validity import probe_evidence

    rng = np.random.default_rng(zlib.crc32(f"{name}/{sorted(setting.items())}".encode()))
    q, sigma, steps = setting["q"], setting["sigma"], setting["steps"]
    claimed_steps = steps + change.get("extra_claimed", 0)
    claimed_steps = max(1, int(claimed_steps * change.get("claimed_fraction", 1.0)))
    claim = MechanismClaim.repeated(q, sigma, claimed_steps, 1.0)
    q_real = min(1.0, q * change.get("rate", 1.0)) if q < 1 else q
    kw = {k: v for k, v in change.items() if k in ("noise", "influence", "clean_known")}
    flagged = 0
    for _ in range(seeds):
        ev = probe_evidence(rng, steps=steps, q=q, sigma=sigma, q_real=q_real, **kw)
        flagged += conformance_test(ev, claim).verdict == "violation"
    row = {
        "kind": "simulated",
        "row": name,
        **setting,
        "seeds": seeds,
        "flagged": flagged,
        "rate": flagged / seeds,
        "valid_row": valid,
    }
    if valid:
        row["binom_p"] = float(stats.binomtest(flagged, seeds, 0.05, alternative="greater").pvalue)
        row["pass"] = row["binom_p"] > 0.01
    return row


def dpsgd_row(sigma_real: float, seeds: int) -> dict:
    import torch
    import torch.nn.functional as F

    from attacks.whitebox import GradientCanaries
    from privkit.mechanisms.dp_sgd_step import DpSgdStep

    torch.set_num_threads(1)
    flagged, conf_flagged, bounds = 0, 0, []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(400, 12, generator=g)
        y = (x[:, 0] > 0).long()
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)
        )
        step = DpSgdStep(1.0, sigma_real, 0.05, 400)
        can = GradientCanaries.for_parameters(
            list(model.parameters()),
            500,
            clip_norm=1.0,
            sample_rate=0.05,
            noise_multiplier=1.0,
            steps=60,
            seed=seed,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(60):
            b = step.sample(g)
            step.apply(
                model, opt, x[b], y[b], lambda z, t, _: F.cross_entropy(z, t), g, canaries=can
            )
        res = can.audit(delta=DELTA)
        flagged += res.verdict == "violation"
        conf_flagged += res.conformance.verdict == "violation"
        bounds.append(res.epsilon_lower_bound)
    valid = sigma_real >= 1.0
    row = {
        "kind": "dp-sgd",
        "row": f"DpSgdStep, noise {sigma_real:g} claiming 1 (q 0.05, 60 steps, 500 canaries)",
        "seeds": seeds,
        "flagged": flagged,
        "rate": flagged / seeds,
        "conformance_flagged": conf_flagged,
        "median_one_run_bound": float(np.median(bounds)),
        "valid_row": valid,
    }
    if valid:
        row["binom_p"] = float(stats.binomtest(flagged, seeds, 0.05, alternative="greater").pvalue)
        row["pass"] = row["binom_p"] > 0.01
    return row


def permutation_row(seeds: int) -> dict:
    from attacks.conformance import MechanismClaim, ProbeEvidence, conformance_test
    from attacks.validity import probe_evidence

    rng = np.random.default_rng(7)
    claim = MechanismClaim.repeated(0.1, 1.2, 40, 1.0)
    worst = 0.0
    for _ in range(seeds):
        ev = probe_evidence(rng, noise=0.95)
        perm = rng.permutation(ev.m)
        sh = ProbeEvidence(
            ev.projections[:, perm], ev.included[perm], ev.noise_squares, ev.noise_coordinates, True
        )
        a, b = conformance_test(ev, claim), conformance_test(sh, claim)
        worst = max(worst, max(abs(a.tests[n].p_value - b.tests[n].p_value) for n in a.tests))
    return {
        "kind": "permutation",
        "row": "probes permuted",
        "seeds": seeds,
        "max_p_difference": worst,
        "valid_row": True,
        "pass": worst < 1e-9,
    }


def markdown(rows: list[dict]) -> str:
    out = [
        "| kind | row | setting | seeds | flagged | rate | binom p (rate <= 5%) | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        setting = f"q {r['q']}, sigma {r['sigma']}, {r['steps']} steps" if "q" in r else ""
        p = f"{r['binom_p']:.3g}" if "binom_p" in r else "-"
        rate = (
            f"{r['rate']:.3f}" if "rate" in r else f"max p difference {r['max_p_difference']:.1e}"
        )
        out.append(
            f"| {r['kind']} | {r['row']} | {setting} | {r['seeds']} | {r.get('flagged', '-')} | {rate} | "
            f"{p} | {'yes' if r.get('pass', True) else 'NO'} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--dpsgd-seeds", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.seeds < 10 or args.dpsgd_seeds < 1:
        print(
            f"--seeds must be >= 10 and --dpsgd-seeds >= 1; found {args.seeds}, {args.dpsgd_seeds}",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    rows = [simulated_row(n, s, c, args.seeds, True) for s in SETTINGS for n, c in VALID]
    # doubling the sampling rate is no bug where the claimed rate is already 1
    rows += [
        simulated_row(n, s, c, args.seeds // 10, False)
        for s in SETTINGS
        for n, c in BUGS
        if not ("rate" in c and s["q"] * c["rate"] > 1)
    ]
    rows += [
        dpsgd_row(1.0, args.dpsgd_seeds),
        dpsgd_row(0.5, max(10, args.dpsgd_seeds // 10)),
        permutation_row(100),
    ]
    result = {
        "schema_version": 1,
        "benchmark": "mechanism_validity",
        "confidence": 0.95,
        "delta": DELTA,
        "wall_seconds": time.perf_counter() - t0,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result) if args.json else markdown(rows))
    return 0 if all(r.get("pass", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
