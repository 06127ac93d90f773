"""FedAvg (McMahan et al. 2017) and FedProx (Li et al. 2020), each with or without "+P"/"+F".

One round: the server samples ``round(participation * n)`` clients; each trains ``local_epochs``
epochs from the global model (Adam 1e-3, batch 32: FedAUX's setting); the server averages the
returned parameters weighted by ``|D_i|``. FedProx adds ``(mu/2) ||theta - theta_t||^2`` to the
local loss (the FedAUX code's ``lambda ||.||^2`` is ``mu = 2 lambda``). ``one_shot=true`` is the
one-round setting of FedAUX Table 3: ``rounds=1``, ``participation=1``, ``local_epochs=40``.
``pretrain=true`` starts from the SimCLR-pretrained h0 ("+P"), ``freeze=true`` keeps it fixed ("+F").
At the FedAUX grid's small ``mu`` (1e-2) and a few local steps the proximal gradient
``mu (theta - theta_t)`` is ~1e-4 against cross-entropy gradients ~1e-2, so FedProx's weights differ
from FedAvg's only slightly and test accuracy often agrees to every printed digit; the term itself
is tested in ``tests/privkit/test_trainers_i.py`` (closed form, and drift shrinking as mu grows).

Privacy: client models go to the server in the clear. Each participating client gets a
``NonPrivateEvent`` (label ``model-update``) per round, so every accountant reports epsilon = inf:
these methods make no formal DP claim. The loop here is shared with FedDF and FedAUX
(:func:`run_federated`), which add a server-side distillation step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from privkit.errors import PrivkitError
from privkit.methods.contract import TrainResult
from privkit.methods.fedavg import FedAvgConfig, FedProxConfig
from privkit.progress import progress_bar
from privkit.seeding import derive_seed, make_rng
from privkit.trainers.common import accuracy, average_states, resolve_device, train_supervised
from privkit.trainers.pretrain import init_model

MODEL_UPDATE_REASON = "client model parameters sent to the server without noise"


# ----------------------------------------------------------------------------- shared loop
ServerHook = Callable[[nn.Module, list[nn.Module], list[int], int], dict]


@dataclass
class FederatedOutcome:
    """What :func:`run_federated` hands back to the method that called it."""

    model: nn.Module
    spec: dict
    ledger: Any
    rounds: list[dict]
    client_models: list[nn.Module]
    client_ids: list[int]
    pretrain_info: dict = field(default_factory=dict)
    #: :attr:`FederatedRun.report_metrics` (False: the client models' accuracies are not taken)
    report_metrics: bool = True


def _prox_term(mu: float, anchor: dict[str, torch.Tensor]):
    def extra(model: nn.Module, xb: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        total = logits.new_zeros(())
        for name, p in model.named_parameters():
            if p.requires_grad:
                total = total + (p - anchor[name]).pow(2).sum()
        return 0.5 * mu * total

    return extra


def local_seed(seed: int, t: int, i: int) -> int:
    """The seed of client ``i``'s local training (its batches) in round ``t`` of a run seeded ``seed``."""
    return derive_seed(seed, f"local-{t}-{i}")


def copy_into(local: nn.Module, model: nn.Module) -> nn.Module:
    """``local`` (a module of ``model``'s architecture) overwritten in place with ``model``'s
    parameters and buffers: what ``copy.deepcopy(model)`` holds, bit for bit, without allocating a
    module (a deepcopy costs ~0.8 ms; an audit's fedavg runs made ~1,700). Gradients are dropped:
    training sets them before its first step (``zero_grad(set_to_none=True)``) or never reads them
    (:mod:`privkit.batched.exact_mlp`)."""
    with torch.no_grad():
        for param, src in zip(local.parameters(), model.parameters()):
            param.copy_(src)
            param.requires_grad_(src.requires_grad)
            param.grad = None
        for buffer, value in zip(local.buffers(), model.buffers()):
            buffer.copy_(value)
    return local


