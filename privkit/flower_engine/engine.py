"""The Flower engine: privkit's methods run as Flower apps on Flower's simulation engine (Ray).

``privkit train METHOD --engine flower`` (or ``engine = "flower"`` in a run config) runs the method's
ServerApp and ClientApp (:mod:`privkit.flower_engine.apps`) with ``flwr.simulation.run_simulation``, one
Flower node per client. The server and client steps are the in-process trainer's own, so with
reproducible noise and the same seed the released model and the ledger are those of the in-process
run; in release mode only the noise differs. The in-process federation stays the default: it
starts no Ray cluster and moves no messages.

Nothing here imports Flower, Ray or torch at module level: checking an engine name stays cheap, and
``import privkit`` never needs Flower.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import pickle
import tempfile
from collections.abc import Iterator, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from privkit.config import ENGINES
from privkit.errors import PrivkitError
from privkit.methods import flower_methods

__all__ = [
    "DRIVERS",
    "ENGINES",
    "check_engine",
    "engine_entry",
    "federation_file",
    "method_app",
    "simulate",
    "train",
    "train_jobs_on_flower",
    "train_many_on_flower",
    "train_on_flower",
]


def check_engine(engine: str, method: str | None = None) -> None:
    """Refuse an unknown engine, a method the Flower engine does not run, or a missing Flower,
    before any work starts (one line naming the value found)."""
    if engine not in ENGINES:
        raise PrivkitError(f"engine must be one of {', '.join(ENGINES)}; found {engine!r}")
    if engine != "flower":
        return
    if method is not None and method not in flower_methods():
        raise PrivkitError(
            f"method {method} does not run on the Flower engine (it runs on: "
            f"{', '.join(flower_methods())}); found engine 'flower'"
        )
    missing = [m for m in ("flwr", "ray") if find_spec(m) is None]
    if missing:
        raise PrivkitError(
            f"engine flower needs {' and '.join(missing)}, not installed; found none "
            '(pip install "privkit-ml[flower]")'
        )


def engine_entry(engine: str) -> dict[str, str]:
    """A run directory's ``config.json`` entry for ``engine``: ``{"engine": "flower"}`` for a run on
    Flower (its audits then train on Flower too), nothing for the default in-process engine."""
    return {} if engine == "inprocess" else {"engine": engine}


@contextlib.contextmanager
def federation_file(federations: Sequence[Any]) -> Iterator[list[str]]:
    """Each federation pickled to a temporary file that the ClientApps load (Ray actors are other
    processes on this machine); removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="privkit-flower-") as d:
        paths = []
        for j, fed in enumerate(federations):
            path = Path(d) / f"federation-{j}.pkl"
            with open(path, "wb") as f:
                pickle.dump(fed, f, protocol=pickle.HIGHEST_PROTOCOL)
            paths.append(str(path))
        yield paths


def backend_config(client_cpus: float = 1.0) -> dict:
    """Flower's Ray backend settings: one CPU per ClientApp actor, Ray's dashboard off."""
    cpus = max(1, os.cpu_count() or 1)
    return {
        "client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cpus,
            "include_dashboard": False,
            "log_to_driver": False,
            "logging_level": logging.ERROR,
        },
    }


@contextlib.contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's INFO lines and its deprecation notice for ``run_simulation`` off; errors stay."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        yield
    finally:
        logger.setLevel(level)


#: how :func:`simulate` runs an app: Flower's simulation engine on Ray, or privkit's in-process
#: driver (:func:`privkit.flower.run_inprocess`: same apps, no Ray, nodes called one after another)
DRIVERS = ("ray", "inprocess")


def simulate(
    server_app, client_app, num_supernodes: int, *, backend: dict | None = None, driver: str = "ray"
) -> None:
    """Run a ServerApp/ClientApp pair, ``num_supernodes`` nodes, on Flower's simulation engine
    (``driver="ray"``: ``flwr.simulation.run_simulation``) or in this process (``"inprocess"``).

    On Ray the ServerApp runs in a thread of this process and sees this thread's context (an
    audit's probe session and mutation: :mod:`privkit.flower_engine.audit_transport`); the ClientApps run
    in Ray actors.
    """
    from flwr.serverapp import ServerApp

    if driver not in DRIVERS:
        raise PrivkitError(f"driver must be one of {', '.join(DRIVERS)}; found {driver!r}")
    ctx = contextvars.copy_context()
    wrapped = ServerApp()

    @wrapped.main()
    def main(grid, context):
        from privkit.flower_engine.audit_transport import audited_grid

        ctx.run(lambda: server_app(audited_grid(grid), context))

    if driver == "inprocess":
        from privkit.flower_engine.inprocess import run_inprocess

        run_inprocess(wrapped, client_app, num_supernodes)
        return
    from flwr.simulation import run_simulation

    with _quiet_flower():
        run_simulation(
            wrapped,
            client_app,
            num_supernodes=num_supernodes,
            backend_config=backend or backend_config(),
        )


