"""``privkit budget``: privacy budgets of mechanisms, compositions and ledgers (package ``accountants``)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from accountants._validate import MAX_STEPS, check_open_unit, check_positive, check_real
from accountants.choices import SAMPLERS
from privkit.cli.app import app, out_console, print_json


class _Lazy:
    """A module imported on first attribute access: `privkit budget calibrate` pays for dp-accounting
    (about 1.5 s with scipy) only when it computes, and never for --help or a usage error."""

    def __init__(self, name: str) -> None:
        self._name, self._module = name, None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


acc = _Lazy("accountants")
dpa = _Lazy("dp_accounting")

budget_app = typer.Typer(
    help="Privacy budgets: mechanisms, composition, calibration, ledgers.", no_args_is_help=True
)
sensitivity_app = typer.Typer(help="L2 sensitivities of privatised models.", no_args_is_help=True)
app.add_typer(budget_app, name="budget")
budget_app.add_typer(sensitivity_app, name="sensitivity")

JSON_OPT = typer.Option(False, "--json", help="Print one JSON object.")
PROFILE_EPSILONS = (0.0, 0.1, 0.5, 1.0, 2.0, 5.0)


# Numbers are taken as text and parsed here, so that a bad value ("1.5" steps, "abc", "nan") is
# one line naming the option and the value, whatever the CLI framework does with its own types.
def _num(text: str | None, option: str) -> float | None:
    """Parse a real number given to ``option`` (None stays None)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{option} must be a number; found {text!r}") from None


def _int(text: str | None, option: str, minimum: int = 1, maximum: int | None = None) -> int | None:
    """Parse an integer >= ``minimum`` (and <= ``maximum``) given to ``option`` ("1e4" is fine, "1.5"
    is not; digits are read exactly, so 99999999999999999999999 stays that number instead of the
    float nearest it)."""
    if text is None:
        return None
    try:
        value: float | int = int(text.strip())
    except ValueError:
        value = _num(text, option)
    if (
        isinstance(value, float) and not (value.is_integer() and math.isfinite(value))
    ) or value < minimum:
        raise ValueError(f"{option} must be an integer >= {minimum}; found {text[:40]!r}")
    if maximum is not None and value > maximum:
        raise ValueError(
            f"{option} must be an integer <= {maximum:.3g}; found {text[:20]!r}... "
            f"({len(text.strip())} characters)"
        )
    return int(value)


def _num_opt(default: str | None, flag: str, help_: str, metavar: str = "FLOAT"):
    return typer.Option(default, flag, help=help_, metavar=metavar)


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
        elif key == "epsilon_bracket" and isinstance(value, dict) and "lower" in value:
            value = f"[{value['lower']:.6g}, {value['upper']:.6g}] (certified; {value['method']})"
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
    delta_: str = _num_opt(..., "--delta", "Target delta in (0, 1)."),
    sigma_: str | None = _num_opt(None, "--sigma", "Noise std (gives epsilons)."),
    epsilon_: str | None = _num_opt(None, "--epsilon", "Target epsilon (gives sigmas)."),
    sensitivity_: str = _num_opt("1.0", "--sensitivity", "L2 sensitivity."),
    as_json: bool = JSON_OPT,
) -> None:
    """Gaussian mechanism: classic (epsilon < 1 only) and analytic calibration side by side."""
    delta, sigma, epsilon = (
        _num(delta_, "--delta"),
        _num(sigma_, "--sigma"),
        _num(epsilon_, "--epsilon"),
    )
    sensitivity = _num(sensitivity_, "--sensitivity")
    if (sigma is None) == (epsilon is None):
        raise ValueError(
            "give exactly one of --sigma or --epsilon; found "
            + ("both" if sigma is not None else "neither")
        )
    out: dict[str, Any] = {"delta": delta, "sensitivity": sensitivity}
    if epsilon is not None:
        cal = acc.calibrate_gaussian(epsilon, delta, sensitivity, method="classic")
        out.update(
            epsilon=epsilon,
            classic_sigma=cal.classic_sigma,
            analytic_sigma=cal.analytic_sigma,
            ratio=cal.ratio,
            warnings=list(cal.warnings),
        )
    else:
        classic = acc.gaussian_epsilon(sigma, delta, sensitivity, method="classic")
        analytic = acc.gaussian_epsilon(sigma, delta, sensitivity, method="analytic")
        warns = []
        if classic >= 1:
            warns.append(
                f"classic_epsilon={classic:.4g} >= 1: the classic formula is proven only for "
                "epsilon < 1; analytic_epsilon is the exact value"
            )
        out.update(
            sigma=sigma,
            classic_epsilon=classic,
            analytic_epsilon=analytic,
            ratio=classic / analytic if analytic > 0 else math.inf,
            warnings=warns,
        )
    _emit(out, as_json, "Gaussian mechanism")


