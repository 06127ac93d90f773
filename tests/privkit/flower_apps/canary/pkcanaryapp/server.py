"""The canary app's ServerApp: FedAvg over both nodes, accounted by privkit (the clients' own
record-level DP-SGD entries)."""

import torch
from flwr.app import ArrayRecord
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg

from pkcanaryapp.task import net
from privkit.flower import Accounted

app = ServerApp()


@app.main()
def main(grid, context):
    c = context.run_config
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2)
    accounted = Accounted(
        strategy,
        delta=1e-5,
        neighbouring="add_remove",
        client_sampling="none",
        out="runs",
        name="canary-app",
        context=context,
    )
    torch.manual_seed(0)
    arrays = ArrayRecord([p.detach().numpy() for p in net().parameters()])
    accounted.start(grid=grid, initial_arrays=arrays, num_rounds=c["num-server-rounds"])
