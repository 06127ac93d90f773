"""Non-private centralised training on the pooled client data (the no-privacy reference point).

Same model, optimiser, epochs and batch size as :mod:`privkit.trainers.dpsgd`, with shuffled
batches and no clipping or noise. The ledger records a :class:`accountants.NonPrivateEvent` for
every client: there is no formal guarantee, only what the audits measure.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from privkit.methods.contract import TrainResult
from privkit.methods.dpsgd import CentralConfig
from privkit.seeding import derive_seed
from privkit.trainers.common import (
    accuracy,
    make_optimizer,
    new_model,
    resolve_device,
    train_supervised,
)


# method "centralized": registration in privkit.methods.centralized (config: privkit.methods.dpsgd)
def train_centralized(
    federation, config: CentralConfig, seed: int, progress: bool = False
) -> TrainResult:
    """Train one model on all clients' records pooled; per-epoch test accuracy in ``rounds``."""
    device = resolve_device(config)
    x, y = federation.pooled_arrays()
    x_test, y_test = federation.test_arrays()
    model, spec = new_model(federation, config, derive_seed(seed, "init"))
    opt_seed = derive_seed(seed, "batches")

    opt = make_optimizer(list(model.to(device).parameters()), config.optimizer, config.lr)
    rounds = []
    epochs: Iterable[int] = range(1, config.epochs + 1)
    if progress:
        from rich.progress import track

        epochs = track(epochs, description="centralized epochs")
    for epoch in epochs:
        # one epoch per call, the optimiser (and its state) persists across epochs
        loss = train_supervised(
            model,
            x,
            y,
            epochs=1,
            batch_size=config.batch_size,
            lr=config.lr,
            device=device,
            seed=derive_seed(opt_seed, f"epoch{epoch}"),
            opt=opt,
        )
        rounds.append(
            {"round": epoch, "test_accuracy": accuracy(model, x_test, y_test, device), "loss": loss}
        )
    return centralized_result(federation, config, seed, model.cpu(), spec, rounds, device)


def centralized_result(
    federation,
    config: CentralConfig,
    seed: int,
    model: torch.nn.Module,
    spec: dict,
    rounds: list[dict],
    device: torch.device,
    test_accuracy: float | None = None,
) -> TrainResult:
    """The :class:`TrainResult` of a centralised run (its single and batched forms share it): the
    trained ``model`` (on the CPU), its per-epoch ``rounds``, a non-private ledger entry for every
    client and the final test accuracy on ``device``.

    Parameters
    ----------
    federation : Federation
        The run's federation: its clients (the ledger's keys) and test set.
    config : CentralConfig
        The run's trainer config, stored in the result.
    seed : int
        The run's seed, stored in the result.
    model : torch.nn.Module
        The trained model, on the CPU.
    spec : dict
        Its architecture spec (:func:`privkit.models.model_spec`).
    rounds : list[dict]
        Per epoch ``{"round", "test_accuracy", "loss"}``.
    device : torch.device
        Where the final test accuracy is computed.
    test_accuracy : float or None
        The trained model's test accuracy where the caller has it (the batched form: its last
        epoch's, from the stacked forward pass); ``None`` (default): computed here.
    """
    from accountants import Ledger, NonPrivateEvent

    x_test, y_test = federation.test_arrays()
    ledger = Ledger()
    event = NonPrivateEvent("centralised training on the pooled records without clipping or noise")
    for k in range(federation.num_clients):
        ledger.add(k, event, "non-private training (pooled data)")
    return TrainResult(
        method="centralized",
        seed=seed,
        config=config.model_dump(),
        model=model,
        model_spec=spec,
        ledger=ledger,
        rounds=rounds,
        test_accuracy=(
            accuracy(model, x_test, y_test, device) if test_accuracy is None else test_accuracy
        ),
        warnings=[
            (
                "No formal privacy guarantee: the model is trained on the pooled records "
                "in the clear; its protection is only what the audits measure."
            )
        ],
        claims={"epsilon": float("inf"), "source": "non-private baseline"},
    )
