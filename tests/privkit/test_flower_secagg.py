"""Secure aggregation with distributed noise (Flower's SecAgg+), accounted as it ran.

Flower's own ``secaggplus_mod`` and ``SecAggPlusWorkflow`` (flwr 1.42, legacy strategy API) run in
this process (:func:`privkit.flower.run_inprocess`); a grid on the server loses chosen replies in
chosen SecAgg+ stages, as when a SuperNode goes away.  Each client adds its share
``N(0, (z S)^2 / m)`` with :func:`privkit.flower.distributed_noise`; with ``r`` clients in the
aggregate the noise on the sum has std ``z S sqrt(r / m)``.  Checked against independent
computations: each round's epsilon against dp-accounting fed ``GaussianDpEvent(z sqrt(r / m) / s)``
by hand (``s`` = 1 zero-out add/remove, 2 replace-one), and the noise in the unmasked aggregate
against its stated std (sample std over 20,000 coordinates).
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server import LegacyContext, ServerApp, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow

from privkit.flower import (
    Accounted,
    SecAggPlusAccounted,
    distributed_noise,
    ledger_mod,
    run_inprocess,
)
from privkit.flower.accounting import RunRefused

DELTA = 1e-5
Z, CLIP, M = 1.0, 1.0, 5  # noise multiplier, clip norm, clients the noise is calibrated for
DIM = 20_000  # model coordinates: the aggregate's noise is measured over them


def by_hand(multipliers: list[float], relation: str) -> float:
    """dp-accounting's RDP epsilon of Gaussians of these multipliers, composed (the independent
    computation)."""
    neighbouring = (
        dpa.NeighboringRelation.REPLACE_ONE
        if relation == "replace_one"
        else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    acc = dpa.rdp.RdpAccountant(neighboring_relation=neighbouring)
    for mult in multipliers:
        acc.compose(dpa.GaussianDpEvent(mult))
    return float(acc.get_epsilon(DELTA))


def multipliers(entries: list) -> list[float]:
    assert all(isinstance(e.event, dpa.GaussianDpEvent) for e in entries)
    return [e.event.noise_multiplier for e in entries]


class Noisy(NumPyClient):
    """Moves every coordinate by ``pid + 1`` (norm far above ``CLIP``), then adds its share."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def fit(self, parameters: list, config: dict) -> tuple[list, int, dict]:
        trained = [p + self.pid + 1.0 for p in parameters]
        noised = distributed_noise(
            trained,
            parameters,
            clip_norm=CLIP,
            noise_multiplier=Z,
            num_clients=M,
            source=np.random.default_rng(1000 + self.pid * 101 + int(config["round"])),
        )
        return noised, (self.pid + 1 if config.get("weighted") else 1), {}


def client_app() -> ClientApp:
    def client_fn(context: Context) -> Any:
        return Noisy(int(context.node_config["partition-id"])).to_client()

    return ClientApp(client_fn=client_fn, mods=[ledger_mod, secaggplus_mod])


class Dropping:
    """The server's grid, except that the replies of the nodes in ``drop[(round, stage)]`` never
    arrive in that SecAgg+ stage of that round."""

    def __init__(self, grid: Any, drop: dict[tuple[int, str], set[int]]) -> None:
        self._grid, self.drop = grid, drop

    def send_and_receive(self, messages: Any, **kwargs: Any) -> list:
        messages = list(messages)
        replies = list(self._grid.send_and_receive(messages, **kwargs))
        if not messages:
            return replies
        content = messages[0].content
        if RECORD_KEY_CONFIGS not in content.config_records:
            return replies
        stage = content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]
        lost = self.drop.get((int(messages[0].metadata.group_id), str(stage)), set())
        return [r for r in replies if int(r.metadata.src_node_id) not in lost]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


