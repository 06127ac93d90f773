"""Root typer application and the one-line error handler shared by every command.

Start-up matters: this module and every command module import only typer, rich and the standard
library at import time; torch, opacus, catboost, ray, dp-accounting and matplotlib are imported
inside the commands that need them (measured in ``benchmarks/startup.py``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
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
    # explicit, so help renders the same with every typer release; help strings escape "[" as "\["
    rich_markup_mode="rich",
)

err_console = Console(stderr=True)
out_console = Console()

INTERRUPTED = "interrupted; re-run the same command to resume"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"privkit {privkit.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Show the version and exit.",
        callback=_version_callback,
        is_eager=True,
    ),
) -> None:
    """privkit: what a pipeline promises (accountants), what it leaks (audits), what it costs."""


def print_json(obj: Any) -> None:
    """Write one strict JSON object to stdout (no rich markup, no bare Infinity: it can be piped to jq)."""
    from privkit.jsonutil import json_default, strict

    sys.stdout.write(
        json.dumps(strict(obj), indent=2, allow_nan=False, default=json_default) + "\n"
    )


def one_line(exc: BaseException) -> str:
    """Collapse an error to a single line (pydantic errors list every bad field)."""
    if type(exc).__name__ == "ValidationError" and hasattr(exc, "errors"):  # pydantic, not imported
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "config"
            parts.append(f"{loc}: {err['msg']} (found {err.get('input')!r})")
        return "invalid config: " + "; ".join(parts)
    if type(exc) is KeyError and exc.args:  # str(KeyError) is just the quoted key
        return f"missing key {exc.args[0]!r}"
    return " ".join(str(exc).split()) or type(exc).__name__


# ------------------------------------------------------------------------------- usage errors
# typer <= 0.2x raises the exceptions of the external `click` package; later releases vendor
# click as `typer._click`. Both hierarchies are found from typer's own re-export (BadParameter),
# so neither package is imported by name.
def _click_class(
    name: str,
) -> Any:  # a click exception class (click's own API: format_message, show)
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == name:
            return cls
    raise RuntimeError(f"typer.BadParameter has no {name} base")  # pragma: no cover


def _found_value(exc: BaseException, args: Sequence[str]) -> str | None:
    """The value a user gave to the parameter of a click ``BadParameter``, if it can be found."""
    cause = exc.__cause__
    if cause is not None and hasattr(cause, "errors"):  # typer >= 0.2x coerces through pydantic
        try:
            errors = cause.errors()
            if errors and "input" in errors[0]:
                return str(errors[0]["input"])
        except Exception:  # pragma: no cover - a foreign ValidationError shape
            pass
    param = getattr(exc, "param", None)
    for opt in getattr(param, "opts", None) or ():
        if not opt.startswith("-"):
            continue
        for i, arg in enumerate(args):
            if arg == opt and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(opt + "="):
                return arg[len(opt) + 1 :]
    return None


def usage_message(exc: Any, args: Sequence[str]) -> str:
    """One line for a click usage error: the command, the option and the value found."""
    ctx: Any = getattr(exc, "ctx", None)
    where = (
        f"{ctx.command_path}: " if ctx is not None and getattr(ctx, "command_path", None) else ""
    )
    text = " ".join(exc.format_message().split())
    if isinstance(exc, _click_class("BadParameter")) and type(exc).__name__ != "MissingParameter":
        value = _found_value(exc, args)
        if value is not None and not re.search(rf"(?<![\w.-]){re.escape(value)}(?![\w.-])", text):
            text = f"{text.rstrip('.')}; found {value!r}"
    hint = f" (see {ctx.command_path} --help)" if where else ""
    return f"{where}{text}{hint}"


def _say_error(message: str) -> None:
    from rich.markup import escape

    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point.

    Exit codes: 0 success, 1 a stage failed (the command says which), 2 bad input (one red line
    naming the parameter and the value found), 130 interrupted (finished stages stay on disk).
    Freed memory stays in the process and its workers for the next step
    (:func:`privkit.memory.keep_freed_memory`).
    """
    from privkit.memory import keep_freed_memory

    keep_freed_memory()
    args = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    usage_error, click_error = _click_class("UsageError"), _click_class("ClickException")
    try:
        # click's own main() would turn Ctrl-C into exit 0 or "Aborted!" depending on the release;
        # invoking the command directly leaves every outcome to the handlers below
        with command.make_context("privkit", args) as ctx:
            command.invoke(ctx)
    except KeyboardInterrupt:
        err_console.print(f"[yellow]{INTERRUPTED}[/yellow]", highlight=False)
        sys.exit(EXIT_INTERRUPTED)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):
            err_console.print(f"[yellow]{INTERRUPTED}[/yellow]", highlight=False)
            sys.exit(EXIT_INTERRUPTED)
        _say_error("aborted")
        sys.exit(1)
    except usage_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `privkit budget` alone: the group's help
            exc.show()
            sys.exit(exc.exit_code)
        _say_error(usage_message(exc, args))
        sys.exit(EXIT_USAGE)
    except click_error as exc:
        _say_error(" ".join(exc.format_message().split()))
        sys.exit(getattr(exc, "exit_code", 1))
    except (ValueError, OSError, KeyError) as exc:
        # PrivkitError and pydantic's ValidationError are ValueErrors; OSError names its file
        _say_error(one_line(exc))
        sys.exit(EXIT_USAGE)