def train_jobs_on_flower(jobs: Sequence[tuple[str, Any, Any, int]], progress: bool = False) -> list:
    """Each ``(method, federation, config, seed)`` job, all in ONE Flower simulation (one Ray start):
    the runs go one after the other through the same nodes, one node per client. Each result is
    what :func:`privkit.trainers.train` returns for the same inputs in-process (up to float
    rounding), with the same chance check and noise stamp."""
    from privkit.flower_engine.apps import make_port, privkit_client_app, privkit_server_app
    from privkit.methods import make_config
    from privkit.methods.contract import stamp_noise

    if not jobs:
        raise PrivkitError(
            "jobs must hold at least one (method, federation, config, seed); found none"
        )
    for method, *_ in jobs:
        check_engine("flower", method)
    cfgs = [make_config(method, config) for method, _, config, _ in jobs]
    feds = [fed for _, fed, _, _ in jobs]
    with federation_file(feds) as paths:
        ports = [
            make_port(method, fed, cfg, int(seed), progress)
            for (method, fed, _, seed), cfg in zip(jobs, cfgs)
        ]
        for port, path in zip(ports, paths):
            port.path = path
        results: list = []
        simulate(
            privkit_server_app(ports, results, progress),
            privkit_client_app(),
            max(f.num_clients for f in feds),
        )
    if len(results) != len(ports):
        raise PrivkitError(
            f"the Flower simulation must finish every run; found {len(results)} of {len(ports)}"
        )
    for res, (method, fed, _, _), cfg in zip(results, jobs, cfgs):
        if res.method != method:
            raise PrivkitError(f"trainer {method} returned a result labelled {res.method!r}")
        res.check_chance(fed)
        stamp_noise(res, cfg.reproducible_noise)
    return results


def train_many_on_flower(
    method: str,
    federations: Sequence[Any],
    config: Any,
    seeds: Sequence[int],
    progress: bool = False,
) -> list:
    """``method`` on each federation with its seed, in one Flower simulation (:func:`train_jobs_on_flower`)."""
    if len(federations) != len(seeds):
        raise PrivkitError(
            f"federations and seeds must have equal lengths; found {len(federations)} and {len(seeds)}"
        )
    return train_jobs_on_flower(
        [(method, fed, config, int(s)) for fed, s in zip(federations, seeds)], progress
    )


def method_app(method: str, federation, config: Any, seed: int, *, workdir: str | Path):
    """privkit's ``method`` on ``federation`` as a :class:`privkit.flower_engine.apps.FlowerApp` (the
    ServerApp, the ClientApp, one node per client, the result's model and ledger once run): what
    :func:`privkit.flower.audit.audit_app` and :func:`~privkit.flower.audit.audit_app_mechanisms`
    take. The federation file the ClientApps read is written under ``workdir``.

    Parameters
    ----------
    method : str
        A registered method that has a Flower form.
    federation : privkit.data.Federation
        The clients' data, public data and test set.
    config : dict or TrainerConfig
        The method's config or overrides of its defaults.
    seed : int
        The run seed.
    workdir : str or pathlib.Path
        Directory the federation file the ClientApps read is written to.

    Returns
    -------
    FlowerApp
    """
    from privkit.flower_engine.apps import (
        FlowerApp,
        make_port,
        privkit_client_app,
        privkit_server_app,
    )
    from privkit.methods import make_config

    check_engine("flower", method)
    port = make_port(method, federation, make_config(method, config), int(seed))
    path = Path(workdir) / f"federation-{method}-{int(seed)}-{id(port):x}.pkl"
    with open(path, "wb") as f:
        pickle.dump(federation, f, protocol=pickle.HIGHEST_PROTOCOL)
    port.path = str(path)
    results: list = []
    return FlowerApp(
        privkit_server_app([port], results),
        privkit_client_app(),
        federation.num_clients,
        model=lambda: results[0].model,
        ledger=lambda: results[0].ledger,
    )


def train_on_flower(
    method: str, federation, config: Any = None, seed: int = 0, progress: bool = False
):
    """``method`` on ``federation`` as a Flower simulation: :func:`privkit.trainers.train` on Flower.

    Parameters
    ----------
    method : str
        A registered method that has a Flower form.
    federation : privkit.data.Federation
        The clients' data, public data and test set.
    config : dict or TrainerConfig, optional
        The method's config or overrides of its defaults.
    seed : int
        The run seed.
    progress : bool
        Show a progress bar.

    Returns
    -------
    privkit.trainers.TrainResult
    """
    return train_many_on_flower(method, [federation], config, [seed], progress)[0]


def train(
    method: str,
    federation,
    config: Any = None,
    seed: int = 0,
    progress: bool = False,
    engine: str = "inprocess",
):
    """:func:`privkit.trainers.train` on the chosen engine (``inprocess``, the default, or ``flower``).

    In process, a method with a batched form trains through it, the round's clients together
    (:func:`privkit.batched.many.trains_batched_alone` says why)."""
    check_engine(engine, method)
    if engine == "flower":
        return train_on_flower(method, federation, config, seed, progress)
    from privkit.batched.many import train_one, trains_batched_alone
    from privkit.trainers import train as train_inprocess

    if trains_batched_alone(method, config):
        return train_one(method, federation, config, seed, progress)
    return train_inprocess(method, federation, config, seed=seed, progress=progress)
