"""``privkit budget``: privacy budgets of mechanisms, compositions and ledgers (package ``accountants``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from privkit.cli.app import app, lazy_module, out_console, print_json

# imported on first use: `privkit --help` and usage errors never load dp-accounting (and scipy)
acc = lazy_module("accountants")
dpa = lazy_module("dp_accounting")

budget_app = typer.Typer(help="Privacy budgets: mechanisms, composition, calibration, ledgers.", no_args_is_help=True)
sensitivity_app = typer.Typer(help="L2 sensitivities of privatised models.", no_args_is_help=True)
app.add_typer(budget_app, name="budget")
budget_app.add_typer(sensitivity_app, name="sensitivity")

JSON_OPT = typer.Option(False, "--json", help="Print one JSON object.")
PROFILE_EPSILONS = (0.0, 0.1, 0.5, 1.0, 2.0, 5.0)


def _show(data: dict[str, Any], title: str) -> None:
    """Human-readable output: one table of scalar keys, then warnings."""
    table = Table(title=title, show_header=False)
    table.add_column("key")
    table.add_column("value")
    for key, value in data.items():
        if key == "warnings":
            continue
        if isinstance(value, float):
            value = f"{value:.6g}"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        table.add_row(key, str(value))
    out_console.print(table)
    for w in data.get("warnings", []):
        out_console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)


def _emit(data: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        print_json(data)
    else:
        _show(data, title)


@budget_app.command("gaussian")
def gaussian(
    delta: float = typer.Option(..., "--delta", help="Target delta in (0, 1)."),
    sigma: Optional[float] = typer.Option(None, "--sigma", help="Noise std (gives epsilons)."),
    epsilon: Optional[float] = typer.Option(None, "--epsilon", help="Target epsilon (gives sigmas)."),
    sensitivity: float = typer.Option(1.0, "--sensitivity", help="L2 sensitivity."),
    as_json: bool = JSON_OPT,
) -> None:
    """Gaussian mechanism: classic (epsilon < 1 only) and analytic calibration side by side."""
    if (sigma is None) == (epsilon is None):
        raise ValueError("give exactly one of --sigma or --epsilon; found "
                         + ("both" if sigma is not None else "neither"))
    out: dict[str, Any] = {"delta": delta, "sensitivity": sensitivity}
    if epsilon is not None:
        cal = acc.calibrate_gaussian(epsilon, delta, sensitivity, method="classic")
        out.update(epsilon=epsilon, classic_sigma=cal.classic_sigma, analytic_sigma=cal.analytic_sigma,
                   ratio=cal.ratio, warnings=list(cal.warnings))
    else:
        classic = acc.gaussian_epsilon(sigma, delta, sensitivity, method="classic")
        analytic = acc.gaussian_epsilon(sigma, delta, sensitivity, method="analytic")
        warns = []
        if classic >= 1:
            warns.append(f"classic_epsilon={classic:.4g} >= 1: the classic formula is proven only for "
                         "epsilon < 1; analytic_epsilon is the exact value")
        out.update(sigma=sigma, classic_epsilon=classic, analytic_epsilon=analytic,
                   ratio=classic / analytic if analytic > 0 else math.inf, warnings=warns)
    _emit(out, as_json, "Gaussian mechanism")


@budget_app.command("nfdp")
def nfdp(
    n: int = typer.Option(..., "--n", help="Client dataset size."),
    k: int = typer.Option(..., "--k", help="Subsample size."),
    replacement: bool = typer.Option(..., "--replacement/--no-replacement", help="Sampling with or without replacement."),
    as_json: bool = JSON_OPT,
) -> None:
    """FedMD-NFDP subsampling: the theorem's (epsilon, delta) and the exact privacy profile."""
    eps, delta = acc.nfdp_epsilon_delta(n, k, replacement)
    grid = sorted(set(PROFILE_EPSILONS) | {eps})
    profile = acc.nfdp_profile(n, k, replacement, grid)
    out = {
        "n": n, "k": k, "replacement": replacement,
        "theorem": "FedMD-NFDP Theorem 2 (with replacement)" if replacement else "FedMD-NFDP Theorem 1 (without replacement)",
        "epsilon": eps, "delta": delta,
        "neighbouring": "add_remove",
        "profile": [{"epsilon": e, "delta": float(d)} for e, d in zip(grid, profile)],
        "warnings": list(acc.nfdp_warnings(n, k, replacement)),
    }
    _emit(out, as_json, "NFDP subsampling")


