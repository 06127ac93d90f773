"""Run a Flower ServerApp/ClientApp pair in this process, without Ray: the cost baseline of Flower's
simulation engine and a fast driver for tests.

flwr 1.42 has one simulation backend, Ray (``flwr.simulation.run_simulation``).  :func:`run_inprocess`
drives the same two apps with a :class:`InProcessGrid` that delivers each message to the ClientApp by
a plain call, one node after the other.  What it does not do: run nodes in parallel or in separate
processes, time out, lose messages, or isolate the apps' global state.  A ClientApp that raises
answers with an error reply, as in Flower's simulation.  Each node keeps one
``Context`` (``node_config["partition-id"]`` and ``["num-partitions"]`` as Flower's simulation sets
them, ``run_config`` the run's) for the whole run, and each message is copied before delivery, as a transport would.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from logging import ERROR
from types import SimpleNamespace
from typing import Any

from privkit.flower_engine import INSTALL_HINT

try:
    from flwr.app import Context, Error, Message, RecordDict
    from flwr.common.constant import ErrorCode
    from flwr.serverapp import Grid
    from flwr.supercore import log
    from flwr.supercore.task_identity import TaskIdentity
except ImportError as exc:  # one line naming the extra to install
    raise ImportError(INSTALL_HINT) from exc

__all__ = ["InProcessGrid", "run_inprocess"]

SERVER_NODE = 0


class InProcessGrid(Grid):
    """A Grid whose nodes are ``num_nodes`` copies of ``client_app`` called in this process."""

    def __init__(
        self,
        client_app: Any,
        num_nodes: int,
        run_id: int = 1,
        first_node_id: int = 1,
        run_config: dict | None = None,
    ) -> None:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be an int >= 1; found {num_nodes!r}")
        self.client_app, self.run_id = client_app, run_id
        self._nodes = [first_node_id + i for i in range(num_nodes)]
        self._contexts = {
            node: Context(
                run_id=run_id,
                node_id=node,
                state=RecordDict(),
                run_config=dict(run_config or {}),
                node_config={"partition-id": i, "num-partitions": num_nodes},
            )
            for i, node in enumerate(self._nodes)
        }
        self._ids = itertools.count(1)
        self._replies: dict[str, Message] = {}

    def set_run(self, run: Any) -> None:  # the in-process run needs no run record
        self._run = run

    @property
    def run(self) -> Any:
        """The run set with :meth:`set_run`, else one that names the run id (what Flower's legacy
        compat layer reads: ``DefaultWorkflow`` registers the nodes under ``grid.run.run_id``)."""
        run = getattr(self, "_run", None)
        return run if run is not None else SimpleNamespace(run_id=self.run_id, override_config={})

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content=content,
            message_type=message_type,
            dst_node_id=dst_node_id,
            group_id=group_id,
            ttl=ttl,
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self._nodes)

    def _deliver(self, message: Message) -> Message:
        node = int(message.metadata.dst_node_id)
        if node not in self._contexts:
            raise ValueError(
                f"message dst_node_id must be one of the {len(self._nodes)} nodes; found {node}"
            )
        message = copy.deepcopy(message)
        TaskIdentity.node_id = node
        try:
            return self.client_app(message, self._contexts[node])
        except Exception as exc:  # as in Flower's simulation: an error reply, not a crash
            log(ERROR, "ClientApp on node %s raised %r", node, exc)
            reason = f"{type(exc)}:<'{exc}'>"
            return Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message
            )
        finally:
            TaskIdentity.node_id = SERVER_NODE

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            ids.append(f"m{next(self._ids)}")
            self._replies[ids[-1]] = self._deliver(message)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return [self._deliver(m) for m in messages]


def run_inprocess(
    server_app: Any, client_app: Any, num_nodes: int, *, run_config: dict | None = None
) -> None:
    """Run ``server_app`` against ``num_nodes`` in-process copies of ``client_app``.

    Parameters
    ----------
    server_app : flwr.serverapp.ServerApp
        Called once with an :class:`InProcessGrid` and the server's ``Context``; returns when the
        run ends.
    client_app : flwr.clientapp.ClientApp
        Called in this process for each message to a node, with that node's own ``Context``
        (``node_config``: ``partition-id`` and ``num-partitions``); an exception becomes an
        error reply, as in Flower's simulation.
    num_nodes : int
        The number of client nodes (``>= 1``; node ids 1 to ``num_nodes``).
    run_config : dict, optional
        Reaches the ServerApp's and every ClientApp's ``Context.run_config``, as in Flower's
        simulation and deployment engines.
    """
    previous = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    grid = InProcessGrid(client_app, num_nodes, run_config=run_config)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = grid.run_id, SERVER_NODE, 1
    try:
        server_app(
            grid,
            Context(
                run_id=grid.run_id,
                node_id=SERVER_NODE,
                state=RecordDict(),
                run_config=dict(run_config or {}),
                node_config={},
            ),
        )
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = previous
