"""privkit's federated methods as a Flower ServerApp and ClientApp.

The server side of a method (client sampling, accounting, aggregation, evaluation, the budget
check) is the in-process trainer's own run object, stepped round by round: :class:`~privkit.trainers.fedavg.FederatedRun`
(fedavg, fedprox), :class:`~privkit.trainers.dp_fedavg.DpFedRun` (dp-fedavg, fedkadp) and the DP-head setup and result of
fedauxfdp. Each round the ServerApp sends every sampled client a ``train`` message with the global
model and the round's parameters, and the ClientApp on the node holding that client's records runs
the trainer's own client step on them (:func:`privkit.trainers.fedavg.local_update`,
:func:`privkit.trainers.dp_fedavg.local_update`, :func:`privkit.trainers.fedauxfdp.release_client_heads`),
seeded by the same derivation from the run seed as in-process. The records never leave the
ClientApp; the server reads the clients' sizes from the federation layout, as the in-process run
does (the accountant's sampling rate ``B / n_k`` needs them).

A node learns which client it is from Flower's ``partition-id``; the ServerApp asks every node once
(a ``query`` message) and addresses each client's messages to its node. One simulation may carry
several runs one after the other (an audit's target and reference runs): each message names the
run's federation file, which the ClientApp loads once per process.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from privkit.errors import PrivkitError
from privkit.methods import flower_methods, get_trainer, make_config

TASK = "privkit.task"  # ConfigRecord: what the client is asked to do
MODEL = "privkit.model"  # ArrayRecord: the global model (or h0) the client starts from
EXTRA = "privkit.extra"  # ArrayRecord: public arrays the round needs (fedauxfdp: center, negatives)
UPDATE = "privkit.update"  # ArrayRecord: what the client sends back
REPORT = "privkit.report"  # ConfigRecord: the client's scalar report (loss, released events, info)
RECEIPTS = (
    "receipts"  # in REPORT: the client's release receipts (privkit.mechanisms.gaussian), JSON
)
NODE_WAIT_S = 120.0  # how long the ServerApp waits for the simulation's nodes to register


@dataclass
class FlowerApp:
    """A Flower app set up on given records, as :func:`privkit.flower.audit.audit_app` runs it.

    Attributes
    ----------
    server_app : flwr.server.ServerApp
        The app's server side.
    client_app : flwr.client.ClientApp
        The app's client side (a ClientApp running privkit DP mechanisms takes
        :func:`~privkit.flower.audit_mod` among its mods so that its mechanisms can be probed).
    num_supernodes : int
        The simulation's nodes (one per client).
    model : callable
        Called once the simulation has run: the released model (a torch module returning
        logits, a scikit-learn classifier or a callable returning probabilities).
    ledger : callable or None
        Called once the simulation has run: the run's :class:`accountants.Ledger` (``None``:
        the app keeps none; a mechanism audit needs one).
    """

    server_app: Any
    client_app: Any
    num_supernodes: int
    model: Callable[[], Any]
    ledger: Callable[[], Any] | None = None


# ----------------------------------------------------------------------------- encoding
def _arrays(d: dict[str, Any]):
    """``{name: tensor or array}`` as a Flower ArrayRecord (exact: raw bytes with dtype and shape)."""
    import torch
    from flwr.app import ArrayRecord

    return ArrayRecord(
        {
            k: torch.as_tensor(np.asarray(v))
            if not isinstance(v, torch.Tensor)
            else v.detach().cpu()
            for k, v in d.items()
        }
    )


def _tensors(record) -> dict:
    return dict(record.to_torch_state_dict())


def _config(d: dict[str, Any]):
    from flwr.app import ConfigRecord

    return ConfigRecord({k: v for k, v in d.items() if v is not None})


@lru_cache(maxsize=32)
def load_federation(path: str):
    """The federation a run's messages name, loaded once per process (written by the driver:
    :func:`privkit.flower_engine.engine.federation_file`)."""
    with open(path, "rb") as f:
        return pickle.load(f)


def _frozen(model) -> list[str]:
    return [k for k, p in model.named_parameters() if not p.requires_grad]


def _model_from(task, record):
    """The model a task describes: its spec, its state, and which parameters are frozen."""
    from privkit.models import build_from_spec

    model = build_from_spec(json.loads(task["spec"]))
    model.load_state_dict(_tensors(record))
    frozen = set(json.loads(task["frozen"]))
    for k, p in model.named_parameters():
        if k in frozen:
            p.requires_grad_(False)
    return model


# ----------------------------------------------------------------------------- server side: ports
class Port(ABC):
    """One privkit run seen from the ServerApp: which clients take part next, what each is sent,
    and what the server does with their replies. The in-process trainer's run object does the work."""

    method: str
    federation: Any
    path: str = ""

    @abstractmethod
    def next_round(self) -> list[int] | None:
        """The clients of the next round, or None when the run has ended."""

    @abstractmethod
    def task(self, k: int) -> tuple[dict, dict, dict]:
        """(config, model arrays, extra arrays) for client ``k`` this round."""

    @abstractmethod
    def finish_round(self, replies: dict[int, tuple[dict, dict]]) -> None:
        """The server's side of the round, from each client's (metrics, arrays) reply."""

    @abstractmethod
    def result(self):
        """The run's :class:`~privkit.trainers.TrainResult` once it has ended."""

    @property
    def rounds_total(self) -> int:
        """The rounds the run has at most (it may stop earlier: a budget)."""
        return int(getattr(self.cfg, "rounds", 1))

    def common(self, model, round_: int) -> dict:
        return {
            "method": self.method,
            "config": json.dumps(self.cfg.model_dump(mode="json")),
            "seed": int(self.seed),
            "round": int(round_),
            "federation": self.path,
            "spec": json.dumps(self.spec),
            "frozen": json.dumps(_frozen(model)),
        }