@budget_app.command("dpsgd")
def dpsgd(
    sample_rate: float = typer.Option(..., "--sample-rate", help="Sampling rate q (batch / dataset)."),
    noise_multiplier: float = typer.Option(..., "--noise-multiplier", help="Noise std / clipping norm."),
    steps: int = typer.Option(..., "--steps", help="Number of steps."),
    delta: float = typer.Option(..., "--delta", help="Target delta in (0, 1)."),
    sampling: str = typer.Option("poisson", "--sampling", help="poisson | without-replacement"),
    accountant: str = typer.Option("pld", "--accountant", help="rdp | pld | prv | all"),
    dataset_size: Optional[int] = typer.Option(None, "--dataset-size", help="N for sampling without replacement."),
    as_json: bool = JSON_OPT,
) -> None:
    """Epsilon of subsampled-Gaussian steps (DP-SGD, DP-FedAvg, FedKADP)."""
    if accountant == "all":
        names = ["rdp"] if sampling == "without-replacement" else ["rdp", "pld", "prv"]
    else:
        names = [accountant]
    results = {
        name: acc.dpsgd_accounting(sample_rate, noise_multiplier, steps, delta, sampling, name,
                                   dataset_size=dataset_size)
        for name in names
    }
    first = next(iter(results.values()))
    warns = list(first.warnings)
    if accountant == "all" and sampling == "without-replacement":
        warns.append("pld and prv do not support sampling without replacement; only rdp is shown")
    out = {
        "sample_rate": sample_rate, "noise_multiplier": noise_multiplier, "steps": steps, "delta": delta,
        "sampling": sampling, "neighbouring": first.neighbouring,
        "accountant": accountant,
        "epsilon": {k: r.epsilon for k, r in results.items()} if accountant == "all" else first.epsilon,
        "warnings": warns,
    }
    _emit(out, as_json, "DP-SGD (subsampled Gaussian)")


@budget_app.command("calibrate")
def calibrate(
    epsilon: float = typer.Option(..., "--epsilon", help="Target epsilon."),
    delta: float = typer.Option(..., "--delta", help="Target delta in (0, 1)."),
    sample_rate: float = typer.Option(..., "--sample-rate", help="Sampling rate q."),
    steps: int = typer.Option(..., "--steps", help="Number of steps."),
    sampling: str = typer.Option("poisson", "--sampling", help="poisson | without-replacement"),
    accountant: str = typer.Option("pld", "--accountant", help="pld | rdp"),
    as_json: bool = JSON_OPT,
) -> None:
    """Smallest noise multiplier meeting (epsilon, delta); the returned epsilon is re-checked <= target."""
    cal = acc.calibrate_noise_multiplier(epsilon, delta, sample_rate, steps, sampling, accountant)
    out = {
        "noise_multiplier": cal.noise_multiplier, "epsilon": cal.epsilon, "target_epsilon": cal.target_epsilon,
        "delta": cal.delta, "sample_rate": cal.sample_rate, "steps": cal.steps, "sampling": cal.sampling,
        "accountant": cal.accountant, "neighbouring": cal.neighbouring,
        "value_discretization_interval": cal.value_discretization_interval,
        "warnings": list(cal.warnings),
    }
    _emit(out, as_json, "noise calibration")