class Recording(FedAvg):
    """FedAvg keeping each round's aggregate (the released model)."""

    def __init__(self, models: list, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.models = models

    def aggregate_fit(self, server_round: int, results: Any, failures: Any) -> Any:
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if params is not None:
            from flwr.common import parameters_to_ndarrays

            self.models.append(parameters_to_ndarrays(params)[0])
        return params, metrics


def run(
    drop: dict[tuple[int, str], set[int]], rounds: int, weighted: bool = False, **accounted: Any
) -> tuple[SecAggPlusAccounted, list[np.ndarray]]:
    models: list[np.ndarray] = [np.zeros(DIM)]
    sink: dict[str, Any] = {}
    server = ServerApp()

    @server.main()
    def main(grid: Any, context: Any) -> None:
        strategy = Recording(
            models,
            fraction_fit=1.0,
            min_fit_clients=M,
            min_available_clients=M,
            fraction_evaluate=0.0,
            on_fit_config_fn=lambda rnd: {"round": rnd, "weighted": weighted},
            initial_parameters=ndarrays_to_parameters([np.zeros(DIM)]),
        )
        legacy = LegacyContext(
            context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy
        )
        sink["workflow"] = SecAggPlusAccounted(
            num_shares=M, reconstruction_threshold=3, delta=DELTA, **accounted
        )
        DefaultWorkflow(fit_workflow=sink["workflow"])(Dropping(grid, drop), legacy)

    run_inprocess(server, client_app(), M)
    return sink["workflow"], models


# round 2: node 5 lost before its masked input arrived (not in the sum: r = 4);
# round 3: node 5 lost the same way, node 4 lost in the unmask stage, after its masked input was
# summed (its mask is rebuilt from its neighbours' shares: still in the sum, r = 4)
DROPS = {
    (2, Stage.COLLECT_MASKED_VECTORS): {5},
    (3, Stage.COLLECT_MASKED_VECTORS): {5},
    (3, Stage.UNMASK): {4},
}
SURVIVORS = [5, 4, 4]


@pytest.fixture(scope="module")
def add_remove() -> tuple[SecAggPlusAccounted, list[np.ndarray]]:
    return run(DROPS, 3, neighbouring="add_remove")


def test_each_round_is_the_gaussian_of_the_noise_that_survived(add_remove):
    workflow, _ = add_remove
    assert [r["survivors"] for r in workflow.rounds] == SURVIVORS
    assert [r["sampled"] for r in workflow.rounds] == [M, M, M]
    assert [r["calibrated_for"] for r in workflow.rounds] == [M, M, M]
    assert workflow.rounds[1]["clients"] == [1, 2, 3, 4]  # node 5's input is not in round 2
    assert workflow.rounds[2]["clients"] == [1, 2, 3, 4]  # node 4 dropped after being summed
    # node 1 was in every aggregate: the worst client, charged z sqrt(r / m) per round
    mults = [Z * math.sqrt(r / M) for r in SURVIVORS]
    for k, row in enumerate(workflow.rounds):
        assert row["epsilon"] == pytest.approx(by_hand(mults[: k + 1], "add_remove"), rel=1e-9)
    assert multipliers(workflow.ledger.entries("1")) == pytest.approx(mults, rel=1e-12)
    # node 5 was charged for round 1 only, at the full noise
    assert multipliers(workflow.ledger.entries("5")) == pytest.approx([Z], rel=1e-12)
    assert workflow.epsilon == pytest.approx(by_hand(mults, "add_remove"), rel=1e-9)
    # fewer survivors than the noise was calibrated for: said, and accounted at the realised r
    assert len(workflow.notes) == 2 and "4 of the 5 clients" in workflow.notes[0]


def test_the_unmasked_aggregate_carries_the_noise_of_the_survivors(add_remove):
    _, models = add_remove
    assert len(models) == 4  # the initial model and three released aggregates
    for k, r in enumerate(SURVIVORS):
        # each survivor's clipped update is CLIP / sqrt(DIM) on every coordinate; the mean of r
        # shares of std z S / sqrt(m) has std z S sqrt(r / m) / r
        noise = models[k + 1] - models[k] - CLIP / math.sqrt(DIM)
        stated = Z * CLIP * math.sqrt(r / M) / r
        assert abs(float(np.mean(noise))) < 5 * stated / math.sqrt(DIM)
        # sample std within 3% (the relative standard error is 1/sqrt(2 DIM) = 0.5%); with node
        # 4's noise missing in round 3 it would be sqrt(3/5)/3, 15% more
        assert float(np.std(noise)) == pytest.approx(stated, rel=0.03)


def test_replace_one_doubles_the_sensitivity():
    workflow, _ = run({(2, Stage.COLLECT_MASKED_VECTORS): {2, 3}}, 2)
    mults = [Z * math.sqrt(r / M) / 2 for r in (5, 3)]
    assert [r["survivors"] for r in workflow.rounds] == [5, 3]
    assert workflow.epsilon == pytest.approx(by_hand(mults, "replace_one"), rel=1e-9)
    saved = workflow.ledger.entries("1")
    assert [e.neighbouring for e in saved] == ["replace_one"] * 2


def test_unequal_weights_are_accounted_with_the_weighted_noise(tmp_path):
    """SecAgg+ scales each input by its ``num_examples`` ``w`` (here ``pid + 1``): the noise on the
    weighted sum has std ``sqrt(sum_j w_j^2) z S / sqrt(m)`` and client ``i`` moves it by ``w_i S``."""
    workflow, _ = run({(1, Stage.COLLECT_MASKED_VECTORS): {5}}, 1, weighted=True)
    survivors = [1, 2, 3, 4]  # node n has weight n
    noise = math.sqrt(sum(w * w for w in survivors)) * Z * CLIP / math.sqrt(M)
    for node in survivors:
        mult = noise / (node * 2 * CLIP)  # replace-one: 2 S
        assert multipliers(workflow.ledger.entries(str(node))) == pytest.approx([mult], rel=1e-9)
    assert workflow.epsilon == pytest.approx(by_hand([noise / (4 * 2 * CLIP)], "replace_one"))
    written = workflow.save(tmp_path)
    assert (written / "ledger.json").is_file() and (written / "privacy.json").is_file()


def test_a_round_whose_survivors_would_pass_the_budget_is_not_unmasked():
    full = by_hand([Z], "add_remove")
    two_full = by_hand([Z, Z], "add_remove")
    three = by_hand([Z, Z * math.sqrt(3 / M)], "add_remove")
    # round 1 fits, and round 2 would with all 5 clients in the sum, but not with r = 3
    budget = (two_full + three) / 2
    drop = {(2, Stage.COLLECT_MASKED_VECTORS): {4, 5}}
    workflow, models = run(drop, 3, neighbouring="add_remove", budget=budget)
    assert len(workflow.rounds) == 1 and workflow.epsilon == pytest.approx(full, rel=1e-9)
    assert workflow.stopped is not None
    assert "round 2 halted before unmasking" in workflow.stopped
    assert len(models) == 2  # round 2's aggregate was never reconstructed, round 3 never sent


def test_a_budget_the_first_round_would_pass_refuses_the_run():
    with pytest.raises(RunRefused, match="halted before unmasking"):
        run({}, 2, neighbouring="add_remove", budget=by_hand([Z], "add_remove") / 2)


def test_a_budget_all_survivors_would_pass_is_refused_before_the_model_is_sent():
    one = by_hand([Z], "add_remove")
    workflow, models = run({}, 3, neighbouring="add_remove", budget=one * 1.2)
    assert len(workflow.rounds) == 1 and len(models) == 2
    assert workflow.stopped is not None and "stopped before round 2" in workflow.stopped
    assert "even with all 5 clients" in workflow.stopped


def _train_message() -> Message:
    return Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)


