"""``privkit train``: run one registered method on a federation and write its run directory.

``privkit train METHOD [--config FILE.toml] [--set k=v ...] [--federation-set k=v ...] [--seed S]
[--quick] --out RUN_DIR [--json]`` and ``privkit train --list [--json]``.

The config file may hold ``method``, ``seed``, a ``[federation]`` table (:class:`FederationConfig`)
and a ``[trainer]`` table (the method's config); ``--set`` overrides trainer keys,
``--federation-set`` federation keys, ``--quick`` starts from the method's CPU-sized settings.
Everything is validated before any data is loaded or any training starts.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from privkit.cli.app import app, out_console, print_json
from privkit.config import apply_overrides, load_toml
from privkit.errors import PrivkitError

SCHEMA_VERSION = 1
_FILE_KEYS = {"method", "seed", "federation", "trainer"}


def list_methods() -> list[dict[str, Any]]:
    """Every registered method with its summary, paper, formal_dp flag, defaults and quick overrides."""
    from privkit.trainers import REGISTRY  # importing the package registers every method

    return [{"name": s.name, "summary": s.summary, "paper": s.paper, "formal_dp": s.formal_dp,
             "defaults": s.defaults(), "quick": dict(s.quick)} for s in sorted(REGISTRY.values(), key=lambda s: s.name)]


def resolve_run(method: str | None, config_file: Path | None, sets: list[str], federation_sets: list[str],
                seed: int | None, quick: bool, reproducible_noise: bool = False) -> dict[str, Any]:
    """Validated {method, seed, federation (FederationConfig), trainer (config model)}; no training."""
    from privkit.data import FederationConfig
    from privkit.trainers import get_trainer, make_config

    data: dict[str, Any] = {}
    if config_file is not None:
        data = load_toml(config_file)
        unknown = set(data) - _FILE_KEYS
        if unknown:
            raise PrivkitError(f"config file keys must be among {sorted(_FILE_KEYS)}; found {sorted(unknown)}")
    method = method or data.get("method")
    if not method:
        raise PrivkitError("method must be given (argument or 'method' in the config file); found none")
    spec = get_trainer(method)
    trainer = spec.quick_config() if quick else {}
    trainer.update(data.get("trainer", {}))
    trainer = apply_overrides(trainer, sets)
    if reproducible_noise:
        trainer["reproducible_noise"] = True
    for key in trainer:
        if key not in spec.config_cls.model_fields:
            raise PrivkitError(f"--set key must be a field of {method}'s config "
                               f"({', '.join(sorted(spec.config_cls.model_fields))}); found {key!r}")
    fed = apply_overrides(data.get("federation", {}), federation_sets)
    for key in fed:
        if key not in FederationConfig.model_fields:
            raise PrivkitError(f"--federation-set key must be one of {', '.join(sorted(FederationConfig.model_fields))}; "
                               f"found {key!r}")
    run_seed = seed if seed is not None else int(data.get("seed", 0))
    return {"method": method, "seed": run_seed, "federation": FederationConfig.model_validate(fed),
            "trainer": make_config(method, trainer)}


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def run_training(resolved: dict[str, Any], out: Path, progress: bool = True) -> dict[str, Any]:
    """Build the federation, train, and write the run directory; return a summary dict."""
    from privkit.data import build_federation
    from privkit.trainers import train

    out.mkdir(parents=True, exist_ok=True)
    fed_cfg, cfg = resolved["federation"], resolved["trainer"]
    config_json = {"schema_version": SCHEMA_VERSION, "method": resolved["method"], "seed": resolved["seed"],
                   "federation": fed_cfg.model_dump(), "trainer": cfg.model_dump()}
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    federation = build_federation(fed_cfg)
    federation.save(out / "federation.json")
    start = time.perf_counter()
    result = train(resolved["method"], federation, cfg, seed=resolved["seed"], progress=progress)
    seconds = time.perf_counter() - start
    result.save(out)
    delta = result.claims.get("delta") or 1e-5
    try:
        eps = result.ledger.epsilon(delta) if result.ledger.clients else float("inf")
    except ValueError as exc:  # an event no accountant handles: say so, do not hide it
        eps, note = float("nan"), str(exc)
    else:
        note = None
    return {"method": result.method, "seed": result.seed, "run_dir": str(out),
            "test_accuracy": float(result.test_accuracy), "rounds": len(result.rounds),
            "seconds": round(seconds, 2), "epsilon": _finite(eps), "epsilon_infinite": math.isinf(eps),
            "delta": delta, "accountant": "best", "accounting_error": note,
            "claims": {k: v for k, v in result.claims.items() if k != "mechanisms"},
            "warnings": result.warnings, "artifacts": sorted(result.artifacts),
            **result.ledger.noise_stamp(),
            "files": sorted(p.name for p in out.iterdir())}


def _print_list(rows: list[dict[str, Any]]) -> None:
    table = Table(title="registered methods (privkit train METHOD; defaults: privkit train --list --json)")
    for col in ("method", "formal DP", "summary", "paper"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r["name"], "yes" if r["formal_dp"] else "no", r["summary"], r["paper"] or "")
    out_console.print(table)


@app.command("train")
def train_command(
    method: Optional[str] = typer.Argument(None, help="Method name (see --list)."),
    config: Optional[Path] = typer.Option(None, "--config", help="TOML file: method, seed, [federation], [trainer]."),
    sets: list[str] = typer.Option([], "--set", help="Trainer override key=value (repeatable)."),
    federation_sets: list[str] = typer.Option([], "--federation-set", help="Federation override key=value (repeatable)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Trainer seed (default: file's or 0)."),
    quick: bool = typer.Option(False, "--quick", help="Start from the method's CPU-sized quick settings."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory to write."),
    list_: bool = typer.Option(False, "--list", help="List the registered methods and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    reproducible_noise: bool = typer.Option(
        False, "--reproducible-noise", help="Derive DP noise and sampling from the seed (bit-reproducible; "
        "the ledger and outputs say 'reproducible noise: not for release'). Default: OS entropy, never stored."),
) -> None:
    """Train METHOD on a federation and write RUN_DIR (config, federation, checkpoints, ledger, metrics)."""
    if list_:
        rows = list_methods()
        if as_json:
            print_json({"schema_version": SCHEMA_VERSION, "methods": rows})
        else:
            _print_list(rows)
        return
    if out is None:
        raise PrivkitError("--out must name the run directory to write; found none")
    resolved = resolve_run(method, config, sets, federation_sets, seed, quick, reproducible_noise)
    summary = run_training(resolved, out, progress=not as_json)
    if as_json:
        print_json({"schema_version": SCHEMA_VERSION, **summary})
        return
    eps = "inf (non-private release in the ledger)" if summary["epsilon_infinite"] else f"{summary['epsilon']:.4g}"
    out_console.print(f"[bold]{summary['method']}[/bold] seed {summary['seed']}: test accuracy "
                      f"{summary['test_accuracy']:.4f} after {summary['rounds']} round(s), {summary['seconds']} s")
    out_console.print(f"worst-client epsilon at delta={summary['delta']:g} (best accountant): {eps}")
    if summary["claims"]:
        c = summary["claims"]
        out_console.print(escape(f"paper's claim: epsilon={c.get('epsilon')}, delta={c.get('delta')} "
                                 f"({c.get('composition')}; {c.get('source')})"))
    for w in summary["warnings"]:
        out_console.print(f"[yellow]note:[/yellow] {escape(w)}", highlight=False)
    out_console.print(f"wrote {summary['run_dir']}: {', '.join(summary['files'])}")