@sensitivity_app.command("logreg")
def logreg(
    n: int = typer.Option(..., "--n", help="Examples the ERM is solved on."),
    lam: float = typer.Option(..., "--lambda", help="L2 regularisation strength."),
    classes: Optional[int] = typer.Option(None, "--classes", help="Number of classes C (multinomial)."),
    as_json: bool = JSON_OPT,
) -> None:
    """L2 sensitivity of L2-regularised logistic regression (features with norm <= 1, replace-one)."""
    out: dict[str, Any] = {"n": n, "lambda": lam, "neighbouring": "replace_one",
                           "binary": acc.logreg_binary_sensitivity(n, lam)}
    if classes is not None:
        out["classes"] = classes
        out["multinomial"] = acc.logreg_multinomial_sensitivity(n, lam, classes)
        out["multinomial_cfree"] = acc.logreg_multinomial_sensitivity_cfree(n, lam)
    out["warnings"] = ["assumes every feature vector has L2 norm <= 1 (project each onto the unit ball; "
                       "scaling by the max norm over private data is data-dependent)"]
    _emit(out, as_json, "logistic-regression sensitivity")


def _parse_floats(text: str, option: str, parts: tuple[int, int]) -> list[str]:
    items = text.split(":")
    if not parts[0] <= len(items) <= parts[1]:
        raise ValueError(f"{option} must look like EPS:DELTA[:METHOD]; found {text!r}")
    return items


