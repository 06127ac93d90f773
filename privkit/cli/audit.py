"""``privkit audit``: membership (and attribute) inference with an empirical epsilon and a verdict.

Two forms: ``privkit audit RUN_DIR`` audits a privkit run directory (writes ``RUN_DIR/audit.json``);
``privkit audit --recipe module:function --data file.npz`` audits any training recipe
``train_fn(x, y, seed) -> model`` on the pool ``(x, y)`` held in the ``.npz`` file
(:func:`attacks.audit_recipe`; writes ``--out``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from privkit.cli.app import app, out_console, print_json
from privkit.errors import PrivkitError


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def load_recipe(spec: str):
    """``module:function`` -> the function (the current directory is importable, like ``python -m``)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(
            f"recipe must be module:function (e.g. my_training:train_fn); found {spec!r}"
        )
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"recipe module {module!r} cannot be imported: {exc}") from exc
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"recipe {spec!r}: module {module} has no callable {name!r}")
    return fn


def load_pool(path: Path):
    """The pool ``(x, y)`` from a ``.npz`` file with arrays ``x`` and ``y``."""
    import numpy as np

    if not path.is_file():
        raise FileNotFoundError(f"data must be an existing .npz file; found {path}")
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("x", "y") if k not in z.files]
        if missing:
            raise ValueError(f"data {path} must hold arrays x and y; found {sorted(z.files)}")
        return z["x"], z["y"]


def _check_options(executor: str, delta: float | None, run_dir: Path | None = None) -> None:
    """Everything checkable before the audit layer (and torch) is imported."""
    from privkit.files import read_json
    from privkit.pipeline.config import check_executor

    if run_dir is not None:
        if not run_dir.is_dir():
            raise PrivkitError(f"run_dir must be an existing directory; found {run_dir}")
        if not (run_dir / "config.json").is_file():
            raise PrivkitError(
                f"run_dir must hold a trained run (config.json); found none in "
                f"{run_dir} (run `privkit train` first)"
            )
        read_json(
            run_dir / "config.json", "run config"
        )  # a corrupted file is named before any work
    check_executor(executor, "--executor")
    if delta is not None and not 0 < delta < 1:
        raise PrivkitError(f"--delta must be in (0, 1); found {delta}")


def _outcome(entry: dict, width: int | None = None) -> str:
    """Markup for an attack that did not run: red when it failed, grey with the reason when it
    does not apply to this method (not a failure)."""
    cut = (lambda t: t[:width]) if width else (lambda t: t)
    if entry.get("error"):
        return f"[red]failed:[/red] {escape(cut(entry['error']))}"
    if entry.get("not_applicable"):
        return f"[grey50]not applicable: {escape(cut(entry['not_applicable']))}[/grey50]"
    return ""


def _attack_table(title: str, attacks: dict) -> Table:
    table = Table(title=escape(title))
    for col in (
        "attack",
        "AUC",
        "bal. acc",
        "TPR@0.1%",
        "TPR@1%",
        "eps lower bound",
        "ceiling",
        "note",
    ):
        table.add_column(col)
    for name, r in attacks.items():
        tpr = r.get("tpr_at_fpr") or {}
        table.add_row(
            escape(name),
            _fmt(r.get("auc")),
            _fmt(r.get("balanced_accuracy")),
            _fmt(tpr.get("0.001")),
            _fmt(tpr.get("0.01")),
            _fmt(r.get("epsilon_lower_bound")),
            _fmt(r.get("ceiling")),
            _outcome(r, width=60),
        )
    return table


def _print_verdict(v: dict, accounted, delta: float) -> None:
    out_console.print(f"accounted epsilon: {_fmt(accounted)} at delta={delta:g}", highlight=False)
    color = {"violation": "bold red", "consistent": "green"}.get(v["status"], "yellow")
    out_console.print(
        f"family-wise lower bound {_fmt(v.get('epsilon_lower_bound'))}, ceiling "
        f"{_fmt(v.get('epsilon_ceiling'))}, detectable epsilon {_fmt(v.get('detectable_epsilon'))} "
        f"(confidence {_fmt(v.get('confidence'))} for the family)",
        highlight=False,
    )
    out_console.print(
        f"verdict: [{color}]{escape(v['status'])}[/{color}] - {escape(v['message'])}",
        highlight=False,
    )


