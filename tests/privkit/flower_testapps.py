"""Small Flower apps (flwr 1.42 Message API) for the privkit.flower tests: a 4-parameter numpy
"model" whose clients move it by a partition-dependent step (norm well above the clip norms used),
so clipping and noise are what the tests look at."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

N_PARAMS = 4


def client_app(
    mods: list | None = None,
    on_train: Callable[[Any, int], None] | None = None,
    weights: Callable[[int], int] | None = None,
):
    """A ClientApp whose update is ``(partition-id + 1) * [1, 1, 1, 1]``; ``on_train(pid)`` runs
    inside the train function (to record mechanisms); ``weights(pid)`` is its ``num-examples``."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp(mods=list(mods or []))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        if on_train is not None:
            on_train(pid)
        new = [a + (pid + 1.0) for a in arrays]
        n = weights(pid) if weights is not None else 10
        return Message(
            RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": n})}),
            reply_to=msg,
        )

    return app


def server_app(make_strategy: Callable[[], Any], rounds: int, sink: dict):
    """A ServerApp running ``make_strategy()`` for ``rounds``; ``sink`` gets the strategy and result."""
    from flwr.app import ArrayRecord, Context
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = make_strategy()
        sink["strategy"] = strategy
        sink["result"] = strategy.start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(N_PARAMS)]), num_rounds=rounds
        )

    return app


def report_row(runs: Any, name: str) -> str:
    """``privkit report <runs> --rebuild``, then the summary row of the run ``name`` in report.md."""
    from pathlib import Path

    from typer.testing import CliRunner

    from privkit.cli import app as cli

    res = CliRunner().invoke(cli, ["report", str(runs), "--rebuild"])
    assert res.exit_code == 0, res.output
    lines = (Path(runs) / "report.md").read_text().splitlines()
    return next(line for line in lines if line.startswith(f"| {name} |"))
