"""Validity of privkit's audit verdict (issue 11): false VIOLATION rates on mechanisms with a known
epsilon, permutation invariance, and power on positive controls.

Each row audits ``--seeds`` independent releases (every record included by a fair coin, m records,
k+ = k- = 10% of them) with :func:`attacks.audit_scores` against a claim that is TRUE for the
null models (claim 0), randomised response (claim = its epsilon; ties everywhere) and the Gaussian
mechanism (claim = its (epsilon, delta)), once with the records listed members first and once in
random order. A row passes when, in both orders, the one-sided binomial test of "false-violation
rate <= 1 - confidence" does not reject at the 1% level, and the two orders' bound distributions do
not differ (two-sample Kolmogorov-Smirnov p > 0.01). Controls: a non-private release (the
membership bit itself) and randomised response at epsilon 4 claiming 1 must be flagged; RR at the
detectable epsilon must be flagged at least half the time. Run:

    PYTHONPATH=. python benchmarks/audit_validity.py [--seeds 200] [--m 1000] [--json]

The exit status is 1 if any row fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from scipy import stats

from attacks.validity import permutation_test, simulate

ALPHA_TEST = 0.01  # level of the binomial and KS tests that decide pass/fail

VALID = [  # (scenario, true epsilon, delta, claim)
    ("constant", 0.0, 0.0, 0.0),
    ("independent", 0.0, 0.0, 0.0),
    ("rr", 0.5, 0.0, 0.5),
    ("rr", 1.0, 0.0, 1.0),
    ("rr", 2.0, 0.0, 2.0),
    ("gaussian", 1.0, 1e-5, 1.0),
    ("gaussian", 2.0, 1e-5, 2.0),
    ("gaussian", 4.0, 1e-5, 4.0),
]
CONTROLS = [  # (scenario, true epsilon, delta, claim): claims that are false
    ("exact", float("inf"), 0.0, 1.0),
    ("rr", 4.0, 0.0, 1.0),
]


def _valid_row(scenario, eps, delta, claim, k, args) -> dict:
    kw = dict(
        epsilon=eps if eps != float("inf") else 0.0,
        delta=delta,
        claim=claim,
        m=args.m,
        n_attacks=k,
        seeds=args.seeds,
        confidence=args.confidence,
    )
    first = simulate(scenario, order="members-first", **kw)
    shuffled = simulate(scenario, order="shuffled", **kw)
    ks = permutation_test(first, shuffled)
    ok = min(first.p_value, shuffled.p_value) > ALPHA_TEST and ks > ALPHA_TEST
    return {
        "kind": "validity",
        "scenario": scenario,
        "epsilon": eps,
        "delta": delta,
        "claim": claim,
        "attacks": k,
        "seeds": args.seeds,
        "violations_members_first": first.violations,
        "violations_shuffled": shuffled.violations,
        "rate": (first.violations + shuffled.violations) / (2 * args.seeds),
        "rate_upper": max(first.rate_upper, shuffled.rate_upper),
        "binomial_p": min(first.p_value, shuffled.p_value),
        "median_bound_members_first": first.median_bound,
        "median_bound_shuffled": shuffled.median_bound,
        "ks_p": ks,
        "ceiling": shuffled.mean_ceiling,
        "detectable": shuffled.detectable_epsilon,
        "pass": bool(ok),
    }


def _control_row(scenario, eps, delta, claim, k, args) -> dict:
    res = simulate(
        scenario,
        epsilon=0.0 if eps == float("inf") else eps,
        delta=delta,
        claim=claim,
        m=args.m,
        n_attacks=k,
        seeds=args.seeds,
        confidence=args.confidence,
    )
    return {
        "kind": "power",
        "scenario": scenario,
        "epsilon": eps,
        "delta": delta,
        "claim": claim,
        "attacks": k,
        "seeds": args.seeds,
        "violations_shuffled": res.violations,
        "rate": res.rate,
        "median_bound_shuffled": res.median_bound,
        "ceiling": res.mean_ceiling,
        "detectable": res.detectable_epsilon,
        "pass": bool(res.rate >= 0.9),
    }


def _detectable_row(claim, k, args) -> dict:
    """RR at the detectable epsilon for ``claim``: flagged at least half of the time."""
    d = simulate(
        "rr", epsilon=claim, claim=claim, m=args.m, n_attacks=k, seeds=1, confidence=args.confidence
    ).detectable_epsilon
    res = simulate(
        "rr",
        epsilon=d + 1e-6,
        claim=claim,
        m=args.m,
        n_attacks=k,
        seeds=args.seeds,
        confidence=args.confidence,
    )
    p = float(stats.binomtest(res.violations, args.seeds, 0.5, alternative="less").pvalue)
    return {
        "kind": "detectable",
        "scenario": "rr",
        "epsilon": d,
        "delta": 0.0,
        "claim": claim,
        "attacks": k,
        "seeds": args.seeds,
        "violations_shuffled": res.violations,
        "rate": res.rate,
        "binomial_p": p,
        "median_bound_shuffled": res.median_bound,
        "ceiling": res.mean_ceiling,
        "detectable": d,
        "pass": bool(p > ALPHA_TEST),
    }


def _f(x, fmt="{:.3f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x == float("inf"):
        return "inf"
    return fmt.format(x)


def table(rows: list[dict], args) -> str:
    head = (
        "| kind | scenario | true eps | claim | attacks | false/true viol. (members-first, shuffled) "
        "| rate | 95% upper | binom p | median bound (mf, sh) | KS p | ceiling | detectable | pass |"
    )
    lines = [
        f"audit validity: m={args.m} records, k+ = k- = 10%, {args.seeds} seeds per order, "
        f"confidence {args.confidence:g} for the family",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        viol = f"{r.get('violations_members_first', '-')}, {r['violations_shuffled']}"
        med = f"{_f(r.get('median_bound_members_first'))}, {_f(r['median_bound_shuffled'])}"
        lines.append(
            f"| {r['kind']} | {r['scenario']} | {_f(r['epsilon'], '{:g}')} | {r['claim']:g} | "
            f"{r['attacks']} | {viol} | {r['rate']:.3f} | {_f(r.get('rate_upper'))} | "
            f"{_f(r.get('binomial_p'), '{:.3g}')} | {med} | {_f(r.get('ks_p'), '{:.3g}')} | "
            f"{_f(r['ceiling'])} | {_f(r['detectable'])} | {'yes' if r['pass'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=200, help="audits per row and order (default 200)")
    ap.add_argument(
        "--m", type=int, default=1000, help="records audited per release (default 1000)"
    )
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = ap.parse_args()
    if args.seeds < 1 or args.m < 20:
        print(
            f"error: --seeds must be >= 1 and --m >= 20; found {args.seeds} and {args.m}",
            file=sys.stderr,
        )
        return 2
    jobs = (
        [(_valid_row, c, k) for c in VALID for k in (1, 4)]
        + [(_control_row, c, k) for c in CONTROLS for k in (1, 4)]
        + [(_detectable_row, (1.0,), k) for k in (1, 4)]
    )
    rows, t0 = [], time.perf_counter()
    for i, (fn, case, k) in enumerate(jobs, 1):
        rows.append(fn(*case, k, args))
        r = rows[-1]
        print(
            f"[{i}/{len(jobs)}] {r['kind']} {r['scenario']} eps={r['epsilon']:g} x{k}: rate {r['rate']:.3f} "
            f"({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        out = {
            "schema_version": 1,
            "benchmark": "audit_validity",
            "m": args.m,
            "seeds": args.seeds,
            "confidence": args.confidence,
            "guesses": 0.1,
            "test_level": ALPHA_TEST,
            "rows": rows,
            "seconds": time.perf_counter() - t0,
        }
        print(json.dumps(out, indent=2, default=lambda x: None if x == float("inf") else x))
    else:
        print(table(rows, args))
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
