"""One progress display for every long loop (rich; silent when disabled): reference-model training
here, and privkit's trainers (:mod:`privkit.progress` re-exports it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Any]:
    """A rich progress display (disabled: a silent one with the same interface).

    Tasks carry an ``info`` field (free text shown after the timer); it defaults to empty.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not enabled,
    )
    orig_add = bar.add_task

    def add_task(description: str, **kwargs: Any) -> Any:
        kwargs.setdefault("info", "")
        return orig_add(description, **kwargs)

    bar.add_task = add_task  # type: ignore[method-assign,assignment]  # same call, info defaulted
    with bar:
        yield bar