def _audit_recipe(
    recipe: str,
    data: Path,
    *,
    out: Path,
    epsilon,
    delta,
    shadows,
    executor,
    workers,
    seed,
    attacks,
    iterations,
    as_json,
) -> None:
    _check_options(executor, delta)
    from attacks import audit_recipe

    x, y = load_pool(data)
    res = audit_recipe(
        load_recipe(recipe),
        x,
        y,
        accounted_epsilon=epsilon,
        delta=delta,
        shadows=shadows,
        seed=seed,
        executor=executor,
        workers=workers,
        progress=not as_json,
        attacks=attacks.split(",") if attacks else None,
        shadow_iterations=iterations,
    )
    record = {"schema_version": 1, "recipe": recipe, "data": str(data), **res.to_dict()}
    from privkit.files import write_json

    write_json(out, record)  # to_dict() is strict JSON already
    if as_json:
        print_json(record)
        return
    exp = res.experiment
    out_console.print(
        _attack_table(
            f"audit of {recipe} on {data} ({exp['pool']} records, "
            f"{exp['references']} reference models), delta={delta:g}",
            record["attacks"],
        )
    )
    out_console.print(
        f"target trained on {exp['target_train_size']} of {exp['pool']} records (fair coins); "
        f"reference models on {exp['reference_train_size']['mean']:.0f} on average"
        if exp["reference_train_size"]
        else f"target trained on {exp['target_train_size']} of {exp['pool']} records (fair coins)",
        highlight=False,
    )
    for note in res.notes:
        out_console.print(escape(f"note: {note}"), highlight=False)
    _print_verdict(record, epsilon, delta)
    out_console.print(f"wrote {out}", highlight=False)


def _audit_run_dir(
    run_dir: Path, *, attacks, shadows, executor, workers, seed, n_audit, delta, iterations, as_json
) -> None:
    _check_options(executor, delta, run_dir)
    from privkit.audit import audit_run
    from privkit.audit.run import finished_audit
    from privkit.cli.train import say_warning
    from privkit.files import run_lock, tidy_after_crash

    asked = {
        "attacks": attacks,
        "shadows": shadows,
        "seed": seed,
        "n_audit": n_audit,
        "delta": delta,
        "shadow_iterations": iterations,
    }
    with run_lock(run_dir, say_warning):  # one writer per run directory; released if this one dies
        tidy_after_crash(run_dir)
        out = finished_audit(run_dir, **asked, say=say_warning)  # a finished audit is not redone
        if out is None:
            out = audit_run(
                run_dir,
                executor=executor,
                workers=workers,
                progress=not as_json,
                say=say_warning,
                **asked,
            )
        elif not as_json:
            out_console.print(
                f"{run_dir / 'audit.json'} already answers this audit (same settings, "
                "checksums verified): nothing re-run",
                highlight=False,
            )
    if as_json:
        print_json(out)
        return
    out_console.print(
        _attack_table(
            f"audit of {out['method']} ({run_dir}), {out['shadows']} reference runs, "
            f"delta={out['delta']:g}",
            out["attacks"],
        )
    )
    for name, r in out["attribute"].items():
        if r.get("error") or r.get("not_applicable"):
            out_console.print(f"attribute {escape(name)}: {_outcome(r)}", highlight=False)
        else:
            out_console.print(
                escape(
                    f"attribute {name}: accuracy {r['accuracy']:.3f} "
                    f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] vs chance "
                    f"{r['chance']:.3f} (n={r['n_test']})"
                ),
                highlight=False,
            )
    for w in out.get("warnings", []):
        out_console.print(f"[yellow]warning:[/yellow] {escape(w['message'])}", highlight=False)
    _print_verdict(out["verdict"], out["accounted_epsilon"], out["delta"])
    out_console.print(f"wrote {run_dir / 'audit.json'}", highlight=False)


