"""A Flower ClientApp whose clients run record-level DP-SGD (torch.func, Poisson sampling) for one
local epoch per round and record it in privkit's ledger; node 0 audits itself with canary records
(``audit``): ``canaries()`` and the three ``if audited`` blocks are what the audit adds.  A
deployment starts a new ClientApp process for every message, so the canaries are kept between
rounds in ``<privkit-dir>/canaries.pkl``.  ``noise-scale`` 0.5 is the bug to catch: half the noise
the ledger claims."""

import pickle
from pathlib import Path

import dp_accounting as dpa
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from opacus.data_loader import DPDataLoader
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader

from attacks import GradientCanaries
from pkcanaryapp.task import BATCH, CLIP, LR, SIGMA, Q, net, partition
from privkit.flower import ledger_mod, record

app = ClientApp(mods=[ledger_mod])


def canaries(context, steps):  # the audit's three added lines use these canaries
    path = Path(context.run_config["privkit-dir"], "canaries.pkl")
    if path.exists():
        return path, pickle.loads(path.read_bytes())
    params = list(net().parameters())
    kw = dict(clip_norm=CLIP, sample_rate=Q, noise_multiplier=SIGMA, steps=steps)
    return path, GradientCanaries.for_parameters(params, 60, seed=context.run_config["seed"], **kw)


@app.train()
def train(msg, context):
    c, pid = context.run_config, int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    torch.manual_seed(c["seed"] * 1000 + 10 * pid + rnd)
    model = net()
    keys = [k for k, _ in model.named_parameters()]
    params = {k: torch.tensor(a) for k, a in zip(keys, msg.content["arrays"].to_numpy_ndarrays())}
    loader = DPDataLoader.from_data_loader(DataLoader(partition(pid), batch_size=BATCH))
    audited = pid == 0 and c["audit"]
    if audited:
        path, cans = canaries(context, c["num-server-rounds"] * round(1 / Q))
        loader = cans.records(loader)

    def loss(p, xb, yb):
        return F.cross_entropy(functional_call(model, p, (xb,)), yb)

    steps = 0
    for xb, yb in loader:
        g = vmap(grad(loss), (None, 0, 0))(params, xb, yb)
        if audited:
            g = cans.through(g)
        norms = torch.cat([v.flatten(1) for v in g.values()], 1).norm(dim=1) + 1e-6
        f = (CLIP / norms).clamp(max=1)
        std = SIGMA * c["noise-scale"] * CLIP  # noise-scale 0.5: the bug the audit must catch
        noisy = {
            k: torch.einsum("b,b...->...", f, v) + std * torch.randn(v.shape[1:])
            for k, v in g.items()
        }
        if audited:
            cans.observe(list(noisy.values()))
        params = {k: (params[k] - LR * noisy[k] / BATCH).detach() for k in params}
        steps += 1
    if audited:
        path.write_bytes(pickle.dumps(cans))
    sgd = dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(SIGMA))  # what the client claims
    record(dpa.SelfComposedDpEvent(sgd, steps), "dp-sgd (record-level)", "add_remove")
    reply = ArrayRecord([params[k].numpy() for k in keys])
    metrics = MetricRecord({"num-examples": len(partition(pid))})
    return Message(RecordDict({"arrays": reply, "metrics": metrics}), reply_to=msg)
