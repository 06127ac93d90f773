"""Accounting speed and tightness: privkit vs dp-accounting vs opacus, side by side in one run.

Three measurements, each next to its baseline in the same process tree:

1. **FedKADP ledger** (issue 14): the demo's FedKADP ledger (quickstart federation, quick config)
   accounted as the pipeline does (RDP and PLD per client on a 1e-3 grid, the worst client's
   RDP curve over rounds), once with privkit's vectorised accountants (``accountants.fast``) and
   once with dp-accounting's own accountants (what privkit used before); both give the same numbers.
2. **Calibration as a user runs it**: ``privkit budget calibrate`` as a subprocess (start-up
   included) against a Python process running opacus's
   ``get_noise_multiplier(accountant="prv")``, for epsilon=8, delta=1e-5, q=0.004, T=10^4; both
   sigmas re-checked with dp-accounting's PLD at a 1e-4 grid.
3. **Epsilon side by side** (human output only): privkit RDP/PLD vs dp-accounting vs opacus.

Run: ``python benchmarks/accounting.py [--json] [--fedkadp-ledger runs/quickstart/fedkadp/ledger.json]``
(without a ledger it trains FedKADP's quick configuration first, a few minutes on 2 cores; not run in CI).
Times are wall-clock seconds; ``cpu_s`` fields are process CPU seconds (the same work on a quiet
machine), and the load average is printed because the machines this runs on are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import dp_accounting as dpa

import accountants as acc
from accountants import fast
from accountants import ledger as ledger_module

DELTA = 1e-5
CAL = {"epsilon": 8.0, "delta": 1e-5, "sample_rate": 0.004, "steps": 10_000}
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- 1. FedKADP ledger
def fedkadp_ledger(path: str | None) -> Path:
    """The demo's FedKADP ledger: ``path`` if given, else FedKADP quick trained on the quickstart federation."""
    if path:
        return Path(path)
    from privkit.data import FederationConfig, build_federation
    from privkit.trainers import get_trainer, train

    out = Path(tempfile.mkdtemp(prefix="privkit-bench-")) / "ledger.json"
    fed = build_federation(
        FederationConfig(
            dataset="mnist5k",
            public_dataset="digits28",
            clients=20,
            partition="dirichlet",
            alpha=1.0,
            seed=0,
        )
    )
    print("training FedKADP (quick) for its ledger ...", file=sys.stderr)
    result = train("fedkadp", fed, get_trainer("fedkadp").quick_config(), seed=0)
    result.ledger.save(out)
    return out


def _account(path: Path) -> tuple[dict, list]:
    """What the pipeline's account stage computes for the demo (quickstart.toml settings)."""
    ledger = acc.Ledger.load(path)
    ledger.value_discretization_interval = 1e-3
    summary = ledger.summary(DELTA, accountants=["rdp", "pld"])
    curve = ledger.epsilon_over_rounds(DELTA, "rdp", client=summary["worst_client"]["best"])
    return summary["worst"], curve


def _clear_caches() -> None:
    ledger_module._CACHE.clear()
    for cached in (
        fast._base_pld,
        fast.poisson_gaussian_pld,
        fast._rdp_curve,
        fast._log_comb_table,
    ):
        cached.cache_clear()


def _plain_accountant(kind: str, relation: str = "add_remove", vdi: float = acc.PLD_VDI):
    rel = acc.neighbouring_relation(relation)
    if kind == "rdp":
        return dpa.rdp.RdpAccountant(neighboring_relation=rel)
    return dpa.pld.PLDAccountant(rel, value_discretization_interval=vdi)


def time_ledger(path: Path) -> dict:
    def run(plain: bool) -> tuple[float, float, dict]:
        _clear_caches()
        original = ledger_module.new_accountant
        if plain:
            ledger_module.new_accountant = _plain_accountant
        try:
            w, c = time.perf_counter(), time.process_time()
            worst, _ = _account(path)
            return time.perf_counter() - w, time.process_time() - c, worst
        finally:
            ledger_module.new_accountant = original

    run(False)  # warm-up: imports and scipy's first calls
    fast_s, fast_cpu, worst = run(False)
    plain_s, plain_cpu, worst_plain = run(True)
    if worst != worst_plain:
        raise AssertionError(
            f"vectorised and dp-accounting accountants disagree: {worst} vs {worst_plain}"
        )
    ledger = acc.Ledger.load(path)
    return {
        "fedkadp_ledger": str(path),
        "fedkadp_ledger_entries": len(ledger),
        "fedkadp_ledger_clients": len(ledger.clients),
        "fedkadp_ledger_s": fast_s,
        "fedkadp_ledger_cpu_s": fast_cpu,
        "fedkadp_ledger_dp_accounting_s": plain_s,
        "fedkadp_ledger_dp_accounting_cpu_s": plain_cpu,
        "fedkadp_ledger_speedup": plain_s / fast_s,
        "fedkadp_worst_epsilon": worst,
    }