def local_update(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    cfg: FedAvgConfig,
    *,
    mu: float,
    seed: int,
    device,
    local: nn.Module | None = None,
) -> tuple[nn.Module, float]:
    """One client's local training from the global ``model`` (left untouched): the trained copy and
    its last epoch's mean loss. FedProx's anchor (``mu > 0``) is ``model`` itself. ``local``: a
    module of ``model``'s architecture to train instead of a fresh copy (overwritten with
    ``model`` first: :func:`copy_into`). Every engine runs a client's round through this function
    (:class:`FederatedRun`, :mod:`privkit.flower`)."""
    local = copy.deepcopy(model) if local is None else copy_into(local, model)
    anchor = {k: v.detach().clone() for k, v in model.named_parameters()}
    extra = _prox_term(mu, anchor) if mu > 0 else None
    loss = train_supervised(
        local,
        x,
        y,
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        device=device,
        seed=seed,
        optimizer=cfg.optimizer,
        extra_loss=extra,
    )
    return local, loss


def select_clients(rng: np.random.Generator, n: int, participation: float) -> list[int]:
    """``max(1, round(participation * n))`` distinct clients, uniformly (sorted)."""
    m = max(1, round(participation * n))
    return sorted(int(i) for i in rng.choice(n, size=m, replace=False))


class FederatedRun:
    """One run of :func:`run_federated` held between rounds, so that many runs can be stepped together.

    :meth:`next_round` selects the round's clients (``None`` after the last round), each selected
    client trains a copy of :attr:`model` (:meth:`train_local`), and :meth:`finish_round` takes
    the trained copies and their losses in the selected order: ledger, weighted averaging, the
    server hook, evaluation. The batched path (:mod:`privkit.batched.many_fedavg`) trains the
    selected clients of many runs at once and hands each run its copies the same way.
    """

    #: whether every round's row carries the test accuracy and the result the client models'
    #: accuracies; an audit's reference runs, never reported, skip them (NaN in their rows but
    #: the last, whose accuracy is the result's)
    report_metrics = True

    def __init__(
        self,
        federation,
        cfg: FedAvgConfig,
        seed: int,
        *,
        progress: bool = False,
        mu: float = 0.0,
        server_hook: ServerHook | None = None,
        ledger=None,
        model: nn.Module | None = None,
        spec: dict | None = None,
        pretrain_info: dict | None = None,
        neighbouring: str = "add_remove",
    ):
        from accountants import Ledger

        self.federation, self.cfg, self.seed, self.mu = federation, cfg, seed, mu
        self.server_hook, self.neighbouring = server_hook, neighbouring
        self.device = resolve_device(cfg)
        if model is None:
            model, spec, pretrain_info = init_model(federation, cfg, seed, progress=progress)
        self.model, self.spec, self.pretrain_info = model.to(self.device), spec, pretrain_info
        self.ledger = ledger if ledger is not None else Ledger()
        self.rng = make_rng(seed, "participation")
        self.x_test, self.y_test = federation.test_arrays()
        self.rounds: list[dict] = []
        self.last_models: list[nn.Module] = []
        self.last_ids: list[int] = []
        self.round_losses: list[float] = []  # the current round's clients' losses
        self.sizes = np.array([len(c) for c in federation.clients])
        self.t = 0
        self.selected: list[int] = []
        # the modules the round's clients train (:meth:`local_copy`), reused round after round
        self.spares: list[nn.Module] = []
        self.handed = 0

    def next_round(self) -> list[int] | None:
        """The next round's clients (those holding records among the sampled ones); ``None`` after
        the last round."""
        if self.t >= self.cfg.rounds:
            return None
        self.t += 1
        self.selected = [
            i
            for i in select_clients(self.rng, self.federation.num_clients, self.cfg.participation)
            if self.sizes[i] > 0
        ]
        self.anchor = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        # this round overwrites the last round's trained copies (:meth:`local_copy`)
        self.last_models, self.last_ids, self.handed = [], [], 0
        return list(self.selected)

    def local_copy(self) -> nn.Module:
        """A copy of the global model for the round's next client to train: one of the run's
        spare modules overwritten in place (:func:`copy_into`), a new one the first time a
        round needs it. A round's trained copies are read until its :meth:`finish_round` (the
        averaging, the server hook) and after the last round (:meth:`outcome`), never after the
        next round has begun, so the next round may overwrite them."""
        fresh = self.handed == len(self.spares)
        local = self.local_module()
        return local if fresh else copy_into(local, self.model)

    def local_module(self) -> nn.Module:
        """:meth:`local_copy`'s module without the copy: the round's next spare module as the
        last round left it (a copy of the global model the first time), for a caller that
        writes every parameter of it (the stacked training of an audit's reference runs starts
        its clients from the global model itself: :class:`privkit.batched.exact_mlp.Model`)."""
        if self.handed == len(self.spares):
            self.spares.append(copy.deepcopy(self.model))
        self.handed += 1
        return self.spares[self.handed - 1]

    def local_seed(self, i: int) -> int:
        """The seed of client ``i``'s local training (its batches) in the current round."""
        return local_seed(self.seed, self.t, i)

    def train_local(self, i: int) -> tuple[nn.Module, float]:
        """Client ``i``'s local training from the global model: the trained copy and its last
        epoch's mean loss."""
        x, y = self.federation.client_arrays(i)
        return local_update(
            self.model,
            x,
            y,
            self.cfg,
            mu=self.mu,
            seed=self.local_seed(i),
            device=self.device,
            local=self.local_copy(),
        )

    def finish_round(self, trained: list[tuple[nn.Module, float]]) -> None:
        """Record, average and evaluate the round from the selected clients' trained copies."""
        locals_ = self.average_round(trained)
        hook = self.server_hook
        extra = hook(self.model, locals_, list(self.selected), self.t) if hook and locals_ else {}
        self.end_round(extra)

    def average_round(self, trained: list[tuple[nn.Module, float]]) -> list[nn.Module]:
        """:meth:`finish_round` up to the server hook: the ledger entries and the weighted
        average of the selected clients' trained copies (returned, for the hook)."""
        from accountants import NonPrivateEvent

        cfg, t = self.cfg, self.t
        states, weights, losses, locals_ = [], [], [], []
        for i, (local, loss) in zip(self.selected, trained):
            states.append({k: v.detach() for k, v in local.state_dict().items()})
            weights.append(float(self.sizes[i]) if cfg.weighting == "size" else 1.0)
            losses.append(loss)
            locals_.append(local)
            self.ledger.add(
                i,
                NonPrivateEvent(MODEL_UPDATE_REASON),
                "model-update",
                round=t,
                neighbouring=self.neighbouring,
            )
        if states:
            self.model.load_state_dict(average_states(states, weights))
        self.round_losses, self.last_models = losses, locals_
        return locals_

    def end_round(self, extra_metrics: dict) -> None:
        """:meth:`finish_round` after the server hook (whose metrics are ``extra_metrics``): the
        evaluation and the round's row."""
        cfg, losses = self.cfg, self.round_losses
        acc = (
            accuracy(self.model, self.x_test, self.y_test, self.device, cfg.eval_batch_size)
            if self.report_metrics or self.t >= cfg.rounds  # the last round's is the result's
            else float("nan")
        )
        self.rounds.append(
            {
                "round": self.t,
                "test_accuracy": acc,
                "clients": len(self.selected),
                "train_loss": float(np.nanmean(losses)) if losses else float("nan"),
                **extra_metrics,
            }
        )
        self.last_ids = list(self.selected)

    def outcome(self) -> FederatedOutcome:
        if not self.cfg.keep_client_models:
            self.last_models, self.last_ids = [], []
        return FederatedOutcome(
            self.model,
            self.spec,  # type: ignore[arg-type]  # set in __init__
            self.ledger,
            self.rounds,
            self.last_models,
            self.last_ids,
            self.pretrain_info or {},
            self.report_metrics,
        )