class FedAvgPort(Port):
    """fedavg / fedprox: :class:`privkit.trainers.fedavg.FederatedRun` between rounds."""

    def __init__(self, method: str, federation, cfg, seed: int, progress: bool = False):
        from privkit.trainers.fedavg import fedavg_run

        self.method, self.federation, self.cfg, self.seed = method, federation, cfg, seed
        self.run, self.finish = fedavg_run(federation, cfg, seed, progress, method=method)
        self.spec = self.run.spec

    def next_round(self):
        return self.run.next_round()

    def task(self, k):
        return (
            {**self.common(self.run.model, self.run.t), "mu": float(self.run.mu)},
            self.run.model.state_dict(),
            {},
        )

    def finish_round(self, replies):
        from privkit.models import build_from_spec

        trained = []
        for k in self.run.selected:
            arrays, report = replies[k]
            local = build_from_spec(self.spec)
            local.load_state_dict(arrays)
            trained.append((local.to(self.run.device), float(report["loss"])))
        self.run.finish_round(trained)

    def result(self):
        return self.finish(self.run.outcome())


class DpFedPort(Port):
    """dp-fedavg / fedkadp: :class:`privkit.trainers.dp_fedavg.DpFedRun` between rounds."""

    def __init__(self, method: str, federation, cfg, seed: int, progress: bool = False):
        from privkit.trainers.fedkadp import run_for

        self.method, self.federation, self.cfg, self.seed = method, federation, cfg, seed
        self.run = run_for(method, federation, cfg, seed)
        self.spec = self.run.spec

    def next_round(self):
        return self.run.next_round()

    def task(self, k):
        rho = self.run.rho
        return (
            {
                **self.common(self.run.model, self.run.t),
                "sigma": float(self.run.sigma),
                "rho": None if rho is None else float(rho),
            },
            self.run.model.state_dict(),
            {},
        )

    def finish_round(self, replies):
        self.run.finish_round(
            [
                {n: v.to(self.run.device) for n, v in replies[k][0].items()}
                for k in self.run.sampled
            ],
            [_receipts(replies[k][1], k) for k in self.run.sampled],
        )

    def result(self):
        return self.run.result()


