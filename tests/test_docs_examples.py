"""Every code example of the documentation runs and prints what its page shows.

The ```` ```python ```` blocks of one page under ``docs/`` (and of README.md) run one after the
other in one namespace. The comment lines that start in the first column right after a statement
are what it prints, one line each; text after the first ``": "`` explains the output and is not compared. A page whose
examples take long is marked ``<!-- examples: slow -->`` (a ``slow`` test). A page whose examples
another test runs says ``<!-- examples: tests/<path>.py -->``; that file must exist and read the
page. The ```` ```bash ```` blocks' ``privkit`` commands must parse: every command, option and
value is one ``privkit`` accepts (they are not run: they train, audit, or read files of a run),
and their ``make`` targets and ``python`` scripts exist.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
_MARKER = re.compile(r"^<!-- examples: (.+?) -->$", flags=re.M)


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of ``language`` in a Markdown text, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def expected_output(block: str) -> list[str]:
    """What the block says it prints: the first-column comments right after each statement."""
    lines = block.splitlines()
    out = []
    for stmt in ast.parse(block).body:
        i = stmt.end_lineno or stmt.lineno  # 1-based last line: lines[i] is the line after it
        while i < len(lines) and lines[i].startswith("# "):
            out.append(lines[i][2:].split(": ")[0])
            i += 1
    return out


def _marker(text: str) -> str | None:
    found = _MARKER.search(text)
    return found.group(1) if found else None


def _run_page(page: Path, capsys) -> None:
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    for n, block in enumerate(code_blocks(page.read_text(), "python"), 1):
        exec(compile(block, f"{page.name} (python block {n})", "exec"), namespace)
        printed = capsys.readouterr().out.splitlines()
        assert printed == expected_output(block), f"{page.name}, python block {n}"


def _params():
    for page in PAGES:
        text = page.read_text()
        if not code_blocks(text, "python"):
            continue
        marker = _marker(text)
        marks = [pytest.mark.slow] if marker == "slow" else []
        yield pytest.param(page, id=page.stem, marks=marks)


@pytest.mark.parametrize("page", list(_params()))
def test_page_examples_print_what_the_page_shows(page, capsys):
    marker = _marker(page.read_text())
    if marker not in (None, "slow"):
        for path in marker.split():
            test_file = ROOT / path
            assert test_file.is_file(), f"{page.name} names {path}, which does not exist"
            where = page.relative_to(ROOT).as_posix()
            assert where in test_file.read_text(), f"{path} does not read {where}"
        return
    _run_page(page, capsys)


def _privkit_commands():
    for page in PAGES:
        for block in code_blocks(page.read_text(), "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith("privkit "):
                    yield pytest.param(line.split("  #")[0].strip(), id=f"{page.stem}: {line[:60]}")


@pytest.mark.parametrize("command", list(_privkit_commands()))
def test_page_commands_parse(command):
    import click
    import typer

    from privkit.cli import app

    words = [w for w in shlex.split(command)[1:] if not (w.startswith("[") and w.endswith("]"))]
    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="privkit")
    cmd, args = group, words
    while isinstance(cmd, click.Group) and args and not args[0].startswith("-"):
        sub = cmd.get_command(ctx, args[0])
        assert sub is not None, f"no command {args[0]!r} in {command!r}"
        cmd, args = sub, args[1:]
    try:  # parse only: options, their types and the number of arguments
        cmd.make_context(cmd.name or "privkit", list(args), resilient_parsing=False)
    except click.exceptions.Exit:  # --help, --list: parsed
        pass
    except click.BadParameter as exc:  # a file of a run or of the user's (ledger.json, pool.npz)
        if "does not exist" not in exc.format_message():
            pytest.fail(f"{command!r}: {exc.format_message()}")
    except click.UsageError as exc:
        pytest.fail(f"{command!r}: {exc.format_message()}")


def _other_commands():
    for page in PAGES:
        for block in code_blocks(page.read_text(), "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip() and not line.startswith(("privkit ", "#")):
                    yield pytest.param(line.split("  #")[0].strip(), id=f"{page.stem}: {line[:60]}")


@pytest.mark.parametrize("command", list(_other_commands()))
def test_page_make_targets_and_scripts_exist(command):
    """A `make` target the Makefile declares, a `python` script of the repository, or Flower's
    own `flwr` command (installed with the flower extra, run against an app the page shows)."""
    words = shlex.split(command)
    if words[0] == "flwr":
        import shutil

        assert words[1] in ("run", "ls", "log", "stop", "build", "new"), (
            f"no flwr verb {words[1]!r}"
        )
        assert shutil.which("flwr") or (ROOT / ".venv/bin/flwr").is_file(), "flwr not installed"
    elif words[0] == "make":
        phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
        assert phony and words[1] in phony.group(1).split(), f"no make target {words[1]!r}"
    else:
        assert words[0] == "python" and (ROOT / words[1]).is_file(), (
            f"{command!r} runs nothing here"
        )
