"""Accounting speed and tightness: privkit vs dp-accounting vs opacus, side by side in one run.

Part 1: epsilon at delta=1e-5 for Poisson-subsampled Gaussian, q=0.01, sigma=1, T in {1e3, 1e4, 1e5}.
Part 2: calibration for epsilon=8, delta=1e-5, q=0.004, T=1e4: privkit calibrate_noise_multiplier
(PLD) vs opacus get_noise_multiplier(accountant="prv") and ("rdp"); every sigma is re-checked with
dp-accounting PLD at value_discretization_interval=1e-4.

Run: .venv/bin/python benchmarks/accounting.py   (about 1-2 minutes; not run in CI)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import dp_accounting as dpa

import accountants as acc

DELTA = 1e-5


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
    ev = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    a = dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    a.compose(ev)
    return a.get_epsilon(DELTA)


def opacus_eps(kind: str, q: float, sigma: float, steps: int) -> float:
    from opacus.accountants import PRVAccountant, RDPAccountant

    a = RDPAccountant() if kind == "rdp" else PRVAccountant()
    a.history = [(sigma, q, steps)]
    return a.get_epsilon(delta=DELTA)


def part1() -> None:
    q, sigma = 0.01, 1.0
    print(f"Part 1: epsilon at delta={DELTA:g}, Poisson q={q}, sigma={sigma} (median time of 3 after warm-up)")
    header = f"{'T':>7} | {'method':<26} | {'epsilon':>10} | {'time [s]':>9} | {'privkit time / this':>19}"
    print(header)
    print("-" * len(header))
    for steps in (1_000, 10_000, 100_000):
        rows = [
            ("privkit rdp", lambda: acc.dpsgd_epsilon(q, sigma, steps, DELTA, accountant="rdp"), 3),
            ("privkit pld (vdi 1e-4)", lambda: acc.dpsgd_epsilon(q, sigma, steps, DELTA, accountant="pld"), 3),
            ("dp-accounting RDP", lambda: dpa_eps("rdp", q, sigma, steps), 3),
            ("dp-accounting PLD 1e-4", lambda: dpa_eps("pld", q, sigma, steps), 3),
            ("opacus rdp", lambda: opacus_eps("rdp", q, sigma, steps), 3),
            ("opacus prv (eps_err 0.01)", lambda: opacus_eps("prv", q, sigma, steps), 1 if steps == 100_000 else 3),
        ]
        results = [(name, *timed(fn, rep)) for name, fn, rep in rows]
        privkit_pld_time = results[1][2]
        privkit_rdp_time = results[0][2]
        for name, eps, sec in results:
            ref = privkit_rdp_time if "rdp" in name.lower() else privkit_pld_time
            print(f"{steps:>7} | {name:<26} | {eps:>10.5f} | {sec:>9.3f} | {ref / sec:>19.2f}")
        print("-" * len(header))


def part2() -> None:
    from opacus.accountants.utils import get_noise_multiplier

    eps, q, steps = 8.0, 0.004, 10_000
    print(f"\nPart 2: calibration epsilon={eps}, delta={DELTA:g}, q={q}, T={steps} (one run each)")

    def recheck(sigma: float) -> float:
        a = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
        a.compose(acc.dpsgd_event(q, sigma, steps))
        return a.get_epsilon(DELTA)

    runs = []
    t0 = time.perf_counter()
    cal = acc.calibrate_noise_multiplier(eps, DELTA, q, steps)
    runs.append(("privkit calibrate (pld)", cal.noise_multiplier, time.perf_counter() - t0))
    t0 = time.perf_counter()
    cal_rdp = acc.calibrate_noise_multiplier(eps, DELTA, q, steps, accountant="rdp")
    runs.append(("privkit calibrate (rdp)", cal_rdp.noise_multiplier, time.perf_counter() - t0))
    for kind in ("prv", "rdp"):
        t0 = time.perf_counter()
        sigma = get_noise_multiplier(target_epsilon=eps, target_delta=DELTA, sample_rate=q, steps=steps, accountant=kind)
        runs.append((f"opacus get_noise_multiplier {kind}", sigma, time.perf_counter() - t0))
    header = f"{'method':<34} | {'sigma':>9} | {'eps PLD 1e-4':>12} | {'time [s]':>9}"
    print(header)
    print("-" * len(header))
    for name, sigma, sec in runs:
        print(f"{name:<34} | {sigma:>9.6f} | {recheck(sigma):>12.5f} | {sec:>9.2f}")
    p, prv = runs[0], runs[2]
    print(f"privkit (pld) vs opacus prv: {prv[2] / p[2]:.1f}x faster, sigma ratio {p[1] / prv[1]:.5f} "
          f"(privkit's epsilon re-checked <= target: {cal.epsilon:.5f} <= {eps})")


if __name__ == "__main__":
    part1()
    part2()
