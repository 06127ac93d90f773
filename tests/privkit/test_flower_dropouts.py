"""privkit.flower.Accounted on rounds as they ran: dropouts (fewer replies than the wrapper's
``num_sampled_clients``), a client that fails, adaptive clipping with the cost of its clipped-count
release, each against dp-accounting fed with the multiplier derived from Flower's own code.

What Flower's central-DP wrappers do with fewer replies (flwr 1.42, ``dp_fixed_clipping.py``,
``dp_adaptive_clipping.py``): ``validate_replies`` only warns when ``m'`` replies arrive for
``m = num_sampled_clients``; FedAvg averages the ``m'`` clipped updates; the noise std stays
``z C / m``.  One client moves the mean by ``2 C / m'`` (replace-one), so its multiplier is
``(z C / m) / (2 C / m') = z m' / (2 m)``.  A reply with an error makes ``validate_replies`` fail:
nothing is aggregated and nothing released (the adaptive wrappers then also skip the count).
Adaptive clipping (Andrew et al. 2021) releases the clipped count ``sum b_i + N(0, sigma_b^2)``
(bit sensitivity 1) with update noise ``z_u = (z^-2 - (2 sigma_b)^-2)^-1/2``: one round is the
Gaussian with ``mult^-2 = (z_u m' / (2 m))^-2 + sigma_b^-2``."""

from __future__ import annotations

from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest

pytest.importorskip("flwr")

import flower_testapps as apps
from flwr.app import ArrayRecord
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    FedAvg,
)

from privkit.flower import Accounted, run_inprocess

DELTA = 1e-5
Z, CLIP, SIGMA_B = 1.0, 0.5, 1.0


def rdp(*events: Any) -> float:
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    for e in events:
        acc.compose(e)
    return float(acc.get_epsilon(DELTA))


class DroppingGrid:
    """The ServerApp's grid, except that in the train rounds of ``drop`` the replies of that many
    clients never arrive (as when a SuperNode goes away before replying)."""

    def __init__(self, grid: Any, drop: dict[int, int]) -> None:
        self._grid, self.drop, self.round = grid, drop, 0

    def send_and_receive(self, messages: Any, **kwargs: Any) -> list:
        messages = list(messages)
        replies = list(self._grid.send_and_receive(messages, **kwargs))
        if messages and messages[0].metadata.message_type.startswith("train"):
            self.round += 1
            k = self.drop.get(self.round, 0)
            replies = sorted(replies, key=lambda r: r.metadata.src_node_id)[k:]
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def run(make, *, nodes: int, rounds: int, drop: dict[int, int], mods, sampling="none", fail=None):
    server, sink = ServerApp(), {}

    @server.main()
    def main(grid, context):
        sink["strategy"] = s = Accounted(make(), delta=DELTA, client_sampling=sampling)
        s.start(
            grid=DroppingGrid(grid, drop),
            initial_arrays=ArrayRecord([np.zeros(apps.N_PARAMS)]),
            num_rounds=rounds,
        )

    calls = {"n": 0}

    def on_train(pid: int) -> None:  # ``fail``: the call number that raises (one client's error)
        calls["n"] += 1
        if calls["n"] == fail:
            raise RuntimeError("this client failed")

    run_inprocess(server, apps.client_app(mods, on_train=on_train), nodes)
    return sink["strategy"]


def fedavg(nodes: int, sampled: int) -> FedAvg:
    return FedAvg(
        fraction_train=sampled / nodes,
        fraction_evaluate=0.0,
        min_available_nodes=nodes,
        min_train_nodes=sampled,
    )


