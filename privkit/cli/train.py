"""``privkit train``: run one registered method on a federation and write its run directory.

``privkit train METHOD [--config FILE.toml] [--set k=v ...] [--federation-set k=v ...] [--seed S]
[--quick] --out RUN_DIR [--json]`` and ``privkit train --list [--json]``.

The config file may hold ``method``, ``seed``, a ``[federation]`` table (:class:`~privkit.data.FederationConfig`)
and a ``[trainer]`` table (the method's config); ``--set`` overrides trainer keys,
``--federation-set`` federation keys, ``--quick`` starts from the method's CPU-sized settings.
Everything is validated before any data is loaded or any training starts.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from privkit.cli.app import app, out_console, print_json
from privkit.errors import PrivkitError

SCHEMA_VERSION = 1
_FILE_KEYS = {"method", "seed", "engine", "federation", "trainer"}


def list_methods() -> list[dict[str, Any]]:
    """Every registered method with its summary, paper, formal_dp flag, claim level (``record``:
    per record of a client, ``client``: a client's whole data), defaults and quick overrides."""
    from privkit.methods import REGISTRY  # torch-free: configs and metadata only

    return [
        {
            "name": s.name,
            "summary": s.summary,
            "paper": s.paper,
            "formal_dp": s.formal_dp,
            "level": s.level,
            "defaults": s.defaults(),
            "quick": dict(s.quick),
        }
        for s in sorted(REGISTRY.values(), key=lambda s: s.name)
    ]


def resolve_run(
    method: str | None,
    config_file: Path | None,
    sets: list[str],
    federation_sets: list[str],
    seed: int | None,
    quick: bool,
    reproducible_noise: bool = False,
    engine: str | None = None,
) -> dict[str, Any]:
    """Validated {method, seed, engine, federation (FederationConfig), trainer (config model)}; no training."""
    from privkit.config import apply_overrides, load_toml
    from privkit.data import FederationConfig
    from privkit.flower_engine.engine import (
        check_engine,  # Flower-free: only the name and the extra are checked
    )
    from privkit.methods import get_trainer, make_config  # torch-free: refusing a value stays fast

    data: dict[str, Any] = {}
    if config_file is not None:
        data = load_toml(config_file)
        unknown = set(data) - _FILE_KEYS
        if unknown:
            raise PrivkitError(
                f"config file keys must be among {sorted(_FILE_KEYS)}; found {sorted(unknown)}"
            )
    method = method or data.get("method")
    if not method:
        raise PrivkitError(
            "method must be given (argument or 'method' in the config file); found none"
        )
    spec = get_trainer(method)
    engine = engine or data.get("engine", "inprocess")
    check_engine(engine, method)
    trainer = spec.quick_config() if quick else {}
    trainer.update(data.get("trainer", {}))
    trainer = apply_overrides(trainer, sets)
    if reproducible_noise:
        trainer["reproducible_noise"] = True
    for key in trainer:
        if key not in spec.config_cls.model_fields:
            raise PrivkitError(
                f"--set key must be a field of {method}'s config "
                f"({', '.join(sorted(spec.config_cls.model_fields))}); found {key!r}"
            )
    fed = apply_overrides(data.get("federation", {}), federation_sets)
    for key in fed:
        if key not in FederationConfig.model_fields:
            raise PrivkitError(
                f"--federation-set key must be one of {', '.join(sorted(FederationConfig.model_fields))}; "
                f"found {key!r}"
            )
    run_seed = seed if seed is not None else int(data.get("seed", 0))
    return {
        "method": method,
        "seed": run_seed,
        "federation": FederationConfig.model_validate(fed),
        "trainer": make_config(method, trainer),
        "engine": engine,
    }


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


RUN_MARKER = "train.json"  # written last by TrainResult.save: its presence means a finished run


def _config_json(resolved: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of a run (JSON values only, so that it compares with a stored one)."""
    from privkit.flower_engine.engine import engine_entry

    return json.loads(
        json.dumps(
            {
                "schema_version": SCHEMA_VERSION,
                "method": resolved["method"],
                "seed": resolved["seed"],
                "federation": resolved["federation"].model_dump(),
                "trainer": resolved["trainer"].model_dump(),
                **engine_entry(resolved.get("engine", "inprocess")),
            },
            default=str,
        )
    )


def check_out_dir(out: Path, force: bool, config_json: dict[str, Any] | None = None) -> bool:
    """``--out`` is new, empty, a finished run of the same config (True: nothing to train), or
    a finished run of another config, replaced only with ``--force``. A finished run whose files
    fail their checksums is trained again (with a warning)."""
    from privkit.files import intact, read_json

    if out.exists() and not out.is_dir():
        raise PrivkitError(f"--out must be a directory; found a file {out}")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    if not (out / "config.json").is_file():
        raise PrivkitError(
            f"--out must be a new or empty directory or an earlier run; found "
            f"{sum(1 for _ in out.iterdir())} other entries in {out}"
        )
    if not (out / RUN_MARKER).is_file() or config_json is None:
        return False
    if (
        not force
        and intact(out / "config.json", say_warning)
        and read_json(out / "config.json", "run config") == config_json
    ):
        files = [p for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")]
        failing = [p for p in files if not intact(p, say_warning)]  # each one named in a warning
        return not failing
    if not force:
        raise PrivkitError(
            f"--out {out} already holds a finished run of another config; pass "
            "--force to replace it (or choose another directory)"
        )
    return False


def say_warning(msg: str) -> None:
    from privkit.cli.app import err_console

    err_console.print(f"[yellow]warning:[/yellow] {escape(msg)}", highlight=False, soft_wrap=True)


def _headline(result, federation, claims_dp: bool) -> dict[str, Any]:
    """Worst-client epsilon (best accountant) and the report's formal-DP rule, so that this line
    and a report of the same run agree. The delta is the paper's when it is meaningful (below
    1/n of the smallest client), else 1e-5 as in reports."""
    from privkit.pipeline.stages import guarantee_facts
    from reports import delta_ge_one_over_n, formal_dp_status

    n_min = min((len(c) for c in federation.clients), default=0) or None
    claimed = result.claims.get("delta")
    meaningful = (
        isinstance(claimed, (int, float))
        and not isinstance(claimed, bool)
        and 0 < claimed < 1
        and not delta_ge_one_over_n(claimed, n_min)
    )
    delta = float(claimed) if meaningful else 1e-5
    facts: dict[str, Any]
    eps, note, facts = math.inf, None, {"fixed_delta": None, "non_private": []}
    if result.ledger.clients:
        try:
            # the worst client under the best accountant: the summary's worst "best" without the
            # clients and accountants that cannot give it (Ledger._worst_best, and basic and
            # advanced composition where their plain estimate already loses), which cost seconds
            # (a quick FedKADP's whole summary 16 s); equal to the summary's on every ledger tested
            eps = result.ledger.account(delta).epsilon
            facts = guarantee_facts(result.ledger.delta_split(delta))
        except ValueError as exc:  # an event no accountant handles: say so, do not hide it
            eps, note = math.nan, str(exc)
    rule = formal_dp_status(
        claims_dp=claims_dp,
        epsilon=None if math.isnan(eps) else eps,
        delta=delta,
        n_min=n_min,
        error=note,
        **facts,
    )
    void = (
        isinstance(claimed, (int, float))
        and not isinstance(claimed, bool)
        and 0 < claimed < 1
        and not meaningful
    )
    return {
        "epsilon": _finite(eps),
        "epsilon_infinite": math.isinf(eps),
        "delta": delta,
        "accountant": "best",
        "accounting_error": note,
        "formal_dp": rule.formal,
        "formal_dp_label": rule.label,
        "formal_dp_reason": rule.reason,
        "claim_void": void,
    }


def run_training(resolved: dict[str, Any], out: Path, progress: bool = True) -> dict[str, Any]:
    """Build the federation, train, and write the run directory; return a summary dict."""
    from privkit.data import build_federation
    from privkit.files import staged_dir, write_json
    from privkit.flower_engine.engine import train

    fed_cfg, cfg = resolved["federation"], resolved["trainer"]
    federation = build_federation(fed_cfg)
    start = time.perf_counter()
    with staged_dir(out) as staging:  # an interrupted or failed run leaves `out` as it was
        write_json(staging / "config.json", _config_json(resolved))
        federation.save(staging / "federation.json")
        result = train(
            resolved["method"],
            federation,
            cfg,
            seed=resolved["seed"],
            progress=progress,
            engine=resolved.get("engine", "inprocess"),
        )
        result.save(staging)
    return training_summary(result, federation, out, time.perf_counter() - start)


def stored_summary(out: Path) -> dict[str, Any]:
    """The summary of the finished run in ``out`` (nothing trained)."""
    from privkit.data import Federation
    from privkit.trainers import TrainResult

    summary = training_summary(
        TrainResult.load(out), Federation.load(out / "federation.json"), out, 0.0
    )
    return {**summary, "already_trained": True}


def training_summary(result, federation, out: Path, seconds: float) -> dict[str, Any]:
    from privkit.trainers import get_trainer

    head = _headline(result, federation, get_trainer(result.method).formal_dp)
    return {
        "method": result.method,
        "seed": result.seed,
        "run_dir": str(out),
        "test_accuracy": float(result.test_accuracy),
        "rounds": len(result.rounds),
        "chance_accuracy": _finite(result.chance_accuracy),
        "near_chance": result.near_chance,
        "seconds": round(seconds, 2),
        **head,
        "claims": {k: v for k, v in result.claims.items() if k != "mechanisms"},
        "warnings": result.warnings,
        "artifacts": sorted(result.artifacts),
        **result.ledger.noise_stamp(),
        "files": sorted(p.name for p in out.iterdir() if not p.name.startswith(".")),
    }


def _print_list(rows: list[dict[str, Any]]) -> None:
    table = Table(
        title="registered methods (privkit train METHOD; defaults: privkit train --list --json)"
    )
    for col in ("method", "claims DP", "summary", "paper"):
        table.add_column(col, overflow="fold")
    for r in rows:
        claims = f"yes ({r['level']}-level)" if r["formal_dp"] else "no"
        table.add_row(r["name"], claims, r["summary"], r["paper"] or "")
    out_console.print(table)


@app.command("train")
def train_command(
    method: str | None = typer.Argument(None, help="Method name (see --list)."),
    config: Path | None = typer.Option(
        None, "--config", help="TOML file: method, seed, \\[federation], \\[trainer]."
    ),
    sets: list[str] = typer.Option([], "--set", help="Trainer override key=value (repeatable)."),
    federation_sets: list[str] = typer.Option(
        [], "--federation-set", help="Federation override key=value (repeatable)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Trainer seed (default: file's or 0)."),
    quick: bool = typer.Option(
        False, "--quick", help="Start from the method's CPU-sized quick settings."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Run directory to write (new or empty; an earlier run only with --force).",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Replace the finished run in --out (it is kept until the new one is complete).",
    ),
    list_: bool = typer.Option(False, "--list", help="List the registered methods and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    reproducible_noise: bool = typer.Option(
        False,
        "--reproducible-noise",
        help="Derive DP noise and sampling from the seed (bit-reproducible; "
        "the ledger and outputs say 'reproducible noise: not for release'). Default: AES-CTR keyed from OS entropy, never stored.",
    ),
    engine: str | None = typer.Option(
        None,
        "--engine",
        help="Where the federation runs: inprocess (default: privkit's own, no start-up) or "
        "flower (the method's Flower ServerApp/ClientApp on Flower's simulation engine; fedavg, fedprox, "
        "dp-fedavg, fedkadp, fedauxfdp). Default: the config file's engine, else inprocess.",
    ),
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
    from privkit.files import recover_dir, run_lock, tidy_after_crash

    check_out_dir(
        out, force
    )  # a bad --out is named before the config is even read (structure only)
    resolved = resolve_run(
        method, config, sets, federation_sets, seed, quick, reproducible_noise, engine
    )
    with run_lock(out, say_warning):  # one `privkit train` per directory; released if this one dies
        recover_dir(out)  # a swap a crash interrupted
        if out.is_dir():
            tidy_after_crash(out)
        done = check_out_dir(out, force, _config_json(resolved))
        summary = stored_summary(out) if done else run_training(resolved, out, progress=not as_json)
    if as_json:
        print_json({"schema_version": SCHEMA_VERSION, **summary})
        return
    eps = "inf" if summary["epsilon_infinite"] else f"{summary['epsilon']:.4g}"
    if summary.get("already_trained"):
        out_console.print(
            f"{out} already holds this run (same config, checksums verified): nothing trained",
            highlight=False,
        )
    out_console.print(
        f"[bold]{summary['method']}[/bold] seed {summary['seed']}: test accuracy "
        f"{summary['test_accuracy']:.4f} after {summary['rounds']} round(s), {summary['seconds']} s"
    )
    out_console.print(
        escape(
            f"worst-client epsilon at delta={summary['delta']:g} (best accountant): "
            f"{eps}; formal DP: {summary['formal_dp_label']}"
            + (f" ({summary['formal_dp_reason']})" if summary["formal_dp_reason"] else "")
        ),
        highlight=False,
    )
    if summary["claims"]:
        c = summary["claims"]
        void = " (delta >= 1/n: not a meaningful guarantee)" if summary["claim_void"] else ""
        out_console.print(
            escape(
                f"paper's claim: epsilon={c.get('epsilon')}, delta={c.get('delta')}{void} "
                f"({c.get('composition')}; {c.get('source')})"
            ),
            highlight=False,
        )
    for w in summary["warnings"]:
        tag = (
            "[bold red]warning:[/bold red]"
            if w.startswith("near-chance")
            else "[yellow]note:[/yellow]"
        )
        out_console.print(f"{tag} {escape(w)}", highlight=False)
    out_console.print(f"wrote {summary['run_dir']}: {', '.join(summary['files'])}")
