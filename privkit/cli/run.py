"""``privkit run``, ``privkit report`` and ``privkit demo``: the one-command pipeline."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import typer

from privkit.cli.app import app, err_console, out_console, print_json
from privkit.errors import PrivkitError


def _log(enabled: bool):
    def say(msg: str) -> None:
        if enabled:
            err_console.print(f"[cyan]privkit[/cyan] {msg}", highlight=False)

    return say


def _finish(outcome, as_json: bool) -> None:
    html = outcome.paths.get("html") or next(iter(outcome.paths.values()))
    if as_json:
        print_json(
            {
                "run_dir": str(outcome.root),
                "report": {k: str(p) for k, p in outcome.paths.items()},
                "failures": outcome.failures,
                "seconds": round(outcome.seconds, 1),
            }
        )
    else:
        for f in outcome.failures:
            err_console.print(f"[red]failed:[/red] {f}", highlight=False, soft_wrap=True)
        out_console.print(
            f"report: [bold]{html}[/bold]  ({outcome.seconds:.0f} s; run directory {outcome.root})",
            highlight=False,
            soft_wrap=True,
        )
    if outcome.failures:
        raise typer.Exit(1)


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (first level of difference)."""
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed_keys(a, b, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


def check_run_dir(root: Path, resolved: dict, force: bool) -> None:
    """An existing run directory is resumed when its config is the same, refused otherwise
    (without ``--force``): re-running a changed config replaces the results it changes."""
    from privkit.cli.train import say_warning
    from privkit.files import read_json, verify

    path = root / "config.resolved.json"
    if force or not path.is_file():
        return
    problem = verify(path)
    if problem is not None:  # damaged: as if absent (the run writes it again)
        say_warning(f"{path}: {problem}; treated as absent and recomputed")
        return
    ignore = ("source", "overrides")  # where the config came from, not what it says
    old = {k: v for k, v in read_json(path, "run config").items() if k not in ignore}
    new = {
        k: v for k, v in json.loads(json.dumps(resolved, default=str)).items() if k not in ignore
    }
    changed = _changed_keys(old, new)
    if changed:
        shown = ", ".join(changed[:4]) + (
            f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        )
        raise PrivkitError(
            f"--out: {root} holds a run of a different config ({shown} changed); pass "
            "--force to update it (stages whose inputs did not change are kept) or "
            "give the run another name (--set name=...)"
        )


def _run(
    config: Path, overrides: list[str], out: str, quiet: bool, as_json: bool, force: bool = False
) -> None:
    from privkit.pipeline import load_run_config, run_pipeline

    resolved = load_run_config(config, overrides)  # every error here comes before any work
    check_run_dir(Path(out) / resolved.config.name, resolved.to_dict(), force)
    command = "privkit " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    outcome = run_pipeline(
        resolved, out, progress=not (quiet or as_json), log=_log(not as_json), command=command
    )
    _finish(outcome, as_json)


@app.command("run")
def run_cmd(
    config: Path = typer.Argument(
        ..., help="Run config (TOML): name, seed, delta, federation, methods, audit, report."
    ),
    set_: list[str] | None = typer.Option(
        None, "--set", help="Override a config key, e.g. --set audit.shadows=2 (repeatable)."
    ),
    out: str = typer.Option("runs", "--out", help="Parent folder of the run directory."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Update a run directory written by a different config (unchanged stages are kept).",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars (stage lines only)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (paths, failures)."),
    reproducible_noise: bool = typer.Option(
        False,
        "--reproducible-noise",
        help="Derive every method's DP noise from its seed (bit-reproducible; "
        "ledgers and the report say 'reproducible noise: not for release'). Default: AES-CTR keyed from OS entropy, never stored.",
    ),
) -> None:
    """Train, account, audit and report every method of CONFIG into OUT/<name>/.

    Re-running the same config skips finished stages: an interrupted run (Ctrl-C, exit code 130)
    resumes. A run directory of a different config is refused unless --force. Exit code 1 if a
    stage failed (the report still shows the others), 2 for a bad config.
    """
    overrides = list(set_ or []) + (["reproducible_noise=true"] if reproducible_noise else [])
    _run(config, overrides, out, quiet, as_json, force)


@app.command("demo")
def demo_cmd(
    set_: list[str] | None = typer.Option(
        None, "--set", help="Override a config key of the bundled quickstart config (repeatable)."
    ),
    out: str = typer.Option("runs", "--out", help="Parent folder of the run directory."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Update a run directory written by a different config (unchanged stages are kept).",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars (stage lines only)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (paths, failures)."),
) -> None:
    """Run the bundled quickstart config: every method on the embedded data, CPU-sized.

    Same as `privkit run <privkit>/configs/quickstart.toml`; prints where the report is.
    """
    from privkit.pipeline import bundled_config

    _run(bundled_config("quickstart"), list(set_ or []), out, quiet, as_json, force)


@app.command("report")
def report_cmd(
    run_dir: Path = typer.Argument(
        ..., help="A pipeline run directory (holding report.json or config.resolved.json)."
    ),
    rebuild: bool = typer.Option(
        False,
        "--rebuild",
        help="Rebuild report.json from the method run directories instead of re-rendering it.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (paths)."),
) -> None:
    """Re-render report.html and report.md from report.json (or rebuild it from the run)."""
    from privkit.cli.train import say_warning
    from privkit.files import run_lock
    from privkit.pipeline import rerender

    if not run_dir.is_dir():  # named before a lock file is made beside it
        raise PrivkitError(f"run directory not found: {run_dir}")
    with run_lock(run_dir, say_warning):  # not while `privkit run` writes the same report
        report, paths = rerender(run_dir, rebuild=rebuild)
    if as_json:
        print_json(
            {
                "run_dir": str(run_dir),
                "report": {k: str(p) for k, p in paths.items()},
                "methods": [m.name for m in report.methods],
            }
        )
        return
    for kind, p in paths.items():
        out_console.print(f"{kind}: {p}", highlight=False, soft_wrap=True)