def test_a_dropout_is_accounted_with_the_noise_calibrated_for_more_clients():
    """3 of 3 nodes, m = 3: round 2 has 2 replies, so its multiplier is z 2 / (2 3) = 1/3; the
    client that dropped out is charged round 1 only."""
    make = lambda: DifferentialPrivacyClientSideFixedClipping(fedavg(3, 3), Z, CLIP, 3)
    acc = run(make, nodes=3, rounds=2, drop={2: 1}, mods=[fixedclipping_mod])
    both = rdp(dpa.GaussianDpEvent(Z / 2), dpa.GaussianDpEvent(Z * 2 / (2 * 3)))
    assert acc.epsilon == pytest.approx(both, rel=1e-9)
    dropped = [c for c in acc.ledger.clients if len(acc.ledger.entries(c)) == 1]
    assert len(dropped) == 1
    assert acc.ledger.account(DELTA, accountant="rdp").epsilon == pytest.approx(both, rel=1e-9)
    assert [r["round"] for r in acc.rounds] == [1, 2]


def test_a_dropout_with_sampling_amplification():
    """3 of 5 nodes drawn per round, one reply lost in round 2: every node is charged the draw of
    3 of 5 with the Gaussian of the replies that arrived (z 2 / (2 3))."""
    make = lambda: DifferentialPrivacyClientSideFixedClipping(fedavg(5, 3), Z, CLIP, 3)
    acc = run(
        make,
        nodes=5,
        rounds=2,
        drop={2: 1},
        mods=[fixedclipping_mod],
        sampling="without_replacement",
    )
    r1 = dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(Z / 2))
    r2 = dpa.SampledWithoutReplacementDpEvent(5, 3, dpa.GaussianDpEvent(Z / 3))
    assert acc.epsilon == pytest.approx(rdp(r1, r2), rel=1e-9)
    assert len(acc.ledger.clients) == 5


def test_a_failed_client_voids_the_round_and_nothing_is_charged_for_it():
    """A reply with an error: Flower's wrapper aggregates nothing (no release), so the run's epsilon
    is that of the rounds that released, and the failure is in the run's notes."""
    make = lambda: DifferentialPrivacyClientSideFixedClipping(fedavg(3, 3), Z, CLIP, 3)
    acc = run(make, nodes=3, rounds=3, drop={}, mods=[fixedclipping_mod], fail=5)  # round 2
    assert [r["round"] for r in acc.rounds] == [1, 3]
    assert acc.epsilon == pytest.approx(
        rdp(dpa.GaussianDpEvent(Z / 2), dpa.GaussianDpEvent(Z / 2)), rel=1e-9
    )
    assert any(f.startswith("round 2: 1 of 3 clients failed") for f in acc.describe())


@pytest.mark.parametrize("side", ["client", "server"])
def test_adaptive_clipping_pays_for_its_clipped_count_also_after_a_dropout(side):
    """Adaptive clipping asked for z = 1 with sigma_b = 1, m = 3, one reply lost in round 2: round 1
    is the Gaussian of multiplier z / 2 (Andrew et al.'s split), round 2 the Gaussian with
    mult^-2 = (z_u 2 / (2 3))^-2 + sigma_b^-2."""
    cls = (
        DifferentialPrivacyClientSideAdaptiveClipping
        if side == "client"
        else DifferentialPrivacyServerSideAdaptiveClipping
    )
    make = lambda: cls(fedavg(3, 3), Z, 3, initial_clipping_norm=CLIP, clipped_count_stddev=SIGMA_B)
    mods = [adaptiveclipping_mod] if side == "client" else []
    acc = run(make, nodes=3, rounds=2, drop={2: 1}, mods=mods)
    z_u = (Z**-2 - (2 * SIGMA_B) ** -2) ** -0.5
    r1 = ((z_u / 2) ** -2 + SIGMA_B**-2) ** -0.5
    assert r1 == pytest.approx(Z / 2, rel=1e-12)  # the split Flower's wrapper makes
    r2 = ((z_u * 2 / (2 * 3)) ** -2 + SIGMA_B**-2) ** -0.5
    expected = rdp(dpa.GaussianDpEvent(r1), dpa.GaussianDpEvent(r2))
    assert acc.epsilon == pytest.approx(expected, rel=1e-9)
    # the count alone is not free: without it the round would be cheaper
    assert acc.epsilon > rdp(dpa.GaussianDpEvent(z_u / 2), dpa.GaussianDpEvent(z_u / 3))