def _receipts(report, k: int) -> list:
    """The release receipts client ``k`` sent back with its reply (a reply without them is an
    error: the ledger records what ran, never the plan)."""
    from privkit.mechanisms.gaussian import Receipt

    if RECEIPTS not in report:
        raise PrivkitError(
            f"client {k}'s reply carries no release receipts; found {sorted(report)}"
        )
    return [Receipt(**r) for r in json.loads(report[RECEIPTS])]


@dataclass
class ReleasedHead:
    """A head as it reaches the server: the noisy weights and what the client reports about the
    release (its ledger event, sensitivity, noise); the clean head stays with the client."""

    weights: np.ndarray
    event: Any
    info: dict
    sensitivity: float
    sigma: float

    def report(self, prefix: str) -> dict:
        from accountants import event_to_dict
        from privkit.jsonutil import json_default

        return {
            f"{prefix}event": json.dumps(event_to_dict(self.event)),
            f"{prefix}info": json.dumps(self.info, default=json_default),
            f"{prefix}sensitivity": float(self.sensitivity),
            f"{prefix}sigma": float(self.sigma),
        }

    @classmethod
    def from_report(cls, weights, report, prefix: str) -> ReleasedHead:
        from accountants import event_from_dict

        return cls(
            np.asarray(weights),
            event_from_dict(json.loads(report[f"{prefix}event"])),
            json.loads(report[f"{prefix}info"]),
            float(report[f"{prefix}sensitivity"]),
            float(report[f"{prefix}sigma"]),
        )


class DpHeadsPort(Port):
    """fedauxfdp: one round; the server's h0 and public features, each client's DP heads."""

    def __init__(self, method: str, federation, cfg, seed: int, progress: bool = False):
        from privkit.trainers.fedauxfdp import dp_heads_setup

        self.method, self.federation, self.cfg, self.seed = method, federation, cfg, seed
        self.setup = dp_heads_setup(method, "scores", federation, cfg, seed, progress)
        self.spec = self.setup.h0_spec
        self.done = False

    def next_round(self):
        if self.done:
            return None
        self.done = True
        return list(self.setup.active)

    def task(self, k):
        s = self.setup
        extra = {"phi_neg": s.phi_neg} if s.phi_neg is not None else {}
        if s.phi.center is not None:
            extra["center"] = s.phi.center
        return (
            {
                **self.common(s.phi.model, 1),
                "class_epsilon": float(s.class_epsilon),
                "class_delta": float(s.class_delta),
            },
            s.phi.model.state_dict(),
            extra,
        )

    def finish_round(self, replies):
        from privkit.trainers.fedauxfdp import ClientHeads

        self.releases = []
        for k in self.setup.active:
            arrays, report = replies[k]
            score = (
                ReleasedHead.from_report(arrays["score_weights"].numpy(), report, "score_")
                if "score_weights" in arrays
                else None
            )
            self.releases.append(
                ClientHeads(
                    k,
                    ReleasedHead.from_report(arrays["class_weights"].numpy(), report, "class_"),
                    score,
                    int(report["n_private"]),
                )
            )

    def result(self):
        from privkit.trainers.fedauxfdp import dp_heads_result

        return dp_heads_result(self.setup, self.federation, self.cfg, self.seed, self.releases)


def port_of(method: str) -> type[Port] | None:
    """``method``'s Flower port class (its registry entry's ``flower``), or None if it has none."""
    spec = get_trainer(method)
    return spec.flower_port if spec.flower is not None else None


def make_port(method: str, federation, cfg, seed: int, progress: bool = False) -> Port:
    """The server side of ``method``'s run (``cfg`` validated by the method's config model)."""
    port = port_of(method)
    if port is None:
        raise PrivkitError(
            f"method {method!r} does not run on the Flower engine; found engine 'flower' "
            f"(ported: {', '.join(flower_methods())})"
        )
    return port(method, federation, cfg, seed, progress)


