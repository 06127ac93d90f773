"""Power and validity of the conformance test's sampling, independence, distribution and
normalisation parts, as functions of the bug's size.

Each audit is simulated exactly as canary records in a user's loader observe a DP-SGD run
(:func:`attacks.validity.release_evidence`: ``--records`` records, 100 canaries, fair coins,
Gaussian noise on 64 or 256 witness coordinates), then :func:`attacks.conformance.conformance_test`
at 95% with all six statistical parts (each at 0.05/6). Per bug and size: the share of
``--seeds`` audits in which the part that names the bug rejects; for ``correct`` (the exact claim)
and for a sampler more private than claimed, the share of audits with any violation (at most 5%
up to the binomial error).

Bugs and their sizes: the real rate ``x`` the claimed (sampling: rate), one record in 20 drawn
``x`` times as often (sampling: heaviest), shuffled batches over ``T`` releases (sampling:
regularity), each release's noise correlated with the previous one's by ``rho`` (independence),
noise with Student-t tails of ``df`` degrees of freedom at the claimed variance (distribution),
releases divided by their realised batch size at expected batch ``q x records``
(normalisation).

Usage: ``python benchmarks/release_law_power.py [--seeds 200] [--json]``; writes
benchmarks/results/release_law_power.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from attacks.conformance import MechanismClaim, conformance_test
from attacks.validity import release_evidence

RESULTS = Path(__file__).resolve().parent / "results" / "release_law_power.json"
Q, SIGMA = 0.05, 1.2

#: (name, part that must reject, subtest or None, evidence options per size, the sizes)
BUGS = [
    ("rate x", "sampling", "rate", lambda v: {"q_real": Q * v}, (1.05, 1.1, 1.25, 1.5)),
    (
        "heavy record x",
        "sampling",
        "heaviest",
        lambda v: {"sampler": "weighted", "heavy": v},
        (1.5, 2.0, 3.0, 5.0),
    ),
    (
        "shuffled, releases",
        "sampling",
        "regularity",
        lambda v: {"sampler": "shuffle", "steps": int(v)},
        (10, 20, 60),
    ),
    (
        "noise correlation",
        "independence",
        None,
        lambda v: {"correlation": v},
        (0.02, 0.05, 0.1, 0.2),
    ),
    (
        "Student-t df",
        "distribution",
        None,
        lambda v: {"noise_law": "student", "df": v},
        (30.0, 10.0, 5.0, 3.0),
    ),
    (
        "by batch, expected batch",
        "normalisation",
        None,
        lambda v: {"by_batch": True, "records": int(v / Q)},
        (50, 200, 1000),
    ),
]


def _rate(rng, seeds: int, witness: int, options: dict, part: str | None, sub: str | None) -> float:
    steps = options.get("steps", 60)
    claim = MechanismClaim.repeated(Q, SIGMA, steps, 1.0)
    hits = 0
    for _ in range(seeds):
        res = conformance_test(release_evidence(rng, witness=witness, **options), claim)
        if part is None:
            hits += res.verdict == "violation"
        else:
            t = res.tests[part]
            hits += t.rejected and (sub is None or sub in t.failed)
    return hits / seeds


def run(seeds: int, progress: bool) -> dict:
    rng = np.random.default_rng(20261127)
    out: dict = {"schema_version": 1, "seeds": seeds, "q": Q, "sigma": SIGMA, "levels": {}}
    for witness in (64, 256):
        key = f"witness {witness}"
        row: dict = {
            "correct (any violation)": _rate(rng, seeds, witness, {}, None, None),
            "rate x0.5 (any violation)": _rate(rng, seeds, witness, {"q_real": Q / 2}, None, None),
        }
        for name, part, sub, make, sizes in BUGS:
            row[name] = {str(v): _rate(rng, seeds, witness, make(v), part, sub) for v in sizes}
            if progress:
                print(f"{key} {name}: {row[name]}", file=sys.stderr)
        out["levels"][key] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args.seeds, progress=not args.json)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2) if args.json else f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
