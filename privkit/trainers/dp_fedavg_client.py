"""Client-level DP-FedAvg (McMahan, Ramage, Talwar & Zhang, ICLR 2018), fixed clipping.

The algorithm Flower's ``DifferentialPrivacyServerSideFixedClipping`` implements, with the paper's
client sampling and fixed-denominator estimator. One round ``t``:

* **sampling**: every one of the ``N`` clients takes part independently with probability ``q``
  (``client_rate``; Poisson sampling, the paper's ``C^t``), drawn from the mechanism's secret
  stream (release mode: AES-CTR keyed from the OS). A round may sample no client; it still
  releases (noise only) and is still accounted;
* **clients**: each sampled client trains ``E`` (``local_epochs``) epochs of plain SGD from the
  global model ``w_t`` on its own data and sends ``Delta_k = w_local - w_t`` (every entry of the
  model's state);
* **server**: clips each update to L2 norm ``S`` (``clip_norm``):
  ``Delta_k min(1, S / ||Delta_k||)``; releases the sum of the clipped updates with
  ``N(0, (z S)^2 I)`` noise (``noise_multiplier`` ``z``) through the release primitive
  :func:`privkit.mechanisms.gaussian.gaussian_release`; divides by the *expected* number of clients
  ``q N`` (the paper's fixed-denominator estimator ``f~_f`` with equal weights); and sets
  ``w_{t+1} = w_t + released / (q N)``.

**Accounting** (client-level DP, add/remove one client, i.e. one client's whole data): adding or
removing one client changes the sum of clipped updates by at most ``S`` and only when that client
is sampled (rate ``q``), so each round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, the
event of the round's release receipt. That release touches every client's data (each client's
participation is one of the Poisson coins), so every client's ledger entry for round ``t`` is that
receipt's event, labelled ``round t: client-level gaussian``; the per-client epsilon is the
epsilon of one client's whole data. privkit's other federated methods draw a fixed number of
clients per round; this one draws Poisson coins because the add/remove-one-client amplification
(dp-accounting's ``PoissonSampledDpEvent``) is for that sampling. A record of a client is covered
too, but only as part of its client: changing one record changes that client's update (a
replacement at the client level), which by group privacy costs at most two add/remove steps.

The per-round metrics hold the round, the test accuracy and the epsilon so far; which clients the
round drew, how many updates were clipped and the updates' median norm are added only with
``reproducible_noise`` (a run not for release): the draw must stay hidden for the amplification
the ledger counts, and the raw updates' norms are not private.

``noise_multiplier = 0`` is the noise-free twin (clipped FedAvg with the fixed denominator): its
releases are recorded as ``NonPrivateEvent`` (epsilon infinite).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from privkit.errors import PrivkitError
from privkit.methods.contract import TrainResult
from privkit.methods.dp_fedavg_client import PAPER, QUICK, DpFedAvgClientConfig  # noqa: F401  (re-exported)
from privkit.seeding import derive_seed, noise_generator, noise_rng
from privkit.trainers.common import accuracy, new_model, resolve_device, train_supervised

__all__ = [
    "DpFedAvgClientConfig",
    "clip_update",
    "server_update",
    "train_dp_fedavg_client",
]

LABEL = "client-level gaussian"
"""The ledger label of a round's release (``round t: client-level gaussian``)."""
NO_NOISE = "noise_multiplier = 0: the clipped updates' mean is released without noise"


def _float_keys(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if torch.is_floating_point(v)]


def clip_update(delta: dict[str, torch.Tensor], clip_norm: float) -> tuple[dict, float]:
    """``delta`` scaled to L2 norm at most ``clip_norm`` over all its tensors together, and its norm
    before clipping."""
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in delta.values()))
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {k: v * factor for k, v in delta.items()}, norm


def server_update(
    global_state: dict[str, torch.Tensor],
    local_states: Sequence[dict[str, torch.Tensor]],
    *,
    clip_norm: float,
    noise_multiplier: float,
    client_rate: float,
    num_clients: int,
    source: Any,
) -> tuple[dict[str, torch.Tensor], Any, list[float]]:
    """One server step: the new global state, the release's receipt and the updates' norms.

    Clips each ``local_state - global_state`` to ``clip_norm``, releases their sum with
    ``N(0, (noise_multiplier clip_norm)^2)`` on every coordinate (the release primitive, Poisson
    rate ``client_rate`` in its receipt) and adds ``released / (client_rate num_clients)`` to the
    global state. ``local_states`` may be empty (a round that sampled no client).
    """
    from privkit.mechanisms.gaussian import gaussian_release

    keys = _float_keys(global_state)
    total = {k: torch.zeros_like(global_state[k]) for k in keys}
    norms = []
    for local in local_states:
        clipped, norm = clip_update({k: local[k] - global_state[k] for k in keys}, clip_norm)
        norms.append(norm)
        for k in keys:
            total[k] += clipped[k]
    released, receipt = gaussian_release(
        total,
        std=noise_multiplier * clip_norm,
        sensitivity=clip_norm,
        source=source,
        sample_rate=client_rate,
    )
    denominator = client_rate * num_clients
    new = dict(global_state)
    for k in keys:
        new[k] = global_state[k] + released[k] / denominator
    return new, receipt, norms


