"""The canary-clients app's ServerApp: Flower's client-side fixed clipping (z = 1, C = 1) over
``sampled`` of the connected nodes, accounted by privkit, the last ``canaries`` nodes canary
clients; ``noise-scale`` 0.5 is the bug to catch: the wrapper adds half the noise privkit read from
it.  The audit is written next to the run's ledger."""

import random

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

from pkccapp.client import DIM
from privkit.flower import Accounted, CanaryClients, write_audit

app = ServerApp()


@app.main()
def main(grid, context):
    c = context.run_config
    random.seed(c["seed"])  # Flower's draw of the round's nodes
    np.random.seed(c["seed"])  # Flower's noise
    n = len(list(grid.get_node_ids())) or c["sampled"]
    fedavg = FedAvg(
        fraction_train=c["sampled"] / n,
        fraction_evaluate=0.0,
        min_train_nodes=c["sampled"],
        min_available_nodes=n,
    )
    dp = DifferentialPrivacyClientSideFixedClipping(
        fedavg, noise_multiplier=1.0, clipping_norm=1.0, num_sampled_clients=c["sampled"]
    )
    accounted = Accounted(dp, delta=1e-5, out="runs", name="canary-clients", context=context)
    dp.noise_multiplier *= c["noise-scale"]
    strategy = CanaryClients(accounted, canaries=c["canaries"], seed=c["seed"])
    strategy.start(
        grid=grid, initial_arrays=ArrayRecord([np.zeros(DIM)]), num_rounds=c["num-server-rounds"]
    )
    audit = strategy.audit(confidence=0.99)
    write_audit(accounted.written, audit, 1e-5, "the server's client-level Gaussian")
