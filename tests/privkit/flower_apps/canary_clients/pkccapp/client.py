"""The canary-clients app's ClientApp (numpy only): each node moves the model by a fixed random
step of norm 2 (twice the clip norm); ``fixedclipping_mod`` clips it, ``CanaryClients.mod`` turns
the canary nodes' replies into their canary updates."""

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod

from privkit.flower.canary_clients import canary_mod

DIM = 1000

app = ClientApp(mods=[fixedclipping_mod, canary_mod])


@app.train()
def train(msg, context):
    pid = int(context.node_config["partition-id"])
    step = np.random.default_rng(1000 + pid).standard_normal(DIM)
    step *= 2.0 / np.linalg.norm(step)
    arrays = [a + step for a in msg.content["arrays"].to_numpy_ndarrays()]
    metrics = MetricRecord({"num-examples": 1})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)