def _round_event(receipt: Any):
    from accountants import NonPrivateEvent

    return receipt.event if receipt.noise_multiplier > 0 else NonPrivateEvent(NO_NOISE)


def _epsilon(cfg: DpFedAvgClientConfig, rounds: int) -> float:
    """The per-client epsilon after ``rounds`` rounds (``cfg.accountant`` at ``cfg.delta``)."""
    if cfg.noise_multiplier == 0:
        return math.inf
    from accountants import dpsgd_epsilon

    return float(
        dpsgd_epsilon(
            cfg.client_rate, cfg.noise_multiplier, rounds, cfg.delta, accountant=cfg.accountant
        )
    )


def _warnings(cfg: DpFedAvgClientConfig, n: int) -> list[str]:
    out = [
        (
            f"Accounting is client-level (user-level), add/remove one client: each round is one "
            f"Gaussian release (z = {cfg.noise_multiplier:g}) of the sum of updates clipped to "
            f"S = {cfg.clip_norm:g}, in which every client takes part by an independent coin of "
            f"probability q = {cfg.client_rate:g}, divided by the expected number of clients "
            f"q N = {cfg.client_rate * n:g}. Every "
            "client's epsilon protects its whole data; a single record is covered as part of its "
            "client (changing it replaces the client's update: at most twice the add/remove cost "
            "by group privacy)."
        ),
        (
            "The server is trusted to clip and add the noise (central DP, as Flower's server-side "
            "fixed clipping): the clients' unclipped updates reach it in the clear."
        ),
    ]
    if cfg.noise_multiplier == 0:
        out.append(f"{NO_NOISE}: no formal DP guarantee (the noise-free twin).")
    return out


def train_dp_fedavg_client(
    federation, config: DpFedAvgClientConfig, seed: int, progress: bool = False
) -> TrainResult:
    """Client-level DP-FedAvg with fixed clipping (see the module docstring)."""
    from accountants import Ledger

    cfg = config
    device = resolve_device(cfg)
    n = federation.num_clients
    model, spec = new_model(federation, cfg, derive_seed(seed, "init"))
    model.to(device)
    data = [federation.client_arrays(k) for k in range(n)]
    x_test, y_test = federation.test_arrays()
    # the Poisson coins and the noise are the mechanism's secret randomness
    coins = noise_rng(seed, "client-sampling", reproducible=cfg.reproducible_noise)
    noise = noise_generator(seed, "noise", reproducible=cfg.reproducible_noise, device=device)
    ledger = Ledger()
    rows: list[dict] = []
    stop = f"completed all {cfg.rounds} rounds"
    iterator: Iterable[int] = range(1, cfg.rounds + 1)
    if progress:
        from rich.progress import track

        iterator = track(iterator, description="dp-fedavg-client rounds")
    for t in iterator:
        eps = _epsilon(cfg, t)  # every client's epsilon once this round is released
        if cfg.target_epsilon is not None and eps > cfg.target_epsilon:
            stop = (
                f"stopped before round {t}: it would bring every client to epsilon {eps:.4g} > "
                f"target {cfg.target_epsilon:g} ({cfg.accountant}, delta={cfg.delta:g})"
            )
            break
        sampled = [int(k) for k in np.flatnonzero(coins.random(n) < cfg.client_rate)]
        global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        locals_ = []
        for k in sampled:
            local = copy.deepcopy(model)
            x, y = data[k]
            train_supervised(
                local,
                x,
                y,
                epochs=cfg.local_epochs,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                device=device,
                seed=derive_seed(seed, f"round{t}/client{k}"),
                optimizer="sgd",
            )
            locals_.append({k2: v.detach() for k2, v in local.state_dict().items()})
        new, receipt, norms = server_update(
            global_state,
            locals_,
            clip_norm=cfg.clip_norm,
            noise_multiplier=cfg.noise_multiplier,
            client_rate=cfg.client_rate,
            num_clients=n,
            source=noise,
        )
        model.load_state_dict(new)
        event = _round_event(receipt)
        for k in range(n):
            ledger.add(k, event, f"round {t}: {LABEL}", round=t)
        row: dict[str, Any] = {
            "round": t,
            "test_accuracy": accuracy(model, x_test, y_test, device),
            "epsilon": eps,
        }
        if cfg.reproducible_noise:
            # diagnostics of the clients' raw updates and of the round's draw: not released by a
            # run for release (the accounting's amplification assumes the draw stays hidden)
            row["clients"] = sampled
            row["clipped"] = int(sum(v > cfg.clip_norm for v in norms))
            row["update_norm_median"] = float(np.median(norms)) if norms else None
        rows.append(row)
    if not rows:
        raise PrivkitError(
            f"target_epsilon must allow at least one round; found {cfg.target_epsilon:g} < the "
            f"epsilon of one round {_epsilon(cfg, 1):.4g}"
        )
    warns = _warnings(cfg, n)
    warns.append(f"Training {stop}.")
    return TrainResult(
        method="dp-fedavg-client",
        seed=seed,
        config=cfg.model_dump(),
        model=model.cpu(),
        model_spec=spec,
        ledger=ledger,
        rounds=rows,
        test_accuracy=accuracy(model, x_test, y_test, device),
        warnings=warns,
    )