# ----------------------------------------------------------------------------- client side
def client_step(task, model_record, extra_record, partition: int) -> tuple[dict, dict]:
    """Run the method's own client step for client ``partition`` on its records; returns the arrays
    and the scalar report the client sends back."""
    from privkit.trainers.common import resolve_device

    method = task["method"]
    fed = load_federation(task["federation"])
    cfg = make_config(method, json.loads(task["config"]))
    device = resolve_device(cfg)
    seed, t, k = int(task["seed"]), int(task["round"]), int(partition)
    x, y = fed.client_arrays(k)
    model = _model_from(task, model_record).to(device)
    port = port_of(method)
    if port is FedAvgPort:
        from privkit.trainers.fedavg import local_seed, local_update

        local, loss = local_update(
            model, x, y, cfg, mu=float(task["mu"]), seed=local_seed(seed, t, k), device=device
        )
        return local.state_dict(), {"loss": float(loss)}
    if port is DpFedPort:
        import torch

        from privkit.trainers.common import as_tensor
        from privkit.trainers.dp_fedavg import client_seed, local_update

        rho = float(task["rho"]) if "rho" in task else None
        receipts: list = []
        state = local_update(
            model,
            as_tensor(x, device, torch.float32),
            as_tensor(y, device, torch.long),
            cfg,
            float(task["sigma"]),
            rho,
            client_seed(seed, t, k),
            device,
            client=k,
            receipts=receipts,
        )
        # the releases this client made travel back with its update: the server's ledger records
        # them (never the round's plan in their place)
        return state, {RECEIPTS: json.dumps([dataclasses.asdict(r) for r in receipts])}
    if port is DpHeadsPort:
        return _heads_step(task, model, _tensors(extra_record), cfg, fed, x, y, k, seed, device)
    raise PrivkitError(f"method {method!r} has no Flower client step; found it in a train message")


def _heads_step(task, h0_model, extra, cfg, fed, x, y, k, seed, device) -> tuple[dict, dict]:
    from privkit.trainers.fedaux import FrozenFeatures
    from privkit.trainers.fedauxfdp import release_client_heads

    center = extra["center"].numpy() if "center" in extra else None
    phi = FrozenFeatures.with_center(h0_model, center, device, cfg.eval_batch_size)
    phi_neg = extra["phi_neg"].numpy() if "phi_neg" in extra else None
    out = release_client_heads(
        k,
        x,
        y,
        phi,
        phi_neg,
        cfg,
        seed,
        num_classes=fed.num_classes,
        class_epsilon=float(task["class_epsilon"]),
        class_delta=float(task["class_delta"]),
    )
    arrays, report = {"class_weights": out.class_release.weights}, {"n_private": out.n_private}
    report.update(_as_released(out.class_release).report("class_"))
    if out.score_release is not None:
        arrays["score_weights"] = out.score_release.weights
        report.update(_as_released(out.score_release).report("score_"))
    return arrays, report


def _as_released(rel) -> ReleasedHead:
    return ReleasedHead(rel.weights, rel.event, rel.info, rel.sensitivity, rel.sigma)


def privkit_client_app():
    """The ClientApp of privkit's methods: ``query`` answers the node's partition id, ``train``
    runs the method's client step (:func:`client_step`). Audit probes and mutations reach the
    mechanisms through :func:`privkit.flower_engine.audit_transport.audit_mod`."""
    from flwr.app import Message, RecordDict
    from flwr.clientapp import ClientApp

    from privkit.flower_engine.audit_transport import audit_mod

    app = ClientApp(mods=[audit_mod])

    @app.query()
    def query(msg, context):
        return Message(
            RecordDict({REPORT: _config({"partition": int(context.node_config["partition-id"])})}),
            reply_to=msg,
        )

    @app.train()
    def train(msg, context):
        arrays, report = client_step(
            msg.content[TASK],
            msg.content[MODEL],
            msg.content[EXTRA],
            int(context.node_config["partition-id"]),
        )
        return Message(RecordDict({UPDATE: _arrays(arrays), REPORT: _config(report)}), reply_to=msg)

    return app