def _share(
    arrays: list, reference: list, source: Any, z: float = Z, m: int = M
) -> tuple[list, list]:
    """Run distributed_noise inside ledger_mod; return the released arrays and the entries sent."""
    out: dict[str, Any] = {}

    def call_next(msg: Message, ctxt: Any) -> Message:
        out["arrays"] = distributed_noise(
            arrays, reference, clip_norm=CLIP, noise_multiplier=z, num_clients=m, source=source
        )
        return Message(RecordDict({"metrics": MetricRecord({"n": 1})}), reply_to=msg)

    from privkit.flower.client import entries_of

    reply = ledger_mod(_train_message(), None, call_next)
    return out["arrays"], entries_of(reply)


@pytest.mark.parametrize("source", ["seeded", "release"])
def test_a_share_has_the_stated_std(source, task):
    rng = np.random.default_rng(7) if source == "seeded" else None
    zeros = [np.zeros((400, 250)), np.zeros(100_000)]  # no update: the share alone
    released, entries = _share(zeros, zeros, rng)
    noise = np.concatenate([a.ravel() for a in released])
    stated = Z * CLIP / math.sqrt(M)
    assert abs(float(np.mean(noise))) < 5 * stated / math.sqrt(noise.size)
    # 200,000 coordinates: relative standard error of the sample std 0.16%
    assert float(np.std(noise)) == pytest.approx(stated, rel=0.01)
    assert entries == [
        {
            "kind": "distributed_noise",
            "label": "distributed noise",
            "clip_norm": CLIP,
            "noise_multiplier": Z,
            "num_clients": M,
            "std": pytest.approx(stated),
        }
    ]