# ----------------------------------------------------------------------------- 2. calibration
def _wall(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - t0, proc.stdout


def time_calibration(repeats: int) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    script = shutil.which("privkit", path=str(Path(sys.executable).parent)) or "privkit"
    ours = [
        script,
        "budget",
        "calibrate",
        "--epsilon",
        str(CAL["epsilon"]),
        "--delta",
        str(CAL["delta"]),
        "--sample-rate",
        str(CAL["sample_rate"]),
        "--steps",
        str(CAL["steps"]),
        "--json",
    ]
    theirs = [
        sys.executable,
        "-c",
        (
            "from opacus.accountants.utils import get_noise_multiplier; "
            f"print(get_noise_multiplier(target_epsilon={CAL['epsilon']}, target_delta={CAL['delta']}, "
            f"sample_rate={CAL['sample_rate']}, steps={CAL['steps']}, accountant='prv'))"
        ),
    ]
    our_runs = [_wall(ours, env) for _ in range(repeats)]
    their_runs = [_wall(theirs, env) for _ in range(repeats)]
    sigma_ours = json.loads(our_runs[0][1])["noise_multiplier"]
    sigma_opacus = float(their_runs[0][1].strip().splitlines()[-1])
    ours_s = statistics.median(t for t, _ in our_runs)
    theirs_s = statistics.median(t for t, _ in their_runs)
    return {
        "calibrate_cli_s": ours_s,
        "opacus_prv_calibrate_s": theirs_s,
        "calibrate_speedup": theirs_s / ours_s,
        "calibrate_repeats": repeats,
        "sigma_privkit": sigma_ours,
        "sigma_opacus_prv": sigma_opacus,
        "sigma_ratio": sigma_ours / sigma_opacus,
        "epsilon_pld_1e-4_privkit": _recheck(sigma_ours),
        "epsilon_pld_1e-4_opacus": _recheck(sigma_opacus),
    }


def _recheck(sigma: float) -> float:
    a = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    a.compose(acc.dpsgd_event(CAL["sample_rate"], sigma, CAL["steps"]))
    return float(a.get_epsilon(CAL["delta"]))


# ----------------------------------------------------------------------------- 3. epsilon side by side
def timed(fn: Callable[[], float], repeats: int) -> tuple[float, float]:
    """(value, median seconds) over ``repeats`` runs after one warm-up."""
    value = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return value, statistics.median(times)


def dpa_eps(kind: str, q: float, sigma: float, steps: int) -> float:
    a = _plain_accountant(kind)
    a.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    )
    return a.get_epsilon(DELTA)


def opacus_eps(kind: str, q: float, sigma: float, steps: int) -> float:
    from opacus.accountants import PRVAccountant, RDPAccountant

    a = RDPAccountant() if kind == "rdp" else PRVAccountant()
    a.history = [(sigma, q, steps)]
    return a.get_epsilon(delta=DELTA)


def side_by_side() -> None:
    q, sigma = 0.01, 1.0
    print(
        f"\nepsilon at delta={DELTA:g}, Poisson q={q}, sigma={sigma} (median of 3 after a warm-up)"
    )
    print(f"{'T':>7} | {'method':<26} | {'epsilon':>10} | {'time [s]':>9}")
    for steps in (1_000, 10_000, 100_000):
        _clear_caches()
        rows = [
            (
                "privkit rdp",
                lambda t=steps: acc.dpsgd_epsilon(q, sigma, t, DELTA, accountant="rdp"),
            ),
            (
                "privkit pld (1e-4)",
                lambda t=steps: acc.dpsgd_epsilon(q, sigma, t, DELTA, accountant="pld"),
            ),
            ("dp-accounting RDP", lambda t=steps: dpa_eps("rdp", q, sigma, t)),
            ("dp-accounting PLD 1e-4", lambda t=steps: dpa_eps("pld", q, sigma, t)),
            ("opacus rdp", lambda t=steps: opacus_eps("rdp", q, sigma, t)),
            ("opacus prv (eps_err 0.01)", lambda t=steps: opacus_eps("prv", q, sigma, t)),
        ]
        for name, fn in rows:
            eps, sec = timed(fn, 1 if steps == 100_000 and "prv" in name else 3)
            print(f"{steps:>7} | {name:<26} | {eps:>10.5f} | {sec:>9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--fedkadp-ledger", help="ledger.json of a FedKADP demo run (default: train one)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="calibration runs per side (median)")
    args = parser.parse_args()
    out = {"schema_version": 1, "load_average": os.getloadavg(), "cpus": os.cpu_count()}
    out.update(time_ledger(fedkadp_ledger(args.fedkadp_ledger)))
    out.update(time_calibration(args.repeats))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"FedKADP ledger ({out['fedkadp_ledger_entries']} entries, {out['fedkadp_ledger_clients']} clients): "
        f"{out['fedkadp_ledger_s']:.2f} s (CPU {out['fedkadp_ledger_cpu_s']:.2f} s) vs dp-accounting's accountants "
        f"{out['fedkadp_ledger_dp_accounting_s']:.2f} s: {out['fedkadp_ledger_speedup']:.1f}x"
    )
    print(
        f"calibration as run: privkit budget calibrate {out['calibrate_cli_s']:.2f} s (sigma {out['sigma_privkit']:.6f}) "
        f"vs opacus prv {out['opacus_prv_calibrate_s']:.2f} s (sigma {out['sigma_opacus_prv']:.6f}): "
        f"{out['calibrate_speedup']:.1f}x; load average {out['load_average'][0]:.1f}"
    )
    side_by_side()


if __name__ == "__main__":
    main()