# ----------------------------------------------------------------------------- server app
def _raise_errors(replies) -> None:
    for r in replies:
        if r.has_error():
            raise PrivkitError(
                f"a Flower ClientApp failed on node {r.metadata.src_node_id}: "
                f"{_error_text(r.error.reason)}"
            )


def _error_text(reason: str) -> str:
    """The ClientApp's own message out of Ray's and Flower's wrapping (colour codes dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(reason))
    found = re.findall(r"Message: (.+)", text)
    last = found[-1] if found else (text.strip().splitlines() or ["no reason given"])[-1]
    return last.strip().rstrip("'>").strip()[:300]  # Ray's repr of the error ends with '>


def partition_nodes(grid, num_clients: int) -> dict[int, int]:
    """``{client (partition id): node id}``: waits for the nodes, then asks each which partition it holds."""
    from flwr.app import Message, RecordDict

    deadline = time.monotonic() + NODE_WAIT_S
    while len(nodes := list(grid.get_node_ids())) < num_clients:
        if time.monotonic() > deadline:
            raise PrivkitError(
                f"the Flower simulation must have {num_clients} nodes (one per client); "
                f"found {len(nodes)} after {NODE_WAIT_S:g} s"
            )
        time.sleep(0.05)
    msgs = [Message(RecordDict(), dst_node_id=n, message_type="query") for n in nodes]
    replies = list(grid.send_and_receive(msgs))
    _raise_errors(replies)
    found = {int(r.content[REPORT]["partition"]): int(r.metadata.src_node_id) for r in replies}
    missing = sorted(set(range(num_clients)) - set(found))
    if missing:
        raise PrivkitError(
            f"every client needs a Flower node; found none for clients {missing[:5]}"
        )
    return found


def drive_port(
    port: Port, grid, nodes: dict[int, int], on_round: Callable[[], None] | None = None
) -> Any:
    """Run one privkit run to its end through ``grid``; returns its TrainResult (``on_round`` is
    called after each round)."""
    from flwr.app import Message, RecordDict

    while (selected := port.next_round()) is not None:
        msgs = []
        for k in selected:
            cfg, model, extra = port.task(k)
            content = RecordDict({TASK: _config(cfg), MODEL: _arrays(model), EXTRA: _arrays(extra)})
            msgs.append(
                Message(
                    content, dst_node_id=nodes[k], message_type="train", group_id=str(cfg["round"])
                )
            )
        replies = list(grid.send_and_receive(msgs))
        _raise_errors(replies)
        by_node = {int(r.metadata.src_node_id): r for r in replies}
        port.finish_round(
            {
                k: (_tensors(by_node[nodes[k]].content[UPDATE]), by_node[nodes[k]].content[REPORT])
                for k in selected
            }
        )
        if on_round is not None:
            on_round()
    return port.result()


def privkit_server_app(ports: list[Port], results: list, progress: bool = False):
    """The ServerApp that drives ``ports`` one after the other (appending each result to ``results``)."""
    from flwr.serverapp import ServerApp

    from privkit.progress import progress_bar

    app = ServerApp()

    @app.main()
    def main(grid, context):
        with progress_bar(progress) as bar:
            start = bar.add_task("Flower: starting Ray and the ClientApps", total=1)
            nodes = partition_nodes(grid, max(p.federation.num_clients for p in ports))
            bar.advance(start)
            for port in ports:
                task = bar.add_task(f"{port.method} rounds on Flower", total=port.rounds_total)
                results.append(drive_port(port, grid, nodes, lambda task=task: bar.advance(task)))

    return app


__all__ = [
    "FlowerApp",
    "Port",
    "ReleasedHead",
    "client_step",
    "drive_port",
    "load_federation",
    "make_port",
    "partition_nodes",
    "port_of",
    "privkit_client_app",
    "privkit_server_app",
]
