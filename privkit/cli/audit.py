"""``privkit audit RUN_DIR``: membership / attribute inference and empirical epsilon for one run."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from privkit.cli.app import app, err_console, out_console, print_json
from privkit.errors import PrivkitError


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _check_options(run_dir: Path, executor: str, delta: float | None) -> None:
    """Everything checkable before the audit layer (and torch) is imported."""
    from privkit.executor import check_executor
    from privkit.jsonutil import read_json

    if not run_dir.is_dir():
        raise PrivkitError(f"run_dir must be an existing directory; found {run_dir}")
    if not (run_dir / "config.json").is_file():
        raise PrivkitError(f"run_dir must hold a trained run (config.json); found none in {run_dir} "
                           "(run `privkit train` first)")
    read_json(run_dir / "config.json", "run config")  # a corrupted file is named before any work
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


@app.command("audit")
def audit(
    run_dir: Path = typer.Argument(..., help="Run directory written by `privkit train` / `privkit run`."),
    attacks: str | None = typer.Option(None, "--attacks",
                                          help="Comma-separated: threshold,shadow,lira,one-run,attribute "
                                               "(default: all)."),
    shadows: int = typer.Option(8, "--shadows", help="Shadow runs of the recipe (even, >= 2)."),
    executor: str = typer.Option("serial", "--executor", help="serial | process | ray."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Worker processes / Ray CPUs."),
    seed: int = typer.Option(0, "--seed", help="Audit seed (audit points, mask, shadows, canaries)."),
    n_audit: int = typer.Option(500, "--n-audit", min=10,
                                help="Members and non-members audited (each); at most the run's "
                                     "training and test records (announced when capped)."),
    delta: float | None = typer.Option(None, "--delta", help="Delta in (0, 1) (default: the run's "
                                                             "delta or 1e-5)."),
    iterations: int = typer.Option(200, "--iterations", min=1,
                                   help="CatBoost iterations of the shadow attack."),
    as_json: bool = typer.Option(False, "--json", help="Print audit.json as one JSON object."),
) -> None:
    """Attack the released model of RUN_DIR with shadow runs of the same recipe; write audit.json."""
    _check_options(run_dir, executor, delta)
    from attacks.audit import audit_run

    out = audit_run(run_dir, attacks=attacks, shadows=shadows, executor=executor, workers=workers,
                    seed=seed, progress=not as_json, n_audit=n_audit, delta=delta,
                    shadow_iterations=iterations)
    used = (out.get("n_audit") or {}).get("members")
    if isinstance(used, int) and used < n_audit:  # a limit that changed what was asked: say so
        err_console.print(f"[yellow]note:[/yellow] audited {used} members and {used} non-members, "
                          f"fewer than --n-audit {n_audit}: the run has no more training or test "
                          "records to draw from", highlight=False, soft_wrap=True)
    if as_json:
        print_json(out)
        return
    table = Table(title=f"audit of {out['method']} ({run_dir}), {out['shadows']} shadow runs, "
                        f"delta={out['delta']:g}")
    for col in ("attack", "AUC", "bal. acc", "TPR@0.1%", "TPR@1%", "eps lower bound", "ceiling", "note"):
        table.add_column(col)
    for name, r in out["attacks"].items():
        tpr = r.get("tpr_at_fpr") or {}
        table.add_row(name, _fmt(r.get("auc")), _fmt(r.get("balanced_accuracy")), _fmt(tpr.get("0.001")),
                      _fmt(tpr.get("0.01")), _fmt(r.get("epsilon_lower_bound")), _fmt(r.get("ceiling")),
                      _outcome(r, width=60))
    out_console.print(table)
    for name, r in out["attribute"].items():
        if r.get("error") or r.get("not_applicable"):
            out_console.print(f"attribute {escape(name)}: {_outcome(r)}", highlight=False)
        else:
            out_console.print(escape(f"attribute {name}: accuracy {r['accuracy']:.3f} "
                                     f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] vs chance "
                                     f"{r['chance']:.3f} (n={r['n_test']})"), highlight=False)
    acc = out["accounted_epsilon"]
    out_console.print(f"accounted epsilon: {_fmt(acc)} at delta={out['delta']:g}", highlight=False)
    v = out["verdict"]
    color = {"violation": "bold red", "consistent": "green"}.get(v["status"], "yellow")
    out_console.print(f"family-wise lower bound {_fmt(v.get('epsilon_lower_bound'))}, ceiling "
                      f"{_fmt(v.get('epsilon_ceiling'))}, detectable epsilon {_fmt(v.get('detectable_epsilon'))} "
                      f"(confidence {_fmt(v.get('confidence'))} for the family)", highlight=False)
    out_console.print(f"verdict: [{color}]{escape(v['status'])}[/{color}] - {escape(v['message'])}",
                      highlight=False)
    out_console.print(f"wrote {run_dir / 'audit.json'}", highlight=False)