def test_a_share_clips_the_update_over_all_arrays(task):
    ref = [np.ones(3, dtype=np.float32), np.zeros((2, 2), dtype=np.float32)]
    new = [np.ones(3, dtype=np.float32) + 3.0, np.full((2, 2), 4.0, dtype=np.float32)]
    released, _ = _share(new, ref, np.random.default_rng(0), z=0.0)
    assert [a.dtype for a in released] == [np.float32, np.float32]
    update = np.concatenate([(a - r).ravel() for a, r in zip(released, ref)])
    raw = np.array([3.0] * 3 + [4.0] * 4)  # norm 9.5: scaled to CLIP, direction kept
    np.testing.assert_allclose(update, raw * CLIP / np.linalg.norm(raw), rtol=1e-6)


def test_a_share_needs_the_ledger_mod():
    with pytest.raises(ValueError, match="ledger_mod"):
        distributed_noise(
            [np.zeros(2)], [np.zeros(2)], clip_norm=1, noise_multiplier=1, num_clients=2
        )


def test_without_secure_aggregation_a_share_is_charged_alone():
    """A share sent in the clear (Message API, no SecAgg+): the server reads each update with only
    its own share of the noise, multiplier ``z / sqrt(m)`` (over 2 S, replace-one)."""
    from flwr.clientapp import ClientApp as MessageClientApp
    from flwr.serverapp import ServerApp as MessageServerApp
    from flwr.serverapp.strategy import FedAvg as MessageFedAvg

    client = MessageClientApp(mods=[ledger_mod])

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        noised = distributed_noise(
            [a + 1.0 for a in arrays],
            arrays,
            clip_norm=CLIP,
            noise_multiplier=Z,
            num_clients=M,
            source=np.random.default_rng(int(context.node_id)),
        )
        metrics = MetricRecord({"num-examples": 1})
        return Message(
            RecordDict({"arrays": ArrayRecord(noised), "metrics": metrics}), reply_to=msg
        )

    sink: dict[str, Any] = {}
    server = MessageServerApp()

    @server.main()
    def main(grid: Any, context: Any) -> None:
        strategy = Accounted(
            MessageFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3),
            delta=DELTA,
            client_sampling="none",
        )
        sink["strategy"] = strategy
        strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(4)]), num_rounds=2)

    run_inprocess(server, client, 3)
    acc = sink["strategy"]
    mult = Z / math.sqrt(M) / 2
    assert multipliers(acc.ledger.entries("1")) == pytest.approx([mult, mult], rel=1e-12)
    assert acc.epsilon == pytest.approx(by_hand([mult, mult], "replace_one"), rel=1e-9)