def run_federated(
    federation,
    cfg: FedAvgConfig,
    seed: int,
    *,
    progress: bool = False,
    mu: float = 0.0,
    server_hook: ServerHook | None = None,
    ledger=None,
    model: nn.Module | None = None,
    spec: dict | None = None,
    pretrain_info: dict | None = None,
    description: str = "rounds",
    neighbouring: str = "add_remove",
) -> FederatedOutcome:
    """T rounds of local training + weighted parameter averaging (+ an optional server step).

    Parameters
    ----------
    federation, cfg, seed : the trainer's inputs.
    mu : FedProx proximal coefficient (0 = FedAvg).
    server_hook : ``hook(global_model, client_models, client_ids, round) -> metrics`` run after
        averaging (FedDF / FedAUX distillation); it may update ``global_model`` in place.
    ledger : an existing :class:`accountants.Ledger` to append to (a new one otherwise).
    model, spec, pretrain_info : a prepared initial model (else :func:`init_model`).
    neighbouring : relation recorded with the (non-private) model-update entries; it must match
        the other entries of the same client (FedAUX's scores are replace-one).
    """
    run = FederatedRun(
        federation,
        cfg,
        seed,
        progress=progress,
        mu=mu,
        server_hook=server_hook,
        ledger=ledger,
        model=model,
        spec=spec,
        pretrain_info=pretrain_info,
        neighbouring=neighbouring,
    )
    return drive(run, progress, description)