@app.command("audit")
def audit(
    run_dir: Path | None = typer.Argument(
        None,
        help="Run directory written by `privkit train` / `privkit run` "
        "(or use --recipe and --data).",
    ),
    recipe: str | None = typer.Option(
        None,
        "--recipe",
        help="Audit a training recipe module:function, train_fn(x, y, seed) -> model.",
    ),
    data: Path | None = typer.Option(
        None, "--data", help="With --recipe: .npz file with arrays x and y (the pool)."
    ),
    epsilon: float | None = typer.Option(
        None,
        "--epsilon",
        help="With --recipe: the epsilon the recipe claims at --delta (default: no claim).",
    ),
    out: Path = typer.Option(
        Path("audit.json"), "--out", help="With --recipe: where to write the result."
    ),
    attacks: str | None = typer.Option(
        None,
        "--attacks",
        help="Comma-separated (default: all). Run directory: threshold, shadow, "
        "lira, rmia, attribute. Recipe: threshold, shadow, lira, "
        "lira-offline, rmia, rmia-offline.",
    ),
    shadows: int | None = typer.Option(
        None,
        "--shadows",
        help="Reference runs of the recipe (even, >= 2; "
        "default 8 for a run directory, 16 for --recipe).",
    ),
    executor: str = typer.Option("serial", "--executor", help="serial | process | ray."),
    workers: int | None = typer.Option(
        None, "--workers", min=1, help="Worker processes / Ray CPUs."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Audit seed (audited records, coins, reference halves, run seeds)."
    ),
    n_audit: int | None = typer.Option(
        None,
        "--n-audit",
        min=10,
        help="Run directory: pool records audited, each included by a fair "
        "coin (default: the most that keeps the release's data size).",
    ),
    delta: float | None = typer.Option(
        None,
        "--delta",
        help="Delta in (0, 1) (default: the run's delta if below 1/n, else min(1e-5, 1/n)).",
    ),
    iterations: int = typer.Option(
        200, "--iterations", min=1, help="CatBoost iterations of the shadow attack."
    ),
    mechanisms: bool = typer.Option(
        False,
        "--mechanisms",
        help="Run directory: white-box audit at the method's DP mechanisms "
        "(canaries sampled, clipped and noised by each mechanism; tested "
        "against the ledger's claim); writes mechanism-audit.json.",
    ),
    canaries: int = typer.Option(
        1000, "--canaries", help="With --mechanisms: canaries per mechanism."
    ),
    mutation: str = typer.Option(
        "correct",
        "--mutation",
        help="With --mechanisms: audit a deliberately broken copy (noise x1/2, "
        "noise x1/N, clipping off, ledger steps x1/2, ledger rate x1/2).",
    ),
    clients: str | None = typer.Option(
        None, "--clients", help="With --mechanisms: probed clients, e.g. 0,3 or all (default 0)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Audit a run directory's method, or any training recipe, with fair-coin inclusion; write the result."""
    if (run_dir is None) == (recipe is None):
        raise ValueError(
            "give either RUN_DIR or --recipe module:function with --data; found "
            + ("both" if run_dir is not None else "neither")
        )
    if recipe is not None:
        if data is None:
            raise ValueError("--recipe needs --data FILE.npz (arrays x and y); found none")
        _audit_recipe(
            recipe,
            data,
            out=out,
            epsilon=epsilon,
            delta=1e-5 if delta is None else delta,
            shadows=16 if shadows is None else shadows,
            executor=executor,
            workers=workers,
            seed=seed,
            attacks=attacks,
            iterations=iterations,
            as_json=as_json,
        )
        return
    assert run_dir is not None  # exactly one of run_dir and recipe, checked above
    if mechanisms:
        from privkit.cli.audit_mechanisms import audit_run_mechanisms

        _check_options(executor, delta, run_dir)
        audit_run_mechanisms(
            run_dir,
            seed=seed,
            delta=delta,
            mutation=mutation,
            canaries=canaries,
            clients=clients,
            as_json=as_json,
        )
        return
    _audit_run_dir(
        run_dir,
        attacks=attacks,
        shadows=8 if shadows is None else shadows,
        executor=executor,
        workers=workers,
        seed=seed,
        n_audit=n_audit,
        delta=delta,
        iterations=iterations,
        as_json=as_json,
    )
