"""Canary records in one client's data of a Flower federation (record-level DP-SGD inside the
ClientApp): the client rebuilds its loader every round; the canaries join each round's loader,
go through the client's own sampler and clipping, and every local step's release is tested
against the client's claim over all rounds. The correct client is consistent, its shuffled twin
is caught (sampling: regularity) in every seed.

The snippet of docs/flower.md "Canary records in one client's data" is this test's
``client_app``."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from attacks import GradientCanaries

pytest.importorskip("flwr")

Q, SIGMA, CLIP, ROUNDS, LOCAL_STEPS, NODES = 0.05, 1.5, 1.0, 5, 20, 3


def _net():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def _partition(pid: int) -> TensorDataset:
    g = torch.Generator().manual_seed(pid)
    x = torch.randn(600, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _loader(data, sampler: str, seed: int):
    from opacus.data_loader import DPDataLoader

    g = torch.Generator().manual_seed(seed)
    if sampler == "shuffle":
        return DataLoader(data, batch_size=30, shuffle=True, drop_last=True, generator=g)
    return DPDataLoader.from_data_loader(DataLoader(data, batch_size=30), generator=g)


def client_app(canaries: GradientCanaries, audited: int, sampler: str, seed: int):
    """A ClientApp whose clients run DP-SGD (torch.func) for one local epoch per round; client
    ``audited`` puts ``canaries`` into its loader every round."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        net = _net()
        keys = [k for k, _ in net.named_parameters()]
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        params = {k: torch.tensor(a) for k, a in zip(keys, arrays)}
        rnd = int(msg.content["config"]["server-round"]) if "config" in msg.content else 0
        loader = _loader(_partition(pid), sampler, seed * 1000 + 10 * pid + rnd)
        if pid == audited:
            loader = canaries.records(loader)  # added: canary records in this client's data

        def loss(p, xb, yb):
            return F.cross_entropy(functional_call(net, p, (xb,)), yb)

        for xb, yb in loader:
            g = vmap(grad(loss), (None, 0, 0))(params, xb, yb)
            if pid == audited:
                g = canaries.through(g)  # added: before the client's clipping
            norms = torch.cat([v.flatten(1) for v in g.values()], 1).norm(dim=1) + 1e-6
            f = (CLIP / norms).clamp(max=1)
            noisy = {
                k: torch.einsum("b,b...->...", f, v) + SIGMA * CLIP * torch.randn(v.shape[1:])
                for k, v in g.items()
            }
            if pid == audited:
                canaries.observe(list(noisy.values()))  # added: what the step releases
            params = {k: (params[k] - 0.1 * noisy[k] / 30).detach() for k in params}
        reply = ArrayRecord([params[k].numpy() for k in keys])
        return Message(
            RecordDict({"arrays": reply, "metrics": MetricRecord({"num-examples": 600})}),
            reply_to=msg,
        )

    return app


def _federation(sampler: str, seed: int):
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    from privkit.flower import run_inprocess

    torch.manual_seed(seed)
    net = _net()
    canaries = GradientCanaries.for_parameters(
        list(net.parameters()),
        60,
        clip_norm=CLIP,
        sample_rate=Q,
        noise_multiplier=SIGMA,
        steps=ROUNDS * LOCAL_STEPS,
        seed=seed,
    )
    server = ServerApp()

    @server.main()
    def main(grid, context):
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=NODES)
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord([p.detach().numpy() for p in net.parameters()]),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({}),
        )

    run_inprocess(server, client_app(canaries, 0, sampler, seed), num_nodes=NODES)
    return canaries


def test_canary_records_in_one_flower_client_follow_its_sampler_over_every_round():
    seeds = range(3)
    correct = [_federation("poisson", s) for s in seeds]
    # every round rebuilt the loader; the canaries' record carried over
    assert all(c.steps >= ROUNDS * 15 for c in correct)
    assert all(len(c.records_state.batch_sizes) == c.steps for c in correct)
    verdicts = [c.audit(delta=1e-5).verdict for c in correct]
    assert verdicts.count("violation") <= 1, verdicts
    shuffled = [_federation("shuffle", s).audit(delta=1e-5) for s in seeds]
    assert all("sampling: regularity" in r.conformance.failed for r in shuffled), [
        r.conformance.failed for r in shuffled
    ]
    assert np.all([r.conformance.holds_epsilon > r.conformance.claimed_epsilon for r in shuffled])