def drive(
    run: FederatedRun, progress: bool = False, description: str = "rounds"
) -> FederatedOutcome:
    """Run ``run`` to its end, one client after the other."""
    with progress_bar(progress) as bar:
        task = bar.add_task(description, total=run.cfg.rounds)
        while (selected := run.next_round()) is not None:
            run.finish_round([run.train_local(i) for i in selected])
            bar.update(task, advance=1, info=f"acc {run.rounds[-1]['test_accuracy']:.3f}")
    return run.outcome()


def result_from_outcome(
    method: str,
    seed: int,
    cfg: FedAvgConfig,
    out: FederatedOutcome,
    *,
    artifacts: dict[str, np.ndarray] | None = None,
    warnings: list[str] | None = None,
    claims: dict | None = None,
    federation=None,
) -> TrainResult:
    """Package a :class:`FederatedOutcome` as the method's :class:`TrainResult`."""
    arts = dict(artifacts or {})
    if out.client_models:
        arts["client_model_ids"] = np.asarray(out.client_ids, dtype=np.int64)
    client_acc: list[float] = []
    if federation is not None and out.client_models and out.report_metrics:
        device = resolve_device(cfg)
        x_test, y_test = federation.test_arrays()
        client_acc = [
            accuracy(m, x_test, y_test, device, cfg.eval_batch_size) for m in out.client_models
        ]
    warns = list(warnings or [])
    if out.pretrain_info:
        warns.append(
            f"h0 pretrained (SimCLR, NT-Xent) on {out.pretrain_info['size']} public "
            f"examples ({out.pretrain_info['data']} part), {out.pretrain_info['epochs']} epochs; "
            "public data only, no privacy cost"
        )
    return TrainResult(
        method=method,
        seed=seed,
        config=cfg.model_dump(),
        model=out.model.cpu(),
        model_spec=out.spec,
        ledger=out.ledger,
        rounds=out.rounds,
        test_accuracy=out.rounds[-1]["test_accuracy"] if out.rounds else float("nan"),
        artifacts=arts,
        client_models=[m.cpu() for m in out.client_models],
        client_model_specs=[out.spec] * len(out.client_models),
        client_accuracy=client_acc,
        warnings=warns,
        claims=claims or {},
    )


NO_DP_CLAIM = {
    "epsilon": float("inf"),
    "delta": None,
    "composition": None,
    "scope": "none: client models are sent to the server in the clear",
    "source": "no formal DP claim",
}


def fedavg_run(
    federation, config: FedAvgConfig, seed: int, progress: bool = False, method: str = "fedavg"
) -> tuple[FederatedRun, Callable[[FederatedOutcome], TrainResult]]:
    """FedAvg's (or FedProx's) run and what turns its outcome into the method's result."""
    mu = 0.0
    if method == "fedprox":
        mu = cast(FedProxConfig, config).mu  # fedprox's config
        if mu <= 0:
            raise PrivkitError(f"mu must be > 0 for fedprox; found {mu}")
    run = FederatedRun(federation, config, seed, progress=progress, mu=mu)
    return run, lambda out: result_from_outcome(
        method, seed, config, out, claims=dict(NO_DP_CLAIM), federation=federation
    )


# method "fedavg": config and registration in privkit.methods.fedavg
def train_fedavg(
    federation, config: FedAvgConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedAvg (+P / +F). See the module docstring."""
    run, finish = fedavg_run(federation, config, seed, progress)
    return finish(drive(run, progress, "fedavg rounds"))


def fedprox_run(federation, config: FedProxConfig, seed: int, progress: bool = False):
    """FedProx's run and result (:func:`fedavg_run`)."""
    return fedavg_run(federation, config, seed, progress, method="fedprox")


# method "fedprox": config and registration in privkit.methods.fedavg
def train_fedprox(
    federation, config: FedProxConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedProx (+P / +F). See the module docstring."""
    run, finish = fedprox_run(federation, config, seed, progress)
    return finish(drive(run, progress, "fedprox rounds"))


__all__ = [
    "FedAvgConfig",
    "FedProxConfig",
    "FederatedOutcome",
    "FederatedRun",
    "copy_into",
    "drive",
    "fedavg_run",
    "fedprox_run",
    "local_seed",
    "local_update",
    "result_from_outcome",
    "run_federated",
    "select_clients",
    "train_fedavg",
    "train_fedprox",
]
