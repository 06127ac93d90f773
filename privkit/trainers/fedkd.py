"""FedKD (Wu et al., "Communication-efficient federated learning via knowledge distillation",
Nature Communications 13, 2032, 2022) with record-level DP: the FedKADP paper's "FedKD (with DP)".

Each client keeps a large local *mentor* model (never shared) and trains it together with a copy
of the small shared *mentee* model on its own data, by adaptive mutual distillation:

    L_t = CE(y, t) + [KL(s || t) + MSE(h_t, W_h h_s)] / (CE(y, t) + CE(y, s))     (mentor)
    L_s = CE(y, s) + [KL(t || s) + MSE(h_t, W_h h_s)] / (CE(y, t) + CE(y, s))     (mentee)

(t, s: mentor / mentee logits, h: their hidden features, ``W_h`` a local linear map from the
mentee's to the mentor's feature width). Each model learns from the other's outputs held fixed;
the shared denominator makes distillation strong where both models already fit the label and weak
where they do not (the paper's "adaptive" mutual distillation; it is a per-record weight, held
fixed in the gradient). Only the mentee's update leaves the client, compressed by truncated SVD:
each weight matrix keeps the fewest singular values holding a fraction ``T(t)`` of its energy,
``T(t) = T_start + (T_end - T_start) t / T`` (paper and official code: 0.95 -> 0.98). The server
averages the decompressed updates, compresses the average the same way (the download), and adds
it to the global mentee.

DP (privkit's; the paper has none, and FedKADP does not say how it privatised FedKD): every local
step is one DP-SGD step (:mod:`privkit.mechanisms.dp_sgd_step`) on the *joint* parameters (mentor,
mentee, W_h) with per-record loss ``L_t + L_s``: one Poisson batch (rate B/n_k), each record's
whole joint gradient clipped to ``c``, Gaussian noise ``sigma c`` on the sum. The per-record loss
depends only on that record and the current parameters (which are outputs of earlier DP steps), so
by adaptive composition a client that takes part in a round has run ``E`` Poisson-subsampled
Gaussian steps, whatever it keeps locally; the mentor needs no separate budget, and the
compression is post-processing. The ledger and the stop-before-budget rule are those of
:mod:`privkit.trainers.fedkadp` (record-level, per client, add/remove-one).

Released: the global mentee (``model``, what the server holds); the clients' mentors are
``client_models`` (personalised models; they never leave the client in the protocol, but the
accounting covers them too).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from privkit.errors import PrivkitError
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.methods.contract import TrainResult
from privkit.methods.fedkd import PAPER, FedKDConfig  # noqa: F401  (re-exported)
from privkit.models import FeatureClassifier
from privkit.seeding import derive_seed, make_rng, noise_generator, seed_torch
from privkit.trainers.common import accuracy, dp_sgd_clients, new_model, resolve_device
from privkit.trainers.dp_fedavg import _Budget


# ----------------------------------------------------------------------------- mutual distillation
class MentorMentee(nn.Module):
    """Mentor, mentee and ``W_h`` as one module, so one DP-SGD step clips their joint gradient.

    ``forward`` returns ``[t logits | s logits | h_t | W_h h_s]`` concatenated per record;
    :func:`mutual_loss` splits it again.
    """

    def __init__(self, mentor: FeatureClassifier, mentee: FeatureClassifier):
        super().__init__()
        self.mentor, self.mentee = mentor, mentee
        self.w_h = nn.Linear(mentee.feature_dim, mentor.feature_dim, bias=False)

    def stacked_form(self, n_models: int):
        """``n_models`` pairs of this architecture as stacked tensors, with per-example joint
        clipping (:class:`privkit.mechanisms.stacked_pairs.StackedPairs`): what a DP-SGD step of one
        pair (``n_models=1``) or of many uses instead of ``torch.func`` per-example gradients."""
        from privkit.mechanisms.stacked_pairs import StackedPairs

        return StackedPairs(self, n_models)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_t, h_s = self.mentor.features(x), self.mentee.features(x)
        return torch.cat([self.mentor.head(h_t), self.mentee.head(h_s), h_t, self.w_h(h_s)], dim=1)


def mutual_loss(num_classes: int, hidden: bool):
    """Per-record ``L_t + L_s`` on :class:`MentorMentee`'s output (cross terms held fixed)."""
    C = num_classes

    def loss(out: torch.Tensor, target: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        t, s = out[:, :C], out[:, C : 2 * C]
        ce_t, ce_s = F.cross_entropy(t, target), F.cross_entropy(s, target)
        weight = 1.0 / (ce_t + ce_s).detach().clamp_min(1e-6)
        log_t, log_s = F.log_softmax(t, 1), F.log_softmax(s, 1)
        # KL(s || t) trains the mentor towards the mentee's (fixed) output, KL(t || s) the reverse
        kl_t = (log_s.detach().exp() * (log_s.detach() - log_t)).sum(1).mean()
        kl_s = (log_t.detach().exp() * (log_t.detach() - log_s)).sum(1).mean()
        total = ce_t + ce_s + weight * (kl_t + kl_s)
        if hidden:
            d = (out.shape[1] - 2 * C) // 2
            h_t, proj = out[:, 2 * C : 2 * C + d], out[:, 2 * C + d :]
            # mentor side: h_t towards the (fixed) projection; mentee side: W_h h_s towards h_t
            total = total + weight * (
                F.mse_loss(h_t, proj.detach()) + F.mse_loss(proj, h_t.detach())
            )
        return total

    return loss


# ----------------------------------------------------------------------------- SVD compression
def energy_threshold(t: int, rounds: int, start: float, end: float) -> float:
    """``T(t) = T_start + (T_end - T_start) t / T`` (t = 1..T)."""
    return start + (end - start) * min(t, rounds) / max(rounds, 1)


def compress(
    update: dict[str, torch.Tensor], energy: float
) -> tuple[dict[str, torch.Tensor], int, int]:
    """Truncated-SVD reconstruction of each matrix-shaped tensor (conv kernels as out x rest).

    Keeps the fewest singular values whose squared sum reaches ``energy`` of the total; a matrix
    whose factors (U, S, V) would cost more floats than the matrix itself is sent dense (exact).
    Vectors are sent as they are. Returns the reconstructed update and the number of floats sent
    and of floats in the uncompressed update.
    """
    out, sent, full = {}, 0, 0
    for name, g in update.items():
        full += g.numel()
        rows = g.shape[0] if g.dim() >= 2 else 1
        cols = g.numel() // max(rows, 1)
        if g.dim() < 2 or min(rows, cols) < 2:
            out[name], sent = g.clone(), sent + g.numel()
            continue
        power, basis, left = _singular_pairs(g.reshape(rows, cols).double())
        if float(power.sum()) == 0.0:
            out[name], sent = torch.zeros_like(g), sent + 1
            continue
        cum = torch.cumsum(power, 0) / power.sum()
        k = min(int((cum < energy - 1e-12).sum().item()) + 1, len(power))
        if k * (rows + cols + 1) >= g.numel():
            out[name], sent = g.clone(), sent + g.numel()
            continue
        # U_k S_k V_k^T is the projection of the matrix onto its top k singular vectors
        a, v = g.reshape(rows, cols).double(), basis[:, :k]
        kept = v @ (v.T @ a) if left else (a @ v) @ v.T
        out[name] = kept.reshape(g.shape).to(g.dtype)
        sent += k * (rows + cols + 1)
    return out, sent, full


def _singular_pairs(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The squared singular values of ``a`` (float64), largest first, and the singular vectors
    of its shorter side as columns (``left``: they are the left ones, U).

    Taken from the eigendecomposition of the smaller Gram matrix (``a a^T`` or ``a^T a``), whose
    eigenvalues are the squared singular values: for a 64 x 784 update 7x faster than
    ``torch.linalg.svd``. The eigenvalues' absolute error is ~1e-16 of the largest, far below the
    energy threshold's 1e-12 slack; rounding can make a null one slightly negative, so it is
    clamped at 0.
    """
    left = a.shape[0] <= a.shape[1]
    gram = a @ a.T if left else a.T @ a
    power, basis = torch.linalg.eigh(gram)  # ascending
    return power.flip(0).clamp_min(0.0), basis.flip(1), left


# ----------------------------------------------------------------------------- one client
def _mentee_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _client_round(
    pair: MentorMentee,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FedKDConfig,
    loss_fn,
    seed: int,
    device: torch.device,
    client: int = 0,
    receipts: list | None = None,
) -> None:
    """``E`` joint DP-SGD steps of mentor, mentee and W_h on the client's data (in place; taking an
    audit's probes when ``client``'s mechanism is probed: :mod:`privkit.mechanisms.probes`); each step's
    release receipt goes to ``receipts`` where given."""
    n = len(y)
    step = DpSgdStep(cfg.clip_norm, cfg.noise_multiplier, min(1.0, cfg.batch_size / n), n)
    params = [p for p in pair.parameters() if p.requires_grad]
    opt = (
        torch.optim.SGD(params, lr=cfg.lr)
        if cfg.optimizer == "sgd"
        else torch.optim.Adam(params, lr=cfg.lr)
    )
    # Poisson sampling and noise: AES-CTR keyed from OS entropy in release mode (never stored), seeded only in
    # reproducible mode (privkit.seeding.noise_generator)
    sample_gen = noise_generator(seed, "poisson", reproducible=cfg.reproducible_noise)
    noise_gen = noise_generator(seed, "noise", reproducible=cfg.reproducible_noise, device=device)
    pair.train()
    canaries = step.probes(pair, client)
    for _ in range(cfg.local_steps):
        idx = step.sample(sample_gen).to(device)
        step.apply(pair, opt, x[idx], y[idx], loss_fn, noise_gen, None, canaries, receipts)


# ----------------------------------------------------------------------------- trainer
class FedKdRun:
    """One FedKD+DP run held between rounds (as :class:`~privkit.trainers.dp_fedavg.DpFedRun`):
    :meth:`next_round` samples the round's clients (budget checked before it) and loads the global
    mentee into their pairs, each sampled client runs :func:`_client_round` on its pair with
    :meth:`client_seed`, and :meth:`finish_round` compresses, accounts and averages the updates.
    The batched path (:mod:`privkit.batched.many_dpfed`) steps many runs' pairs together."""

    #: whether the rounds' rows and the result carry the test accuracies (every round's mentee,
    #: the mentors); an audit's reference runs, never reported, skip them (NaN in their rows, no
    #: mentor accuracies; the final test accuracy stays)
    report_metrics = True

    def __init__(self, federation, cfg: FedKDConfig, seed: int):
        from accountants import Ledger

        self.federation, self.cfg, self.seed = federation, cfg, seed
        self.device = device = resolve_device(cfg)
        K, C = self.num_clients, self.num_classes = federation.num_clients, federation.num_classes
        self.data, self.rates = dp_sgd_clients(federation, device, cfg.batch_size)
        self.mentee, self.spec = new_model(federation, cfg, derive_seed(seed, "init"))
        self.mentee.to(device)
        mentor_kw = {"width": cfg.mentor_width, "feature_dim": cfg.mentor_feature_dim}
        if (cfg.mentor_arch or cfg.arch) == "mlp":
            mentor_kw["depth"] = cfg.mentor_depth
        self.pairs: list[MentorMentee] = []
        self.mentor_specs: list[dict] = []
        for k in range(K):  # each client's own mentor (and W_h), initialised independently
            mentor, mspec = new_model(
                federation,
                cfg,
                derive_seed(seed, f"mentor-{k}"),
                arch=cfg.mentor_arch or cfg.arch,
                **mentor_kw,
            )
            seed_torch(derive_seed(seed, f"w_h-{k}"))
            self.pairs.append(MentorMentee(mentor, copy.deepcopy(self.mentee)).to(device))
            self.mentor_specs.append(mspec)
        self.loss_fn = mutual_loss(C, cfg.hidden_loss)
        self.x_test, self.y_test = federation.test_arrays()
        self.ledger, self.budget = Ledger(), _Budget(cfg.accountant, cfg.delta)
        self.rng = make_rng(seed, "client-sampling")
        self.per_round = max(round(K * cfg.client_fraction), 1)
        self.rounds: list[dict] = []
        self.stop = f"completed all {cfg.rounds} rounds"
        self.t, self.ended = 0, False
        self.sampled: list[int] = []

    def next_round(self) -> list[int] | None:
        """The next round's clients, their pairs holding the global mentee; ``None`` once training
        has ended (all rounds run, or the round would pass the budget)."""
        cfg = self.cfg
        if self.ended or self.t >= cfg.rounds:
            self.ended = True
            return None
        t = self.t + 1
        sampled = [
            int(k)
            for k in np.sort(self.rng.choice(self.num_clients, size=self.per_round, replace=False))
        ]
        pending = {
            k: self.budget.would_be(k, self.rates[k], cfg.noise_multiplier, cfg.local_steps)
            for k in sampled
        }
        would = max(e for _, e in pending.values())
        if would > cfg.target_epsilon:  # never release a round past the budget
            self.stop = (
                f"stopped before round {t}: it would bring a client to epsilon {would:.4g} > "
                f"target {cfg.target_epsilon:g} ({cfg.accountant}, delta={cfg.delta:g})"
            )
            self.ended = True
            return None
        self.t, self.sampled, self.pending = t, sampled, pending
        self.start = _mentee_params(self.mentee)
        for k in sampled:
            self.pairs[k].mentee.load_state_dict(self.mentee.state_dict())
        return list(sampled)

    def client_seed(self, k: int) -> int:
        """The seed of client ``k``'s local round."""
        return derive_seed(self.seed, f"round{self.t}/client{k}")

    def finish_round(self, receipts: list[list] | None = None) -> None:
        """After every sampled pair ran its local round: compress and account each client's mentee
        update (in the sampled order), average them, compress the download, update the mentee.
        ``receipts`` (one list per sampled client): the releases each made, which the ledger
        records; releases other than the budget check admitted are an error."""
        from accountants import dpsgd_event
        from privkit.mechanisms.gaussian import compose_receipts

        cfg, t, start = self.cfg, self.t, self.start
        energy = energy_threshold(t, cfg.rounds, cfg.energy_start, cfg.energy_end)
        updates, sent, full = [], 0, 0
        for i, k in enumerate(self.sampled):
            upd = {n: p.detach() - start[n] for n, p in self.pairs[k].mentee.named_parameters()}
            if cfg.compress:
                upd, s_k, f_k = compress(upd, energy)
                sent, full = sent + s_k, full + f_k
            updates.append(upd)
            self.budget.commit(k, *self.pending[k])
            planned = dpsgd_event(self.rates[k], cfg.noise_multiplier, cfg.local_steps)
            event = compose_receipts(receipts[i]) if receipts is not None else planned
            if event != planned:
                raise PrivkitError(
                    f"client {k} released {event} in round {t}; the budget admitted {planned}"
                )
            self.ledger.add(k, event, f"round {t}: dp-sgd (mentor+mentee)", round=t)
        mean = {n: torch.stack([u[n] for u in updates]).mean(0) for n in start}
        down = compress(mean, energy)[0] if cfg.compress else mean
        with torch.no_grad():
            for n, p in self.mentee.named_parameters():
                p.copy_(start[n] + down[n])
        row = {
            "round": t,
            "test_accuracy": (
                accuracy(self.mentee, self.x_test, self.y_test, self.device)
                if self.report_metrics
                else float("nan")
            ),
            "epsilon": self.budget.worst,
            "clients": list(self.sampled),
            "energy": energy,
        }
        if cfg.compress:
            row["upload_fraction"] = sent / full
        self.rounds.append(row)

    def result(self) -> TrainResult:
        """The run's :class:`TrainResult` (after :meth:`next_round` returned ``None``)."""
        cfg, stop = self.cfg, self.stop
        x_test, y_test = self.x_test, self.y_test
        mentors = [p.mentor.cpu() for p in self.pairs]
        mentor_acc = (
            [accuracy(m, x_test, y_test, torch.device("cpu")) for m in mentors]
            if self.report_metrics
            else []
        )
        warnings = [
            (
                f"Accounting is record-level, per client, add/remove-one neighbours: each round a client takes "
                f"part in is {cfg.local_steps} Poisson-subsampled Gaussian steps (q = B/n_k) on the joint "
                "mentor+mentee+W_h gradient; the mentor never leaves the client and needs no separate budget."
            ),
            (
                "FedKD has no DP in its paper and FedKADP does not say how it privatised it: privkit runs each "
                "local step as one DP-SGD step on the joint gradient of the per-record mutual-distillation loss."
            ),
            f"Training {stop}.",
        ]
        claims = {
            "epsilon": self.budget.worst,
            "delta": cfg.delta,
            "accountant": cfg.accountant,
            "target_epsilon": cfg.target_epsilon,
            "stop": stop,
            "source": "privkit's accounting (FedKD itself makes no DP claim)",
        }
        mentee = self.mentee.cpu()
        return TrainResult(
            method="fedkd-dp",
            seed=self.seed,
            config=cfg.model_dump(),
            model=mentee,
            model_spec=self.spec,
            ledger=self.ledger,
            rounds=self.rounds,
            test_accuracy=accuracy(mentee, x_test, y_test, torch.device("cpu")),
            client_models=mentors,  # type: ignore[arg-type]  # a list of modules
            client_model_specs=self.mentor_specs,
            client_accuracy=mentor_acc,
            warnings=warnings,
            claims=claims,
        )


# method "fedkd-dp": config and registration in privkit.methods.fedkd
def train_fedkd_dp(
    federation, config: FedKDConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedKD with record-level DP; see the module docstring."""
    run = FedKdRun(federation, config, seed)
    iterator: Iterable[int] = range(1, config.rounds + 1)
    if progress:
        from rich.progress import track

        iterator = track(iterator, description="fedkd-dp rounds")
    for _ in iterator:
        sampled = run.next_round()
        if sampled is None:
            break
        receipts: list[list] = [[] for _ in sampled]  # each client's releases, for the ledger
        for i, k in enumerate(sampled):
            _client_round(
                run.pairs[k],
                *run.data[k],
                config,
                run.loss_fn,
                run.client_seed(k),
                run.device,
                client=k,
                receipts=receipts[i],
            )
        run.finish_round(receipts)
    return run.result()


__all__ = [
    "FedKDConfig",
    "FedKdRun",
    "MentorMentee",
    "compress",
    "energy_threshold",
    "mutual_loss",
    "train_fedkd_dp",
]
