"""Validity and power of one-run audit analyses against the curve each one assumes (long version).

Mechanisms with a known curve, each audit point included by a fair coin:

* randomized response on the membership bit, exactly eps-DP (each guess right w.p. e^eps/(1+e^eps));
* a Gaussian mechanism that is exactly (eps, delta)-DP per audit point (scores ``b + sigma N(0,1)``,
  guesses on the k highest and k lowest scores).

For each, the rate at which three analyses call the *true* claim a violation (bound > true eps):
Steinke et al.'s bound, the f-DP analysis with the generic (eps, delta)-DP curve, and the f-DP
analysis with the Gaussian curve.  Randomized-response rates are exact (binomial tails at the
analysis' rejection threshold) and also counted over seeds; Gaussian-mechanism rates are counted
over seeds, with a binomial 95% upper limit.  A valid analysis stays at or below 5%; the Gaussian
curve is valid only for the Gaussian mechanism.  Also printed: the published figures (1000 and 2000
right guesses of as many, delta 1e-5).

Usage: ``python benchmarks/fdp_validity.py [--seeds 1000] [--json]``  (about a minute at 1000 seeds)
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from scipy import stats
from scipy.special import expit

from accountants import analytic_gaussian_sigma
from accountants.tradeoff import CurveFamily
from attacks.one_run import epsilon_lower_bound as steinke_bound
from attacks.one_run import p_value
from attacks.one_run_fdp import fdp_epsilon_lower_bound, fdp_rejection_threshold, fdp_rejects

DELTA, BETA = 1e-5, 0.05
ANALYSES = ("steinke", "fdp-generic", "fdp-gaussian")


def _rejects(analysis: str, m: int, r: int, v: int, eps: float) -> bool:
    if analysis == "steinke":
        return p_value(m, r, v, eps, DELTA) < BETA
    return bool(
        fdp_rejects(m, r, v, CurveFamily(analysis.split("-")[1], DELTA), [eps], beta=BETA)[0]
    )


def _threshold(analysis: str, m: int, r: int, eps: float) -> int:
    if analysis != "steinke":
        return fdp_rejection_threshold(
            m, r, eps, delta=DELTA, curve=analysis.split("-")[1], beta=BETA
        )
    lo, hi = 0, r + 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _rejects("steinke", m, r, mid, eps) else (mid + 1, hi)
    return lo


def _upper(count: int, n: int) -> float:
    """Clopper-Pearson 95% upper limit of a rate."""
    return 1.0 if count == n else float(stats.beta.ppf(0.95, count + 1, n - count))


def randomized_response(seeds: int) -> list[dict]:
    rows = []
    for eps in (0.5, 1.0, 2.0):
        for m, r in ((1000, 1000), (1000, 100), (200, 200)):
            q = expit(eps)
            outcomes = [int(np.random.default_rng(s).binomial(r, q)) for s in range(seeds)]
            for a in ANALYSES:
                v_star = _threshold(a, m, r, eps)
                hits = sum(v >= v_star for v in outcomes)  # rejection is monotone in v
                rows.append(
                    {
                        "mechanism": "randomized response",
                        "epsilon": eps,
                        "m": m,
                        "guesses": r,
                        "analysis": a,
                        "exact_rate": float(stats.binom.sf(v_star - 1, r, q)),
                        "seeded_rate": hits / seeds,
                        "seeded_upper95": _upper(hits, seeds),
                    }
                )
    return rows


def gaussian_mechanism(seeds: int) -> list[dict]:
    rows = []
    for eps in (1.0, 4.0, 8.0):
        sigma = analytic_gaussian_sigma(eps, DELTA)
        for m, k in ((1000, 20), (1000, 100), (100, 50)):
            outcomes = []
            for s in range(seeds):
                rng = np.random.default_rng(s)
                b = rng.random(m) < 0.5
                order = np.argsort(-(b + sigma * rng.standard_normal(m)))
                outcomes.append(int(b[order[:k]].sum() + (~b[order[m - k :]]).sum()))
            for a in ANALYSES:
                v_star = _threshold(a, m, 2 * k, eps)
                hits = sum(v >= v_star for v in outcomes)
                rows.append(
                    {
                        "mechanism": "gaussian",
                        "epsilon": eps,
                        "m": m,
                        "guesses": 2 * k,
                        "analysis": a,
                        "exact_rate": None,
                        "seeded_rate": hits / seeds,
                        "seeded_upper95": _upper(hits, seeds),
                    }
                )
    return rows


def figures() -> list[dict]:
    out = []
    for n in (1000, 2000):
        out.append(
            {
                "m": n,
                "guesses": n,
                "correct": n,
                "delta": DELTA,
                "steinke": steinke_bound(n, n, n, delta=DELTA, beta=BETA),
                "fdp_generic": fdp_epsilon_lower_bound(n, n, n, delta=DELTA, beta=BETA),
                "fdp_gaussian": fdp_epsilon_lower_bound(
                    n, n, n, delta=DELTA, curve="gaussian", beta=BETA
                ),
            }
        )
    return out


def table(result: dict) -> str:
    lines = [
        f"False-violation rates (true claim called a violation), beta={BETA}, delta={DELTA:g}, "
        f"{result['seeds']} seeds",
        "| mechanism | eps | m | guesses | analysis | exact | seeded | seeded 95% upper |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        exact = "-" if row["exact_rate"] is None else f"{row['exact_rate']:.3f}"
        lines.append(
            f"| {row['mechanism']} | {row['epsilon']:g} | {row['m']} | {row['guesses']} | "
            f"{row['analysis']} | {exact} | {row['seeded_rate']:.3f} | {row['seeded_upper95']:.3f} |"
        )
    lines += [
        "",
        "Bounds when every guess is right:",
        "| m = guesses | Steinke et al. | f-DP generic | f-DP Gaussian |",
        "|---|---|---|---|",
    ]
    for f in result["figures"]:
        lines.append(
            f"| {f['m']} | {f['steinke']:.3f} | {f['fdp_generic']:.3f} | {f['fdp_gaussian']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of a table"
    )
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error(f"--seeds must be >= 1; found {args.seeds}")
    result = {
        "schema_version": 1,
        "seeds": args.seeds,
        "rows": randomized_response(args.seeds) + gaussian_mechanism(args.seeds),
        "figures": figures(),
    }
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
