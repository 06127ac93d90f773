"""Root typer application and the one-line error handler shared by every command."""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console

import privkit

app = typer.Typer(
    name="privkit",
    help="Privacy accounting and auditing of private (federated) machine learning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

err_console = Console(stderr=True)
out_console = Console()


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"privkit {privkit.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Show the version and exit.", callback=_version_callback, is_eager=True
    ),
) -> None:
    """privkit: what a pipeline promises (accountants), what it leaks (audits), what it costs."""


def print_json(obj: Any) -> None:
    """Write one strict JSON object to stdout (no rich markup, no bare Infinity: it can be piped to jq)."""
    from privkit.jsonutil import json_default, strict

    sys.stdout.write(json.dumps(strict(obj), indent=2, allow_nan=False, default=json_default) + "\n")


def _one_line(exc: BaseException) -> str:
    """Collapse an error to a single line (pydantic errors list every bad field)."""
    try:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            parts = []
            for err in exc.errors():
                loc = ".".join(str(p) for p in err["loc"]) or "config"
                parts.append(f"{loc}: {err['msg']} (found {err.get('input')!r})")
            return "invalid config: " + "; ".join(parts)
    except ImportError:  # pragma: no cover - pydantic is a hard dependency
        pass
    return " ".join(str(exc).split()) or type(exc).__name__


def main() -> None:
    """Console-script entry point: user errors become one red line and exit code 2."""
    from pydantic import ValidationError

    try:
        app(standalone_mode=False)
    except (ValueError, FileNotFoundError, KeyError, ValidationError) as exc:
        err_console.print(f"[red]error:[/red] {_one_line(exc)}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("[red]aborted[/red]")
        sys.exit(1)
    except Exception as exc:  # click usage errors carry their own exit code
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
