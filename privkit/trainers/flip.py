"""FLiP: federated learning by local-global dataset distillation (Xu et al.; seed 002).

Algorithm 1 and Eq. 2-5 of the paper:

* the server shares a random initial model ``theta_init`` and initial distilled data: ``K = k x
  classes`` samples ``S`` (slot j is initialised for class ``j % classes``), learnable soft labels
  (parametrised by label logits ``L``; soft label = softmax(L)) and per-sample learning rates
  ``eta = clip(softplus(rho), min_rate, max_rate)`` (Wang et al.'s dataset distillation:
  softplus rates initialised at 0.02);
* each round every client, starting from the current aggregate, runs ``Eps`` local epochs over
  its raw data in batches; for each batch it unrolls training from ``theta_init`` through the K
  samples, one sample per step (``theta_j = theta_{j-1} - eta_j grad L(phi(s_j), softmax(L_j))``,
  differentiable), takes the cross-entropy of ``phi_{theta_K}`` on the raw batch and steps
  ``S``, ``L``, ``rho`` with Adam (betas (0.5, 0.999), step ``gamma`` halved every 40 rounds);
* the server averages samples, label logits and learning rates element-wise (Eq. 4);
* the released model is ``theta_init`` trained one pass over the aggregated samples (Eq. 5).

FLiP makes no formal DP claim; what it shares each round is the distilled data itself.  The
ledger records that share as a :class:`accountants.NonPrivateEvent` and the result's artifacts
carry each client's last upload (``distilled_x/client_<i>``, ``distilled_y/client_<i>``,
``distilled_lr/client_<i>``) so attribute-inference audits can attack it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from privkit.errors import PrivkitError
from privkit.methods.contract import TrainResult
from privkit.methods.flip import PAPER, FlipAttackConfig, FlipConfig  # noqa: F401  (re-exported)
from privkit.seeding import derive_seed, torch_generator
from privkit.trainers import flip_rank_one
from privkit.trainers.common import accuracy, as_tensor, minibatches, new_model, resolve_device

NO_DP_REASON = "FLiP claims no formal DP; protection is only what the audits measure"


# ----------------------------------------------------------------------------- parametrisation
def rates_from_raw(rho: torch.Tensor, min_rate: float, max_rate: float) -> torch.Tensor:
    """Per-sample learning rates ``clip(softplus(rho), min_rate, max_rate)``."""
    return torch.clamp(F.softplus(rho), min=min_rate, max=max_rate)


def raw_from_rates(eta: torch.Tensor) -> torch.Tensor:
    """Inverse softplus: ``rho`` with ``softplus(rho) = eta`` (eta > 0)."""
    eta = torch.clamp(eta, min=1e-12)
    return eta + torch.log(-torch.expm1(-eta))


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``-sum_c q_c log softmax(logits)_c``."""
    return -(target_probs * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


# ----------------------------------------------------------------------------- the unroll
def initial_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``theta_init`` as detached tensors (the leaves the unroll starts from)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _call(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` with ``params`` in place of its parameters. privkit's models tie no weights, so
    the search for tied ones (``tie_weights=True``, a walk over the module tree per call) is skipped:
    the unroll calls this 21 times per batch, and the walk cost 8% of a quick run (same weights)."""
    return functional_call(model, params, (x,), tie_weights=False)


def unroll(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor],
    samples: torch.Tensor,
    label_logits: torch.Tensor,
    rates: torch.Tensor,
    *,
    create_graph: bool = True,
) -> dict[str, torch.Tensor]:
    """Train from ``params`` through the K samples, one sample per SGD step (Eq. 5 / Alg. 1 line 10).

    ``theta_j = theta_{j-1} - rates[j] * grad_theta CE(phi_theta(samples[j]), softmax(label_logits[j]))``.
    With ``create_graph`` the result is differentiable in ``samples``, ``label_logits`` and
    ``rates`` (second-order terms included).
    """
    names = list(params)
    theta = [
        params[n] if params[n].requires_grad else params[n].detach().requires_grad_(True)
        for n in names
    ]
    with torch.enable_grad():
        for j in range(samples.shape[0]):
            out = _call(model, dict(zip(names, theta)), samples[j : j + 1])
            loss = soft_cross_entropy(out, F.softmax(label_logits[j : j + 1], dim=1))
            grads = torch.autograd.grad(loss, theta, create_graph=create_graph)
            if create_graph:
                theta = [p - rates[j] * g for p, g in zip(theta, grads)]
            else:
                theta = [
                    (p - rates[j] * g).detach().requires_grad_(True) for p, g in zip(theta, grads)
                ]
    return {n: (t if create_graph else t.detach()) for n, t in zip(names, theta)}


def raw_loss(
    model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """``L_raw`` of Algorithm 1 line 12: cross-entropy of the unrolled model on a raw batch."""
    return F.cross_entropy(_call(model, params, x), y)


# ----------------------------------------------------------------------------- client / server
def _adam(leaves: list[torch.Tensor], lr: float, config: FlipConfig) -> torch.optim.Adam:
    """The clients' Adam over their samples, label logits and rates. torch's fused kernel where
    it has one (CPU and CUDA): one pass over each tensor where the default takes six, with
    temporaries as large as the samples (3.5x faster for an audit's 320 clients on the CPU;
    the same update up to float rounding)."""
    fused = True if leaves[0].device.type in ("cpu", "cuda") else None
    return torch.optim.Adam(
        leaves, lr=lr, betas=(config.adam_beta1, config.adam_beta2), fused=fused
    )


def client_update(
    model: torch.nn.Module,
    init: dict[str, torch.Tensor],
    samples: torch.Tensor,
    label_logits: torch.Tensor,
    rates: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    config: FlipConfig,
    lr: float,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One client's local procedure (Algorithm 1): returns its new samples, label logits, rates, last loss."""
    s = samples.detach().clone().requires_grad_(True)
    lab = label_logits.detach().clone().requires_grad_(True)
    rho = raw_from_rates(rates.detach().clone()).requires_grad_(True)
    opt = _adam([s, lab, rho], lr, config)
    gen = torch_generator(seed)
    last = float("nan")
    for _ in range(config.local_epochs):
        for idx in minibatches(len(y), config.batch_size, gen):
            idx = idx.to(x.device)
            eta = rates_from_raw(rho, config.min_rate, config.max_rate)
            theta = unroll(model, init, s, lab, eta, create_graph=True)
            loss = raw_loss(model, theta, x[idx], y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = float(loss.detach())
    eta = rates_from_raw(rho, config.min_rate, config.max_rate)
    return s.detach(), lab.detach(), eta.detach(), last


def round_updates(
    model: torch.nn.Module,
    init: dict[str, torch.Tensor],
    samples: torch.Tensor,
    label_logits: torch.Tensor,
    rates: torch.Tensor,
    clients: Sequence[tuple[torch.Tensor, torch.Tensor]],
    config: FlipConfig,
    lr: float,
    seeds: Sequence[int],
    rows_cache: dict | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """:func:`client_update` of every client of a round (``(x, y)`` and seed each), in order.

    privkit's MLP takes the rank-one form (:mod:`privkit.trainers.flip_rank_one`), its clients
    stepping together, each with its own batches (its seed) and Adam state: the same updates as
    :func:`client_update` up to rounding, an order of magnitude faster. Other models run
    :func:`client_update` one client after the other.

    ``rows_cache``: a dict the caller keeps across the rounds of one run (the same clients' data
    tensors and ``init``), in which the clients' padded raw rows are kept from one round to the
    next (FLiP's unroll always starts from ``theta_init``, so neither they nor their first
    layer's products change); ``None``: built every round."""
    names = flip_rank_one.mlp_linear_names(model)
    if names is None:
        return [
            client_update(model, init, samples, label_logits, rates, x, y, config, lr, s)
            for (x, y), s in zip(clients, seeds)
        ]
    C = len(clients)
    start = (
        samples.detach().unsqueeze(0).repeat(C, *[1] * samples.dim()),
        label_logits.detach().unsqueeze(0).repeat(C, 1, 1),
        raw_from_rates(rates.detach()).unsqueeze(0).repeat(C, 1),
    )
    return _in_groups(names, [init] * C, start, clients, config, lr, seeds, rows_cache)


def runs_round_updates(
    model: torch.nn.Module,
    starts: Sequence[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]],
    clients: Sequence[tuple[torch.Tensor, torch.Tensor]],
    config: FlipConfig,
    lr: float,
    seeds: Sequence[int],
    rows_cache: dict | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """:func:`round_updates` of the clients of several runs' rounds at once: client c starts from
    its run's ``starts[c] = (init, samples, label_logits, rates)``. privkit's MLP steps every
    client of every run together (the rank-one lockstep, the layers stacked per run where each
    run's clients are consecutive and as many, else per client): each client's update equals its
    run's :func:`round_updates` up to float rounding, not bit for bit (other kernels on other
    shapes; an audit's reference runs take it). Other models run :func:`client_update` one
    client after the other.

    Parameters
    ----------
    model : torch.nn.Module
        The runs' model (their common architecture); its parameters are not read.
    starts : Sequence[tuple]
        Per client its run's ``theta_init`` (a parameter dict), distilled samples, label logits
        and rates, the round's starting point.
    clients : Sequence[tuple[torch.Tensor, torch.Tensor]]
        Per client its ``(x, y)``.
    config : FlipConfig
        The runs' common config (local epochs, batch size, rate bounds, Adam's betas).
    lr : float
        The round's distillation step size, the same for every run (runs in lockstep share the
        round number).
    seeds : Sequence[int]
        Per client the seed of its batches.
    rows_cache : dict or None
        As :func:`round_updates`': kept by the caller across the rounds of the same runs.
    """
    names = flip_rank_one.mlp_linear_names(model)
    if names is None:
        return [
            client_update(model, init, S, L, E, x, y, config, lr, seed)
            for (init, S, L, E), (x, y), seed in zip(starts, clients, seeds)
        ]
    start = (
        torch.stack([s[1].detach() for s in starts]),
        torch.stack([s[2].detach() for s in starts]),
        torch.stack([raw_from_rates(s[3].detach()) for s in starts]),
    )
    inits = [s[0] for s in starts]
    return _in_groups(names, inits, start, clients, config, lr, seeds, rows_cache)


def _in_groups(names, inits, start, clients, config: FlipConfig, lr, seeds, rows_cache):
    """The lockstep updates of ``clients`` from ``start`` (samples, label logits, raw rates, each
    with a client axis), the clients in groups with as many batches per epoch, each client's
    starting layers (parameter ``names``) read from its run's ``inits``."""
    batches = [-(-len(y) // config.batch_size) for _, y in clients]
    out: list = [None] * len(clients)
    for count in sorted(set(batches)):  # clients stepping in lockstep: as many batches per epoch
        group = [i for i, n in enumerate(batches) if n == count]
        members = [clients[i] for i in group]
        layers = _stacked_layers(names, [inits[i] for i in group])
        padded = _rows(rows_cache, count, layers, members, [inits[i] for i in group])
        index = torch.tensor(group, device=start[0].device)
        samples, label_logits, raw_rates = (t.index_select(0, index) for t in start)
        results = _lockstep_from(
            layers,
            samples,
            label_logits,
            raw_rates,
            padded,
            config,
            lr,
            [seeds[i] for i in group],
        )
        for i, r in zip(group, results):
            out[i] = r
    return out


def _stacked_layers(names, inits) -> list:
    """The starting layers of clients with their runs' ``inits``: shared where they are one run's,
    else one per run (``(R, out, in)``) where each run's clients are consecutive and as many,
    else one per client."""
    if all(i is inits[0] for i in inits):
        return [(inits[0][w], inits[0][b]) for w, b in names]
    firsts = [0] + [c for c in range(1, len(inits)) if inits[c] is not inits[c - 1]]
    sizes = {b - a for a, b in zip(firsts, [*firsts[1:], len(inits)])}
    owners = firsts if len(sizes) == 1 and len({id(i) for i in inits}) == len(firsts) else None
    chosen = [inits[c] for c in owners] if owners is not None else list(inits)
    return [
        (torch.stack([i[w] for i in chosen]), torch.stack([i[b] for i in chosen])) for w, b in names
    ]


def _rows(rows_cache, count, layers, clients, inits) -> _PaddedBatches:
    """The group's :class:`_PaddedBatches`, from ``rows_cache`` where it holds one for the same
    clients' tensors and initial models."""
    if rows_cache is not None:
        kept = rows_cache.get(count)
        if (
            kept is not None
            and len(kept[0]) == len(clients)
            and all(a is x for a, (x, _) in zip(kept[0], clients))
            and all(a is b for a, b in zip(kept[1], inits))
        ):
            return kept[2]
    padded = _PaddedBatches(layers, clients)
    if rows_cache is not None:
        rows_cache[count] = ([x for x, _ in clients], list(inits), padded)
    return padded


def _lockstep_from(
    layers, samples, label_logits, raw_rates, padded: _PaddedBatches, config: FlipConfig, lr, seeds
):
    """The updates of clients with as many batches per epoch, stacked along a client axis from
    each client's own starting point: ``samples`` (C, K, ...), ``label_logits`` (C, K, classes),
    raw rates ``rho`` (C, K), ``layers`` shared or per model
    (:data:`~privkit.trainers.flip_rank_one.Layers`), and their raw rows ``padded``. Each batch is
    padded to the longest and masked, the loss a sum of the clients' means (their parameters are
    disjoint: each gets its own gradient).

    Where an epoch is one batch (the batch size at least every client's data), each batch is
    its client's whole data in the order drawn; the batch's mean loss does not depend on that
    order (it changes float rounding only), so the rows stay in place and the padded batches
    are gathered once, not at every step (for an audit's 320 clients, 160 MB a step)."""
    C = len(seeds)
    s = samples.requires_grad_(True)
    lab = label_logits.requires_grad_(True)
    rho = raw_rates.requires_grad_(True)
    opt = _adam([s, lab, rho], lr, config)
    gens = [torch_generator(seed) for seed in seeds]
    last = torch.full((C,), float("nan"))
    whole = -(-len(padded.ys[0]) // config.batch_size) == 1
    for _ in range(config.local_epochs):
        # one batch an epoch: each batch is its client's whole data, its rows in place, so its
        # order is not drawn (the clients' generators live for this round only)
        epoch: list[list[Any]] = (
            [[None]] * C
            if whole
            else [list(minibatches(len(y), config.batch_size, g)) for y, g in zip(padded.ys, gens)]
        )
        for b in range(len(epoch[0])):
            rows = padded.whole if whole else padded([epoch[c][b] for c in range(C)])
            eta = rates_from_raw(rho, config.min_rate, config.max_rate)
            per_client = flip_rank_one.losses(
                layers, s.reshape(C, s.shape[1], -1), F.softmax(lab, dim=-1), eta, rows
            )
            opt.zero_grad(set_to_none=True)
            per_client.sum().backward()
            opt.step()
            last = per_client.detach()
    eta = rates_from_raw(rho, config.min_rate, config.max_rate).detach()
    return [(s[c].detach(), lab[c].detach(), eta[c], float(last[c])) for c in range(C)]


class _PaddedBatches:
    """A lockstep group's raw rows as :class:`~privkit.trainers.flip_rank_one.RawRows`: each
    client's rows narrowed to the input columns it uses (:func:`~privkit.trainers.flip_rank_one.
    used_columns`), with their first layer's ``W x + b`` at the starting weights, each step's
    batches padded to the longest with zeros.

    Every client's rows are joined once (on the first gather), a zero row last for the padding,
    so each step's batches are one gather per tensor, whatever the number of clients: one gather
    per client and tensor was 20,000 calls in a FLiP audit (320 clients). :attr:`whole` pads every
    client's whole data in place, with no join and no gather, once."""

    def __init__(self, layers, clients: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        flat = [x.reshape(len(x), -1) for x, _ in clients]
        self.cols = flip_rank_one.used_columns(flat)
        self.ys = [y for _, y in clients]
        self.rows = flip_rank_one.narrowed(flat, self.cols)
        self.firsts = flip_rank_one.first_layer(layers, flat)
        sizes = [len(y) for y in self.ys]
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
        self.pad = int(sum(sizes))  # the zero row

    @functools.cached_property
    def joined(self) -> list[torch.Tensor]:
        sources = (self.rows, self.ys, self.firsts)
        return [torch.cat([*ts, ts[0].new_zeros((1, *ts[0].shape[1:]))]) for ts in sources]

    def __call__(self, idxs: list[torch.Tensor]) -> flip_rank_one.RawRows:
        """The batches of rows ``idxs[c]`` of every client."""
        n = max(len(idx) for idx in idxs)
        device = self.joined[0].device
        index = torch.nn.utils.rnn.pad_sequence(
            [idx + start for idx, start in zip(idxs, self.starts)],
            batch_first=True,
            padding_value=self.pad,
        ).to(device)
        x, y, first = (t[index] for t in self.joined)
        lengths = torch.tensor([len(idx) for idx in idxs], device=device)
        mask = flip_rank_one.row_mask(lengths, n).to(x.dtype)
        return flip_rank_one.raw_rows(x, y, mask, first, self.cols)

    @functools.cached_property
    def whole(self) -> flip_rank_one.RawRows:
        """Every client's whole data, its rows in place."""
        return flip_rank_one.padded_rows(self.rows, self.ys, self.firsts, self.cols)


def aggregate(
    uploads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 4: element-wise mean over clients of samples, label logits and learning rates."""
    if not uploads:
        raise PrivkitError("aggregate needs at least one client upload; found 0")
    return tuple(torch.stack([u[c] for u in uploads]).mean(0) for c in range(3))  # type: ignore[return-value]


def initial_distilled(
    k: int,
    num_classes: int,
    input_shape: tuple[int, int, int],
    config: FlipConfig,
    seed: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The server's initial distilled data: random samples, class-``j % classes`` label logits, init rates."""
    K = k * num_classes
    gen = torch_generator(seed)
    samples = torch.randn((K, *input_shape), generator=gen) * config.sample_init_std
    slot_class = torch.arange(K) % num_classes
    labels = F.one_hot(slot_class, num_classes).float() * config.label_init
    rates = torch.full((K,), float(config.init_rate))
    return samples.to(device), labels.to(device), rates.to(device)


def final_model(
    model: torch.nn.Module,
    init: dict[str, torch.Tensor],
    samples: torch.Tensor,
    label_logits: torch.Tensor,
    rates: torch.Tensor,
) -> torch.nn.Module:
    """Eq. 5: load ``theta_init`` trained one pass over the (aggregated) samples into ``model``."""
    theta = unroll(model, init, samples, label_logits, rates, create_graph=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(theta[n])
    return model


# ----------------------------------------------------------------------------- trainer
class FlipRun:
    """One FLiP run whose rounds are driven from outside (:func:`train_flip` drives one;
    :mod:`privkit.batched.many_flip` many at once): the server's state, each round's clients and
    seeds, the aggregation, evaluation and artifacts of every round, and the result.

    A round is :meth:`next_round` (the clients that train, ``None`` once the run has ended), their
    updates (:func:`round_updates` on :meth:`round_clients`, from ``S``, ``L``, ``eta`` with
    step ``lr`` and :attr:`seeds`), then :meth:`finish_round` with those updates.
    """

    #: whether every round's row carries the round's test accuracy (Eq. 5's model on the round's
    #: aggregate, evaluated); an audit's reference runs, never reported, skip it (NaN in their
    #: rows; the result's model and test accuracy stay)
    report_metrics = True

    def __init__(self, federation, config: FlipConfig, seed: int, progress: bool = False):
        if config.min_rate > config.max_rate:
            raise PrivkitError(
                f"min_rate must be <= max_rate; found {config.min_rate} > {config.max_rate}"
            )
        from accountants import Ledger, NonPrivateEvent

        self.federation, self.config, self.seed = federation, config, seed
        device = self.device = resolve_device(config)
        model, self.spec = new_model(federation, config, derive_seed(seed, "flip-init-model"))
        self.model = model.to(device)
        self.init = {n: t.to(device) for n, t in initial_params(model).items()}
        C = federation.num_classes
        self.S, self.L, self.eta = initial_distilled(
            config.k, C, federation.input_shape, config, derive_seed(seed, "flip-init-data"), device
        )
        self.data = [
            (as_tensor(x, device, torch.float32), as_tensor(y, device, torch.long))
            for x, y in (federation.client_arrays(i) for i in range(federation.num_clients))
        ]
        self.active = [i for i, (_, y) in enumerate(self.data) if len(y)]
        if not self.active:
            raise PrivkitError("FLiP needs at least one client with data; found none")
        self.x_test, self.y_test = federation.test_arrays()

        self.ledger = Ledger()
        for i in range(federation.num_clients):
            self.ledger.add(i, NonPrivateEvent(NO_DP_REASON), label="distilled data (every round)")
        self.warnings = [
            NO_DP_REASON + " (the ledger records the shared distilled data as a non-private "
            "release; the server sees every client's upload before averaging)"
        ]
        reduced = config.attack.reductions()
        if reduced:
            self.warnings.append(
                "FLiP's attacker configuration (attack.*, used by the Table II attack) is scaled "
                "down from the paper's: " + "; ".join(reduced)
            )
        if len(self.active) < federation.num_clients:
            self.warnings.append(
                f"{federation.num_clients - len(self.active)} clients hold no data and share nothing"
            )
        self.artifacts: dict[str, np.ndarray] = {
            "distilled_slot_class": (np.arange(config.k * C) % C).astype(np.int64)
        }
        self.eval_model, _ = new_model(federation, config, derive_seed(seed, "flip-init-model"))
        self.eval_model.to(device)
        self.rounds: list[dict] = []
        self.uploads: dict[int, tuple] = {}
        self.t = 0
        self.lr = config.distill_lr
        self.seeds: list[int] = []
        self.rows_cache: dict = {}  # round_updates' padded raw rows, kept across rounds
        self._iterator: Iterable[int] = range(1, config.rounds + 1)
        if progress:
            from rich.progress import track

            self._iterator = track(self._iterator, description="flip")
        self._rounds = iter(self._iterator)

    def next_round(self) -> list[int] | None:
        """Start the next round: its step size and client seeds; returns its clients (every
        client with data), ``None`` once the last round has run."""
        t = next(self._rounds, None)
        if t is None:
            return None
        config = self.config
        self.t = t
        self.lr = config.distill_lr * config.lr_decay ** ((t - 1) // config.lr_decay_every)
        self.seeds = [derive_seed(self.seed, f"flip-client-{i}-{t}") for i in self.active]
        return list(self.active)

    def round_clients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(x, y)`` of the round's clients, in :meth:`next_round`'s order."""
        return [self.data[i] for i in self.active]

    def finish_round(self, updates: Sequence[tuple]) -> None:
        """Aggregate the round's client ``updates`` (:func:`round_updates`' tuples, in the
        clients' order), evaluate the round's model and keep the round's artifacts."""
        config, t = self.config, self.t
        self.uploads = {i: u[:3] for i, u in zip(self.active, updates)}
        losses = [u[3] for u in updates]
        S, L, eta = self.S, self.L, self.eta = aggregate(list(self.uploads.values()))
        acc = math.nan
        if self.report_metrics:
            final_model(self.eval_model, self.init, S, L, eta)
            acc = accuracy(
                self.eval_model, self.x_test, self.y_test, self.device, config.eval_batch_size
            )
        self.rounds.append(
            {
                "round": t,
                "test_accuracy": acc,
                "distill_lr": self.lr,
                "mean_client_loss": float(np.mean(losses)),
                "mean_rate": float(eta.mean()),
            }
        )
        if config.record_every and t % config.record_every == 0 and t != config.rounds:
            _store_uploads(self.artifacts, self.uploads, suffix=f"_round_{t}")
        if t in config.attack.mia_rounds:  # the aggregate that defines round t's released model
            _store_aggregate(self.artifacts, S, L, eta, suffix=f"_round_{t}")

    def outcome(self) -> TrainResult:
        """The run's result: the released model is Eq. 5's on the last aggregate."""
        config, artifacts = self.config, self.artifacts
        S, L, eta = self.S, self.L, self.eta
        if self.uploads:
            _store_uploads(artifacts, self.uploads, suffix="")
        final_model(self.eval_model, self.init, S, L, eta)
        artifacts["aggregated_x"] = S.cpu().numpy().astype(np.float32)
        artifacts["aggregated_y"] = F.softmax(L, dim=1).cpu().numpy().astype(np.float32)
        artifacts["aggregated_lr"] = eta.cpu().numpy().astype(np.float32)
        test_acc = accuracy(
            self.eval_model, self.x_test, self.y_test, self.device, config.eval_batch_size
        )
        claims = {
            "epsilon": float("inf"),
            "delta": 1.0,
            "formal_dp": False,
            "source": "FLiP (no formal DP claim; empirical attacks only, Sec. V-VI)",
            "note": NO_DP_REASON,
        }
        return TrainResult(
            method="flip",
            seed=self.seed,
            config=config.model_dump(),
            model=self.eval_model,
            model_spec=self.spec,
            ledger=self.ledger,
            rounds=self.rounds,
            test_accuracy=test_acc,
            artifacts=artifacts,
            warnings=self.warnings,
            claims=claims,
        )


# method "flip": config and registration in privkit.methods.flip
def train_flip(federation, config: FlipConfig, seed: int, progress: bool = False) -> TrainResult:
    """Run FLiP on ``federation``; the released model is Eq. 5's on the last aggregate."""
    run = FlipRun(federation, config, seed, progress)
    while run.next_round() is not None:
        run.finish_round(
            round_updates(
                run.model,
                run.init,
                run.S,
                run.L,
                run.eta,
                run.round_clients(),
                config,
                run.lr,
                run.seeds,
                run.rows_cache,
            )
        )
    return run.outcome()


def _store_aggregate(
    artifacts: dict, S: torch.Tensor, L: torch.Tensor, eta: torch.Tensor, suffix: str
) -> None:
    artifacts[f"aggregated_x{suffix}"] = S.cpu().numpy().astype(np.float32)
    artifacts[f"aggregated_label_logits{suffix}"] = L.cpu().numpy().astype(np.float32)
    artifacts[f"aggregated_lr{suffix}"] = eta.cpu().numpy().astype(np.float32)


def model_at_round(
    federation, config: FlipConfig, seed: int, artifacts: dict, t: int
) -> torch.nn.Module:
    """The model FLiP released at round ``t`` (Eq. 5 on that round's aggregate), rebuilt from the
    run's artifacts: the paper's membership attack targets rounds 1, 25, 50, 75 and 100
    (``attack.mia_rounds``; the trainer keeps those rounds' aggregates)."""
    keys = [f"aggregated_{n}_round_{t}" for n in ("x", "label_logits", "lr")]
    if any(k not in artifacts for k in keys):
        raise PrivkitError(
            f"round must be one of the kept rounds (attack.mia_rounds that ran); found {t}"
        )
    model, _ = new_model(federation, config, derive_seed(seed, "flip-init-model"))
    init = initial_params(model)
    S, L, eta = (torch.as_tensor(np.asarray(artifacts[k])) for k in keys)
    return final_model(model, init, S, L, eta)


def _store_uploads(artifacts: dict, uploads: dict, suffix: str) -> None:
    """Each client's upload: samples, soft labels (probabilities), label logits, learning rates."""
    for i, (s, lab, e) in uploads.items():
        artifacts[f"distilled_x{suffix}/client_{i}"] = s.cpu().numpy().astype(np.float32)
        artifacts[f"distilled_y{suffix}/client_{i}"] = (
            F.softmax(lab, dim=1).cpu().numpy().astype(np.float32)
        )
        artifacts[f"distilled_label_logits{suffix}/client_{i}"] = (
            lab.cpu().numpy().astype(np.float32)
        )
        artifacts[f"distilled_lr{suffix}/client_{i}"] = e.cpu().numpy().astype(np.float32)
