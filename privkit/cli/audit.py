"""``privkit audit RUN_DIR``: membership / attribute inference and empirical epsilon for one run."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from privkit.cli.app import app, out_console, print_json


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


@app.command("audit")
def audit(
    run_dir: Path = typer.Argument(..., help="Run directory written by `privkit train` / `privkit run`."),
    attacks: str | None = typer.Option(None, "--attacks",
                                          help="Comma-separated: threshold,shadow,lira,one-run,attribute "
                                               "(default: all)."),
    shadows: int = typer.Option(8, "--shadows", help="Shadow runs of the recipe (even, >= 2)."),
    executor: str = typer.Option("serial", "--executor", help="serial | process | ray."),
    workers: int | None = typer.Option(None, "--workers", help="Worker processes / Ray CPUs."),
    seed: int = typer.Option(0, "--seed", help="Audit seed (audit points, mask, shadows, canaries)."),
    n_audit: int = typer.Option(500, "--n-audit", help="Members and non-members audited (each)."),
    delta: float | None = typer.Option(None, "--delta", help="Delta (default: the run's delta or 1e-5)."),
    iterations: int = typer.Option(200, "--iterations", help="CatBoost iterations of the shadow attack."),
    as_json: bool = typer.Option(False, "--json", help="Print audit.json as one JSON object."),
) -> None:
    """Attack the released model of RUN_DIR with shadow runs of the same recipe; write audit.json."""
    from privkit.audit import audit_run

    if not run_dir.is_dir():
        raise FileNotFoundError(f"run_dir must be an existing directory; found {run_dir}")
    out = audit_run(run_dir, attacks=attacks, shadows=shadows, executor=executor, workers=workers,
                    seed=seed, progress=not as_json, n_audit=n_audit, delta=delta,
                    shadow_iterations=iterations)
    if as_json:
        print_json(out)
        return
    table = Table(title=f"audit of {out['method']} ({run_dir}), {out['shadows']} shadow runs, "
                        f"delta={out['delta']:g}")
    for col in ("attack", "AUC", "bal. acc", "TPR@0.1%", "TPR@1%", "eps lower bound", "ceiling", "error"):
        table.add_column(col)
    for name, r in out["attacks"].items():
        tpr = r.get("tpr_at_fpr") or {}
        table.add_row(name, _fmt(r.get("auc")), _fmt(r.get("balanced_accuracy")), _fmt(tpr.get("0.001")),
                      _fmt(tpr.get("0.01")), _fmt(r.get("epsilon_lower_bound")), _fmt(r.get("ceiling")),
                      (r.get("error") or "")[:60])
    out_console.print(table)
    for name, r in out["attribute"].items():
        if r.get("error"):
            out_console.print(f"attribute {name}: [red]failed[/red] {r['error']}", highlight=False)
        else:
            out_console.print(f"attribute {name}: accuracy {r['accuracy']:.3f} "
                              f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] vs chance {r['chance']:.3f} "
                              f"(n={r['n_test']})", highlight=False)
    acc = out["accounted_epsilon"]
    out_console.print(f"accounted epsilon: {_fmt(acc)} at delta={out['delta']:g}", highlight=False)
    v = out["verdict"]
    color = {"violation": "bold red", "consistent": "green"}.get(v["status"], "yellow")
    out_console.print(f"family-wise lower bound {_fmt(v.get('epsilon_lower_bound'))}, ceiling "
                      f"{_fmt(v.get('epsilon_ceiling'))}, detectable epsilon {_fmt(v.get('detectable_epsilon'))} "
                      f"(confidence {_fmt(v.get('confidence'))} for the family)", highlight=False)
    out_console.print(f"verdict: [{color}]{v['status']}[/{color}] - {v['message']}", highlight=False)
    out_console.print(f"wrote {run_dir / 'audit.json'}", highlight=False)