@budget_app.command("nfdp")
def nfdp(
    n_: str = _num_opt(..., "--n", "Client dataset size.", "INT"),
    k_: str = _num_opt(..., "--k", "Subsample size.", "INT"),
    replacement: bool = typer.Option(
        ..., "--replacement/--no-replacement", help="Sampling with or without replacement."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """FedMD-NFDP subsampling: the theorem's (epsilon, delta) and the exact privacy profile."""
    n, k = _int(n_, "--n"), _int(k_, "--k")
    eps, delta = acc.nfdp_epsilon_delta(n, k, replacement)
    grid = sorted(set(PROFILE_EPSILONS) | {eps})
    profile = acc.nfdp_profile(n, k, replacement, grid)
    out = {
        "n": n,
        "k": k,
        "replacement": replacement,
        "theorem": "FedMD-NFDP Theorem 2 (with replacement)"
        if replacement
        else "FedMD-NFDP Theorem 1 (without replacement)",
        "epsilon": eps,
        "delta": delta,
        "neighbouring": "add_remove",
        "profile": [{"epsilon": e, "delta": float(d)} for e, d in zip(grid, profile)],
        "warnings": list(acc.nfdp_warnings(n, k, replacement)),
    }
    _emit(out, as_json, "NFDP subsampling")


@budget_app.command("dpsgd")
def dpsgd(
    sample_rate_: str = _num_opt(..., "--sample-rate", "Sampling rate q (batch / dataset)."),
    noise_multiplier_: str = _num_opt(..., "--noise-multiplier", "Noise std / clipping norm."),
    steps_: str = _num_opt(..., "--steps", "Number of steps.", "INT"),
    delta_: str = _num_opt(..., "--delta", "Target delta in (0, 1)."),
    sampler: str | None = typer.Option(
        None,
        "--sampler",
        help="poisson | shuffle | random-allocation | "
        "without-replacement: how batches were drawn (default poisson)",
    ),
    sampling: str | None = typer.Option(None, "--sampling", help="Older name of --sampler."),
    accountant: str = typer.Option(
        "pld", "--accountant", help="rdp | pld | prv | all (Poisson and without-replacement)"
    ),
    dataset_size_: str | None = _num_opt(
        None, "--dataset-size", "N for sampling without replacement.", "INT"
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Epsilon of subsampled-Gaussian steps (DP-SGD, DP-FedAvg, FedKADP) under the sampler that ran."""
    q, sigma = _num(sample_rate_, "--sample-rate"), _num(noise_multiplier_, "--noise-multiplier")
    steps, delta = _int(steps_, "--steps", maximum=MAX_STEPS), _num(delta_, "--delta")
    dataset_size = _int(dataset_size_, "--dataset-size")
    if sampler is not None and sampling is not None and sampler != sampling:
        raise ValueError(f"--sampler and --sampling disagree; found {sampler!r} and {sampling!r}")
    kind = sampler or sampling or "poisson"
    choices = (*SAMPLERS, "without-replacement")
    if kind not in choices:
        raise ValueError(f"--sampler must be one of {', '.join(choices)}; found {kind!r}")
    _check_dpsgd_inputs(q, sigma, delta)
    if kind in ("shuffle", "random-allocation"):
        _emit(_sampler_output(kind, q, sigma, steps, delta), as_json, f"DP-SGD, {kind} batches")
        return
    if accountant not in ("rdp", "pld", "prv", "all"):
        raise ValueError(f"--accountant must be one of rdp, pld, prv, all; found {accountant!r}")
    warns: list[str] = []
    if accountant == "all":
        names = ["rdp"] if kind == "without-replacement" else ["rdp", "pld", "prv"]
        if kind == "without-replacement":
            warns.append(
                "pld and prv do not support sampling without replacement; only rdp is shown"
            )
    else:
        names = [accountant]
    results = {}
    for name in names:
        try:
            res = acc.dpsgd_accounting(
                q, sigma, steps, delta, kind, name, dataset_size=dataset_size
            )
        except ValueError as exc:
            if accountant != "all" or name != "prv":
                raise
            warns.append(f"prv left out: {exc}")  # PRV's grid would not fit in memory
            continue
        if res.accountant != name:  # pld past its grid: the result is RDP's, and says so
            warns.extend(w for w in res.warnings if w not in warns)
            if accountant == "all":
                continue  # rdp is in the table already
        results[name] = res
    first = next(iter(results.values()))
    out = {
        "sample_rate": q,
        "noise_multiplier": sigma,
        "steps": steps,
        "delta": delta,
        "sampler": kind,
        "neighbouring": first.neighbouring,
        "accountant": accountant if accountant == "all" else first.accountant,
        "epsilon": {k: r.epsilon for k, r in results.items()}
        if accountant == "all"
        else first.epsilon,
    }
    tight = [k for k, r in results.items() if r.accountant in ("pld", "prv")]
    if kind == "poisson" and tight:
        out.update(_bracket(q, sigma, steps, delta, {k: results[k] for k in tight}, warns))
    elif accountant in ("rdp", "all") or kind != "poisson":
        # RDP's conversion and sampling without replacement (RDP only) are upper bounds only
        out.update(epsilon_bracket=None, bracket_reason="not-tight")
    else:  # pld asked for, RDP's bound printed instead (the warning says why)
        out.update(
            epsilon_bracket=None,
            bracket_reason="not-tight: the PLD grid would be too large, the epsilon is RDP's",
        )
    out["warnings"] = [w for w in first.warnings if w not in warns] + warns
    _emit(out, as_json, "DP-SGD (subsampled Gaussian)")


def _check_dpsgd_inputs(q: float, sigma: float, delta: float) -> None:
    """The checks the accountants make, before dp-accounting and scipy load (about 1.2 s)."""
    check_positive(sigma, "--noise-multiplier")
    check_open_unit(delta, "--delta")
    if not 0.0 < check_real(q, "--sample-rate") <= 1.0:
        raise ValueError(f"--sample-rate must be in (0, 1]; found {q!r}")


def _bracket(
    q: float, sigma: float, steps: int, delta: float, results: dict, warns: list[str]
) -> dict:
    """``{"epsilon_bracket": ...}``: certified [lower, upper] around the printed tight epsilon.
    ``upper`` is that epsilon (the smallest of PLD's and PRV's when both are printed), ``lower`` the
    larger certified lower end of the optimistic PLD (accountants.bracket) and PRV's interval
    (Gopi et al. 2021).  Without a lower end, or with ends out of order, ``epsilon_bracket`` is
    None and ``bracket_reason`` says why: a bracket is printed ordered or not at all."""
    tight = {k: r.epsilon for k, r in results.items()}
    upper_from = min(tight, key=tight.get)
    lowers: dict[str, float] = {}
    out: dict[str, Any] = {}
    reasons = []
    try:
        lowers["pld"] = acc.optimistic_epsilon(acc.dpsgd_event(q, sigma, steps), delta)
    except ValueError as exc:  # the optimistic PLD's grid is past its limit
        reasons.append(f"no optimistic PLD: {exc}")
    try:
        lowers["prv"], out["prv_estimate"], _ = acc.prv_bracket(q, sigma, steps, delta)
    except ValueError as exc:  # PRV's grid would not fit in memory: the PLD end alone
        warns.append(f"prv interval left out of the bracket: {exc}")
        reasons.append(f"no PRV interval: {exc}")
    lowers = {k: v for k, v in lowers.items() if not math.isnan(v)}
    if not lowers:
        return {
            "epsilon_bracket": None,
            "bracket_reason": "; ".join(reasons) or "no certified lower end",
        }
    lower_from = max(lowers, key=lowers.get)
    try:
        acc.bracket.check_ordered(lowers[lower_from], tight[upper_from])
    except ValueError as exc:
        return {"epsilon_bracket": None, "bracket_reason": str(exc)}
    return {
        "epsilon_bracket": {
            "lower": lowers[lower_from],
            "upper": tight[upper_from],
            "lower_from": lower_from,
            "upper_from": upper_from,
            **out,
            "method": "lower: optimistic PLD (tangent discretisation, 1e-4 grid) or PRV's certified "
            "interval (eps_error 0.01); upper: the printed epsilon",
        }
    }


def _sampler_output(kind: str, q: float, sigma: float, steps: int, delta: float) -> dict[str, Any]:
    """Upper and lower epsilon bounds for shuffled / randomly allocated batches, beside Poisson's."""
    res = acc.sampler_accounting(kind, q, sigma, steps, delta)
    poisson = acc.sampler_accounting("poisson", q, sigma, steps, delta)
    return {
        "sample_rate": q,
        "noise_multiplier": sigma,
        "steps": steps,
        "delta": delta,
        "sampler": kind,
        "batches_per_epoch": res.batches_per_epoch,
        "epochs": res.epochs,
        "neighbouring": "add_remove",
        "epsilon": res.epsilon,
        "epsilon_lower": res.epsilon_lower,
        "upper_method": res.upper_method,
        "lower_method": res.lower_method,
        "epsilon_if_poisson": poisson.epsilon,
        "warnings": list(res.notes),
    }


@budget_app.command("calibrate")
def calibrate(
    epsilon_: str = _num_opt(..., "--epsilon", "Target epsilon."),
    delta_: str = _num_opt(..., "--delta", "Target delta in (0, 1)."),
    sample_rate_: str = _num_opt(..., "--sample-rate", "Sampling rate q."),
    steps_: str = _num_opt(..., "--steps", "Number of steps.", "INT"),
    sampling: str = typer.Option("poisson", "--sampling", help="poisson | without-replacement"),
    accountant: str = typer.Option("pld", "--accountant", help="pld | rdp"),
    as_json: bool = JSON_OPT,
) -> None:
    """Smallest noise multiplier meeting (epsilon, delta); the returned epsilon is re-checked <= target."""
    cal = acc.calibrate_noise_multiplier(
        _num(epsilon_, "--epsilon"),
        _num(delta_, "--delta"),
        _num(sample_rate_, "--sample-rate"),
        _int(steps_, "--steps", maximum=MAX_STEPS),
        sampling,
        accountant,
    )
    bracket: dict[str, Any] = {
        "epsilon_bracket": None,
        "bracket_reason": "not-tight",
    }  # RDP; without replacement
    if cal.accountant == "pld":  # the bracket at the returned sigma; its upper end is cal.epsilon
        event = acc.dpsgd_event(cal.sample_rate, cal.noise_multiplier, cal.steps)
        try:
            bracket = {
                "epsilon_bracket": acc.pld_bracket(
                    event, cal.delta, cal.value_discretization_interval
                ).to_dict()
            }
        except (
            ValueError
        ) as exc:  # no optimistic PLD at this size, or ends out of order: none, and why
            bracket = {"epsilon_bracket": None, "bracket_reason": str(exc)}
    out = {
        "noise_multiplier": cal.noise_multiplier,
        "epsilon": cal.epsilon,
        "target_epsilon": cal.target_epsilon,
        "delta": cal.delta,
        "sample_rate": cal.sample_rate,
        "steps": cal.steps,
        "sampling": cal.sampling,
        "accountant": cal.accountant,
        "neighbouring": cal.neighbouring,
        "value_discretization_interval": cal.value_discretization_interval,
        **bracket,
        "warnings": list(cal.warnings),
    }
    _emit(out, as_json, "noise calibration")


@sensitivity_app.command("logreg")
def logreg(
    n_: str = _num_opt(..., "--n", "Examples the ERM is solved on.", "INT"),
    lam_: str = _num_opt(..., "--lambda", "L2 regularisation strength."),
    classes_: str | None = _num_opt(None, "--classes", "Number of classes C (multinomial).", "INT"),
    as_json: bool = JSON_OPT,
) -> None:
    """L2 sensitivity of L2-regularised logistic regression (features with norm <= 1, replace-one)."""
    n, lam, classes = _int(n_, "--n"), _num(lam_, "--lambda"), _int(classes_, "--classes", 2)
    out: dict[str, Any] = {
        "n": n,
        "lambda": lam,
        "neighbouring": "replace_one",
        "binary": acc.logreg_binary_sensitivity(n, lam),
    }
    if classes is not None:
        out["classes"] = classes
        out["multinomial"] = acc.logreg_multinomial_sensitivity(n, lam, classes)
        out["multinomial_cfree"] = acc.logreg_multinomial_sensitivity_cfree(n, lam)
    out["warnings"] = [
        "assumes every feature vector has L2 norm <= 1 (project each onto the unit ball; "
        "scaling by the max norm over private data is data-dependent)"
    ]
    _emit(out, as_json, "logistic-regression sensitivity")


def _split_release(text: str, option: str, parts: tuple[int, int]) -> list[str]:
    items = text.split(":")
    if not parts[0] <= len(items) <= parts[1]:
        shape = "EPS:DELTA[:classic|analytic]" if parts[1] == 3 else "EPS:DELTA"
        raise ValueError(f"{option} must look like {shape}; found {text!r}")
    return items


def _releases_from(
    gaussian: list[str], gaussian_eps: list[str], eps_delta: list[str], file: Path | None
) -> list[tuple[str, dict[str, Any]]]:
    """(where, release record) pairs; ``where`` names the option or file entry for error messages."""
    releases: list[tuple[str, dict[str, Any]]] = [
        (f"--gaussian {g!r}", {"gaussian": _num(g, "--gaussian")}) for g in gaussian
    ]
    for text in gaussian_eps:
        items = _split_release(text, "--gaussian-eps", (2, 3))
        where = f"--gaussian-eps {text!r}"
        releases.append(
            (
                where,
                {
                    "gaussian_eps": [
                        _num(items[0], f"{where}: epsilon"),
                        _num(items[1], f"{where}: delta"),
                        items[2] if len(items) == 3 else "classic",
                    ]
                },
            )
        )
    for text in eps_delta:
        items = _split_release(text, "--eps-delta", (2, 2))
        where = f"--eps-delta {text!r}"
        releases.append(
            (
                where,
                {
                    "epsilon": _num(items[0], f"{where}: epsilon"),
                    "delta": _num(items[1], f"{where}: delta"),
                },
            )
        )
    if file is not None:
        releases.extend(_releases_in_file(file))
    if not releases:
        raise ValueError(
            "give at least one release (--gaussian, --gaussian-eps, --eps-delta or --file); found none"
        )
    return releases


def _releases_in_file(file: Path) -> list[tuple[str, dict[str, Any]]]:
    if not file.is_file():
        raise FileNotFoundError(f"compose file not found: {file}")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"compose file {file} is not valid JSON: {exc}") from None
    items = data.get("releases") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(
            f'compose file {file} must hold a list of releases or {{"releases": [...]}}; '
            f"found {json.dumps(data)[:80]}"
        )
    out = []
    for i, item in enumerate(items):
        where = f"compose file {file}: releases[{i}]"
        if not isinstance(item, dict):
            raise ValueError(
                f'{where} must be an object such as {{"gaussian": 2.0}}; found {json.dumps(item)[:80]}'
            )
        out.append((where, item))
    return out


_SHAPES = ({"gaussian"}, {"gaussian_eps"}, {"epsilon", "delta"})


def _real(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number; found {value!r}")
    return float(value)


def _event_of(release: dict[str, Any], where: str) -> tuple[Any, tuple[float, float] | None, str]:
    """(event, nominal (eps, delta) or None, description) of one release record."""
    if set(release) not in _SHAPES:
        raise ValueError(
            f"{where} must have the keys 'gaussian', 'gaussian_eps' or 'epsilon'+'delta'; "
            f"found {sorted(release)}"
        )
    if "gaussian" in release:
        sigma = _real(release["gaussian"], f"{where}: gaussian")
        if not sigma > 0 or math.isinf(sigma):
            raise ValueError(
                f"{where}: gaussian noise multiplier must be a positive finite number; found {sigma!r}"
            )
        return dpa.GaussianDpEvent(sigma), None, f"Gaussian, sigma/sensitivity={sigma:g}"
    if "gaussian_eps" in release:
        spec = release["gaussian_eps"]
        if not isinstance(spec, list) or len(spec) not in (2, 3):
            raise ValueError(
                f"{where}: gaussian_eps must be a list (epsilon, delta) or (epsilon, delta, method); "
                f"found {spec!r}"
            )
        eps, delta = _real(spec[0], f"{where}: epsilon"), _real(spec[1], f"{where}: delta")
        method = spec[2] if len(spec) == 3 else "classic"
        if method not in ("classic", "analytic"):
            raise ValueError(f"{where}: method must be classic or analytic; found {method!r}")
        cal = acc.calibrate_gaussian(eps, delta, 1.0, method=method)
        return (
            dpa.GaussianDpEvent(cal.sigma),
            (eps, delta),
            f"Gaussian calibrated ({method}) for ({eps:g}, {delta:g}): sigma/sensitivity={cal.sigma:.6g}",
        )
    eps, delta = (
        _real(release["epsilon"], f"{where}: epsilon"),
        _real(release["delta"], f"{where}: delta"),
    )
    try:
        ev = acc.EpsilonDeltaEvent(eps, delta)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ev, ev.epsilon_delta, f"({eps:g}, {delta:g})-DP mechanism"


@budget_app.command("compose")
def compose(
    gaussian: list[str] = typer.Option(
        [],
        "--gaussian",
        metavar="FLOAT",
        help="A Gaussian release, sigma/sensitivity (repeatable).",
    ),
    gaussian_eps: list[str] = typer.Option(
        [],
        "--gaussian-eps",
        help="A Gaussian calibrated for EPS:DELTA\\[:classic|analytic] (repeatable).",
    ),
    eps_delta: list[str] = typer.Option(
        [], "--eps-delta", help="An (EPS:DELTA)-DP release (repeatable)."
    ),
    file: Path | None = typer.Option(
        None,
        "--file",
        help="JSON list of releases: {gaussian}, {gaussian_eps: \\[e, d, m]}, {epsilon, delta}.",
    ),
    delta_: str | None = _num_opt(
        None, "--delta", "Total delta (default: sum of the releases' deltas)."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Compose several releases on the same data: nominal basic sum vs privkit's accountants."""
    delta = _num(delta_, "--delta")
    releases = _releases_from(gaussian, gaussian_eps, eps_delta, file)
    ledger = acc.Ledger()
    nominal: list[tuple[float, float]] = []
    described = []
    for i, (where, rel) in enumerate(releases):
        event, nom, text = _event_of(rel, where)
        ledger.add("data", event, f"release {i}")
        described.append(text)
        if nom is not None:
            nominal.append(nom)
    if delta is None:
        if len(nominal) != len(releases):
            raise ValueError(
                "--delta is required when a release has no nominal delta (--gaussian); found none"
            )
        delta = math.fsum(d for _, d in nominal)
    summary = ledger.summary(delta)
    row = summary["clients"]["data"]
    basic_nominal = None
    if len(nominal) == len(releases):
        e, d = acc.basic_composition(nominal)
        basic_nominal = {"epsilon": e, "delta": d}
    best_kind = min((k for k in row if k != "best"), key=lambda k: row[k])
    brackets = ledger.brackets(delta, accountants=[k for k in row if k != "best"])
    brackets["epsilon_bracket"] = {
        k: b
        and {**b["worst"], "grid": b["grid"], "lower_grid": b["lower_grid"], "method": b["method"]}
        for k, b in brackets["epsilon_bracket"].items()
    }
    out = {
        "releases": described,
        "delta": delta,
        "basic": basic_nominal,
        "best": {"epsilon": row["best"], "delta": delta, "accountant": best_kind},
        "accountants": row,
        **brackets,
        "not_applicable": summary["not_applicable"],
        "warnings": []
        if basic_nominal is None
        else [
            "basic = the releases' nominal (epsilon, delta) summed (what a paper reports); best = privkit's "
            "tightest sound accountant on the mechanisms themselves"
        ],
    }
    _emit(out, as_json, "composition")


@budget_app.command("ledger")
def ledger_cmd(
    file: Path = typer.Argument(..., help="ledger.json written by Ledger.save."),
    delta_: str = _num_opt(..., "--delta", "Target delta in (0, 1)."),
    labels: list[str] = typer.Option(
        [], "--label", help="Only entries with this label (repeatable)."
    ),
    pld_grid_: str = _num_opt(
        "1e-3",
        "--pld-grid",
        "PLD value discretisation interval: 1e-3 is fast "
        "and still a pessimistic upper bound; 1e-4 is tighter by ~0.1% and ~10x slower.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Epsilon per client and for the worst client under every applicable accountant."""
    delta, pld_grid = _num(delta_, "--delta"), _num(pld_grid_, "--pld-grid")
    acc._validate.check_positive(pld_grid, "pld_grid")
    from privkit.files import checked

    ledger = acc.Ledger.load(checked(file, "ledger file"))  # a run's ledger: its checksum first
    ledger.value_discretization_interval = pld_grid
    summary = ledger.summary(delta, labels=labels or None)
    summary["pld_grid"] = pld_grid
    summary.update(
        ledger.brackets(
            delta, labels or None, [k for k in acc.ACCOUNTANTS if k in summary["worst"]]
        )
    )
    if as_json:
        print_json(summary)
        return
    kinds = [
        k for k in (*acc.ACCOUNTANTS, "best") if any(k in r for r in summary["clients"].values())
    ]
    pld = summary["epsilon_bracket"].get("pld")
    table = Table(title=f"{file}: epsilon at delta={delta:g}")
    table.add_column("client")
    for k in kinds:
        table.add_column(k, justify="right")
    if pld:
        table.add_column("pld certified bracket", justify="right")

    def bracket(end: dict) -> list[str]:
        return [f"[{end['lower']:.6g}, {end['upper']:.6g}]"] if pld else []

    for cid, row in summary["clients"].items():
        table.add_row(
            cid,
            *(f"{row[k]:.4g}" if k in row else "n/a" for k in kinds),
            *bracket(pld["clients"][cid] if pld else {}),
        )
    table.add_row(
        "worst",
        *(f"{summary['worst'][k]:.4g}" if k in summary["worst"] else "n/a" for k in kinds),
        *bracket(pld["worst"] if pld else {}),
    )
    out_console.print(table)
    out_console.print(
        f"PLD on a {pld_grid:g} grid (pessimistic discretisation: an upper bound)"
        + (
            f"; the exact PLD epsilon lies in the certified bracket (lower end on a "
            f"{pld['lower_grid']:g} grid)"
            if pld
            else ""
        )
    )
    for kind, reason in summary["bracket_reason"].items():
        if reason != "not-tight":
            out_console.print(f"[yellow]no {kind} bracket:[/yellow] {reason}", highlight=False)
    if "noise" in summary:
        out_console.print(f"[red]{summary['noise']}[/red]", highlight=False)
    adaptive = summary.get("adaptive_composition")
    if adaptive:
        out_console.print(
            f"adaptive choices covered by a Renyi filter (order {adaptive['order']:g}): every client is "
            f"({adaptive['epsilon']:.4g}, {adaptive['delta']:g})-DP; the table composes the recorded "
            "rounds as if their parameters were fixed in advance",
            highlight=False,
        )
    for kind, reason in summary["not_applicable"].items():
        out_console.print(f"[yellow]{kind} not applicable:[/yellow] {reason}", highlight=False)


@budget_app.command("lifetime")
def lifetime_cmd(
    store: Path = typer.Argument(
        ..., help="A federation's lifetime ledger (Accounted(..., store=...))."
    ),
    delta_: str = _num_opt(..., "--delta", "Target delta in (0, 1)."),
    budget_: str = _num_opt(None, "--budget", "Lifetime epsilon budget: also print what is left."),
    as_json: bool = JSON_OPT,
) -> None:
    """Epsilon a federation has spent over all its accounted Flower runs (each run's worst client)."""
    delta = _num(delta_, "--delta")
    check_open_unit(delta, "delta")
    budget = _num(budget_, "--budget")
    if budget is not None:
        check_positive(budget, "budget")
    if not (store / "runs").is_dir():
        raise ValueError(f"store must be a lifetime ledger folder (with runs/); found {store}")
    from privkit.flower.lifetime import store_ledger

    ledger, runs = store_ledger(store)
    worst = ledger.summary(delta)["worst"] if len(ledger) else {}
    data = {
        "store": str(store),
        "delta": delta,
        "runs": [{"run": r["run"], "rounds": r["rounds"], "epsilon": r["epsilon"]} for r in runs],
        "lifetime": worst,
        "budget": budget,
        "left": None if budget is None else budget - worst.get("best", 0.0),
    }
    if as_json:
        print_json(data)
        return
    table = Table(title=f"{store}: lifetime epsilon at delta={delta:g}")
    for col in ("run", "rounds", "its own epsilon"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for r in data["runs"]:
        table.add_row(r["run"], str(r["rounds"]), f"{r['epsilon']:.4g}")
    out_console.print(table)
    for kind, eps in worst.items():
        out_console.print(f"lifetime epsilon ({kind}): {eps:.6g}", highlight=False)
    if budget is not None:
        out_console.print(
            f"lifetime budget {budget:g}: {data['left']:.6g} left (best accountant)",
            highlight=False,
        )