def _to_float(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number; found {text!r}") from None


def _releases_from(gaussian: list[float], gaussian_eps: list[str], eps_delta: list[str],
                   file: Optional[Path]) -> list[dict[str, Any]]:
    releases: list[dict[str, Any]] = [{"gaussian": g} for g in gaussian]
    for text in gaussian_eps:
        items = _parse_floats(text, "--gaussian-eps", (2, 3))
        releases.append({"gaussian_eps": [_to_float(items[0], "epsilon"), _to_float(items[1], "delta"),
                                          items[2] if len(items) == 3 else "classic"]})
    for text in eps_delta:
        items = _parse_floats(text, "--eps-delta", (2, 2))
        releases.append({"epsilon": _to_float(items[0], "epsilon"), "delta": _to_float(items[1], "delta")})
    if file is not None:
        if not file.is_file():
            raise FileNotFoundError(f"compose file not found: {file}")
        data = json.loads(file.read_text())
        items = data.get("releases") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ValueError(f"compose file must hold a list of releases (or {{'releases': [...]}}); found {type(items).__name__}")
        releases.extend(items)
    if not releases:
        raise ValueError("give at least one release (--gaussian, --gaussian-eps, --eps-delta or --file); found none")
    return releases


def _event_of(release: dict[str, Any]) -> tuple[dpa.DpEvent, tuple[float, float] | None, str]:
    """(event, nominal (eps, delta) or None, description) of one release record."""
    if "gaussian" in release:
        sigma = float(release["gaussian"])
        if not sigma > 0 or math.isinf(sigma):
            raise ValueError(f"gaussian noise multiplier must be a positive finite number; found {sigma!r}")
        return dpa.GaussianDpEvent(sigma), None, f"Gaussian, sigma/sensitivity={sigma:g}"
    if "gaussian_eps" in release:
        eps, delta, method = release["gaussian_eps"]
        cal = acc.calibrate_gaussian(float(eps), float(delta), 1.0, method=str(method))
        return (dpa.GaussianDpEvent(cal.sigma), (float(eps), float(delta)),
                f"Gaussian calibrated ({method}) for ({eps:g}, {delta:g}): sigma/sensitivity={cal.sigma:.6g}")
    if "epsilon" in release and "delta" in release:
        ev = acc.EpsilonDeltaEvent(float(release["epsilon"]), float(release["delta"]))
        return ev, ev.epsilon_delta, f"({release['epsilon']:g}, {release['delta']:g})-DP mechanism"
    raise ValueError(f"release must have 'gaussian', 'gaussian_eps' or 'epsilon'+'delta'; found {release!r}")


@budget_app.command("compose")
def compose(
    gaussian: list[float] = typer.Option([], "--gaussian", help="A Gaussian release, sigma/sensitivity (repeatable)."),
    gaussian_eps: list[str] = typer.Option([], "--gaussian-eps", help="A Gaussian calibrated for EPS:DELTA\\[:classic|analytic] (repeatable)."),
    eps_delta: list[str] = typer.Option([], "--eps-delta", help="An (EPS:DELTA)-DP release (repeatable)."),
    file: Optional[Path] = typer.Option(None, "--file", help="JSON list of releases: {gaussian}, {gaussian_eps: \\[e, d, m]}, {epsilon, delta}."),
    delta: Optional[float] = typer.Option(None, "--delta", help="Total delta (default: sum of the releases' deltas)."),
    as_json: bool = JSON_OPT,
) -> None:
    """Compose several releases on the same data: nominal basic sum vs privkit's accountants."""
    releases = _releases_from(gaussian, gaussian_eps, eps_delta, file)
    ledger = acc.Ledger()
    nominal: list[tuple[float, float]] = []
    described = []
    for i, rel in enumerate(releases):
        event, nom, text = _event_of(rel)
        ledger.add("data", event, f"release {i}")
        described.append(text)
        if nom is not None:
            nominal.append(nom)
    if delta is None:
        if len(nominal) != len(releases):
            raise ValueError("--delta is required when a release has no nominal delta (--gaussian); found none")
        delta = math.fsum(d for _, d in nominal)
    summary = ledger.summary(delta)
    row = summary["clients"]["data"]
    basic_nominal = None
    if len(nominal) == len(releases):
        e, d = acc.basic_composition(nominal)
        basic_nominal = {"epsilon": e, "delta": d}
    best_kind = min((k for k in row if k != "best"), key=lambda k: row[k])
    out = {
        "releases": described,
        "delta": delta,
        "basic": basic_nominal,
        "best": {"epsilon": row["best"], "delta": delta, "accountant": best_kind},
        "accountants": row,
        "not_applicable": summary["not_applicable"],
        "warnings": [] if basic_nominal is None else [
            "basic = the releases' nominal (epsilon, delta) summed (what a paper reports); best = privkit's "
            "tightest sound accountant on the mechanisms themselves"],
    }
    _emit(out, as_json, "composition")


@budget_app.command("ledger")
def ledger_cmd(
    file: Path = typer.Argument(..., help="ledger.json written by Ledger.save."),
    delta: float = typer.Option(..., "--delta", help="Target delta in (0, 1)."),
    labels: list[str] = typer.Option([], "--label", help="Only entries with this label (repeatable)."),
    pld_grid: float = typer.Option(1e-3, "--pld-grid", help="PLD value discretisation interval: "
                                   "1e-3 is fast and still a pessimistic upper bound; 1e-4 is tighter "
                                   "by ~0.1% and ~10x slower."),
    as_json: bool = JSON_OPT,
) -> None:
    """Epsilon per client and for the worst client under every applicable accountant."""
    from accountants._validate import check_positive

    ledger = acc.Ledger.load(file)
    ledger.value_discretization_interval = check_positive(pld_grid, "pld_grid")
    summary = ledger.summary(delta, labels=labels or None)
    summary["pld_grid"] = pld_grid
    if as_json:
        print_json(summary)
        return
    kinds = [k for k in (*acc.ACCOUNTANTS, "best") if any(k in r for r in summary["clients"].values())]
    table = Table(title=f"{file}: epsilon at delta={delta:g}")
    table.add_column("client")
    for k in kinds:
        table.add_column(k, justify="right")
    for cid, row in summary["clients"].items():
        table.add_row(cid, *(f"{row[k]:.4g}" if k in row else "n/a" for k in kinds))
    table.add_row("worst", *(f"{summary['worst'][k]:.4g}" if k in summary["worst"] else "n/a" for k in kinds))
    out_console.print(table)
    out_console.print(f"PLD on a {pld_grid:g} grid (pessimistic discretisation: an upper bound)")
    for kind, reason in summary["not_applicable"].items():
        out_console.print(f"[yellow]{kind} not applicable:[/yellow] {reason}", highlight=False)
