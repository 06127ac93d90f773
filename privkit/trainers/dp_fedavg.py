"""Record-level DP-FedAvg: the DP-FL loop of FedKADP's paper (Jiang et al., Electronics 2024; seed
004, Algorithms 1-2, the baseline of Sec. 5.4), which ``dp-fedavg`` runs as it is and FedKADP
(:mod:`privkit.trainers.fedkadp`) extends with distillation and its feedback Metric. McMahan et
al.'s client-level DP-FedAvg is :mod:`privkit.trainers.dp_fedavg_client`.

The loop (FedKD+DP, :mod:`privkit.trainers.fedkd`, keeps its budget check, :class:`_Budget`):

* server: each round samples ``N = max(round(K s), 1)`` clients uniformly without replacement,
  sends them the global model ``w_{t-1}``, averages what they return (equal weights, Alg. 2 line 8);
* client (Alg. 1): ``student = teacher = w_{t-1}``; ``E`` DP-SGD steps (:mod:`privkit.mechanisms.dp_sgd_step`):
  per-sample clipping to ``c``, Gaussian noise ``sigma_t c`` on the sum, divided by ``B``; the
  loss is ``CE(y, student) + rho^2 KL(softmax(teacher/rho) || softmax(student/rho))`` (FedKADP)
  or ``CE`` alone (DP-FedAvg);
* FedKADP only: after each round the bidirectional-feedback ``Metric`` (Sec. 3.2) sets the next
  temperature ``rho`` (Eq. 17) and noise multiplier ``sigma`` (Eq. 20).

How a release is drawn and recorded, all in this module and the mechanism it calls: each local
step is :meth:`DpSgdStep.apply <privkit.mechanisms.dp_sgd_step.DpSgdStep.apply>` (Poisson batch,
per-example clipping, the noise through :func:`privkit.mechanisms.gaussian_release`), whose
receipt goes to the client's list; :meth:`DpFedRun.finish_round` records the composition of each
client's receipts in the ledger, and refuses a client whose releases differ from what the budget
check admitted.

Where privkit departs from the paper, and why:

* **Sampling.** Alg. 1 partitions ``D_k`` into batches; privkit draws each batch by Poisson
  sampling with rate ``q_k = B / n_k``, the sampling that the subsampled-Gaussian accountant
  (add/remove-one neighbours) assumes, so the ledger matches what ran.
* **Budget check before the round.** Alg. 2 releases ``w_t`` and then checks ``eps_t > eps_T``,
  so its last round overshoots the budget. privkit computes, before round ``t``, the epsilon every
  sampled client *would* have after it, and stops if any exceeds ``target_epsilon``: no round past
  the budget is ever released.
* **Accounting.** Per client, per round it took part in: ``E`` Poisson-subsampled Gaussian steps
  with ``q_k = B/n_k`` and that round's ``sigma_t`` (record-level, add/remove-one). The paper's
  own formula (Sec. 4.1) is reported beside it in ``claims`` with the reasons it is not sound.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import gammaln, logsumexp

from privkit.errors import PrivkitError
from privkit.mechanisms.dp_sgd_step import DpSgdStep
from privkit.methods.contract import TrainResult
from privkit.methods.dp_fedavg import PAPER, QUICK, DpFedConfig  # noqa: F401  (re-exported)
from privkit.seeding import derive_seed, make_rng, noise_generator
from privkit.trainers.common import (
    accuracy,
    dp_sgd_clients,
    new_model,
    predict_logits,
    resolve_device,
)


# ============================================================================ the paper's privacy formula (Sec. 4.1)
def _paper_round_rdp_orders(
    alphas: np.ndarray, sample_rate: float, sigma: float, local_steps: int, n: int = 1
) -> np.ndarray:
    """:func:`paper_round_rdp` at every integer order in ``alphas`` (>= 2) at once."""
    alphas = np.asarray(alphas, dtype=np.int64)
    a = alphas.astype(float)
    v = 1.0 / (n * sigma**2)
    second = sample_rate**2 * (a * (a - 1) / 2.0) * min(4.0 * math.expm1(v), 2.0 * math.exp(v))
    j = np.arange(3, max(int(alphas.max()), 3) + 1, dtype=float)
    terms = (
        (math.log(2.0) + j * math.log(sample_rate) + j * (j - 1) * v / 2.0)[None, :]
        + gammaln(a + 1)[:, None]
        - gammaln(j + 1)[None, :]
        - gammaln(np.maximum(a[:, None] - j[None, :], 0) + 1)
    )
    terms = np.where(j[None, :] <= a[:, None], terms, -np.inf)  # the sum runs to j = alpha
    higher = logsumexp(terms, axis=1) if j.size else np.full(a.shape, -np.inf)
    return local_steps * np.logaddexp(np.log1p(second), higher) / (a - 1)


def paper_round_rdp(
    alpha: int, sample_rate: float, sigma: float, local_steps: int, n: int = 1
) -> float:
    """One round of the paper's RDP bound at integer order ``alpha >= 2`` (Sec. 4.1), as stated.

    ``E/(alpha-1) log(1 + s^2 C(alpha,2) min(4(e^{1/(n sigma^2)} - 1), 2 e^{1/(n sigma^2)})
    + 2 sum_{j=3}^{alpha} s^j C(alpha,j) e^{j(j-1)/(2 n sigma^2)})``. ``n = 1`` is the per-client
    form, ``n`` = clients per round the server form ("following Noble et al.").
    """
    if alpha < 2:
        raise PrivkitError(f"alpha must be an integer >= 2; found {alpha}")
    return float(_paper_round_rdp_orders(np.array([alpha]), sample_rate, sigma, local_steps, n)[0])


def paper_epsilon(
    sigmas: list[float],
    sample_rate: float,
    local_steps: int,
    delta: float,
    n: int = 1,
    max_order: int = 256,
) -> tuple[float, int]:
    """The paper's ``min_alpha sum_t eps_t(alpha, sigma_t) + log(1/delta)/(alpha-1)`` (Sec. 4.2).

    ``sample_rate`` is the paper's ``s`` (the *client* sampling rate), summed over all rounds that
    ran. Returns ``(epsilon, alpha)``; orders are the integers 2..``max_order``. This reproduces the
    paper's arithmetic; it is NOT a sound bound (see the trainer's warnings).
    """
    if not sigmas:
        return 0.0, 2
    counts = collections.Counter(float(s) for s in sigmas)  # rounds with equal sigma cost the same
    alphas = np.arange(2, max_order + 1)
    eps = sum(
        c * _paper_round_rdp_orders(alphas, sample_rate, s, local_steps, n)
        for s, c in counts.items()
    )
    eps = eps + math.log(1.0 / delta) / (alphas - 1)
    best = int(np.argmin(eps))  # the first of equal minima: the smallest order, as before
    return float(eps[best]), int(alphas[best])


# ============================================================================ training
def _ce_loss(logits: torch.Tensor, target: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def kd_loss(rho: float):
    """Per-record ``CE(y, student) + rho^2 KL(softmax(teacher/rho) || softmax(student/rho))``.

    The cross-entropy is on the untempered student (Hinton et al.); the paper's notation reuses
    the tempered ``q`` there, which only rescales the logits the student learns.
    """

    def loss(logits: torch.Tensor, target: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits, target)
        log_q = F.log_softmax(logits / rho, dim=1)
        log_p = F.log_softmax(teacher / rho, dim=1)
        kl = (log_p.exp() * (log_p - log_q)).sum(1).mean()
        return ce + rho**2 * kl

    return loss


def _local_update(
    global_model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: DpFedConfig,
    sigma: float,
    rho: float | None,
    seed: int,
    device: torch.device,
    client: int = 0,
    receipts: list | None = None,
) -> dict[str, torch.Tensor]:
    """Algorithm 1 on one client: ``E`` Poisson-sampled DP-SGD steps from the global model (taking
    an audit's probes when ``client``'s mechanism is probed: :mod:`privkit.mechanisms.probes`); each step's
    release receipt goes to ``receipts`` where given."""
    n = len(y)
    step = DpSgdStep(cfg.clip_norm, sigma, min(1.0, cfg.batch_size / n), n)
    student = copy.deepcopy(global_model).to(device).train()
    teacher = copy.deepcopy(global_model).to(device).eval() if rho is not None else None
    params = [p for p in student.parameters() if p.requires_grad]
    opt = (
        torch.optim.SGD(params, lr=cfg.lr)
        if cfg.optimizer == "sgd"
        else torch.optim.Adam(params, lr=cfg.lr)
    )
    # Poisson batches and noise are the mechanism's secret randomness (release mode: AES-CTR keyed from OS entropy)
    sample_gen = noise_generator(seed, "poisson", reproducible=cfg.reproducible_noise)
    noise_gen = noise_generator(seed, "noise", reproducible=cfg.reproducible_noise, device=device)
    loss_fn = kd_loss(rho) if rho is not None else _ce_loss
    canaries = step.probes(student, client)
    for _ in range(cfg.local_steps):
        idx = step.sample(sample_gen).to(device)
        xb, yb = x[idx], y[idx]
        aux = None
        if teacher is not None:
            with torch.no_grad():
                aux = teacher(xb)
        step.apply(student, opt, xb, yb, loss_fn, noise_gen, aux, canaries, receipts)
    return {k: v.detach() for k, v in student.state_dict().items()}


def client_seed(seed: int, t: int, k: int) -> int:
    """The seed of client ``k``'s local update in round ``t`` of a run seeded ``seed`` (its Poisson
    batches and noise in reproducible mode): the same in every engine."""
    return derive_seed(seed, f"round{t}/client{k}")


def local_update(
    global_model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: DpFedConfig,
    sigma: float,
    rho: float | None,
    seed: int,
    device: torch.device,
    client: int = 0,
    receipts: list | None = None,
) -> dict[str, torch.Tensor]:
    """Algorithm 1 on one client (public name of the step every engine runs: :mod:`privkit.flower`);
    each release's receipt goes to ``receipts`` where given (the server's ledger records them)."""
    return _local_update(global_model, x, y, cfg, sigma, rho, seed, device, client, receipts)


def _mean_state(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@torch.no_grad()
def _public_eval(
    model: torch.nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device
) -> tuple[float, float]:
    """(cross-entropy loss, accuracy) of ``model`` on public validation data."""
    logits = torch.as_tensor(predict_logits(model, x, device))
    yt = torch.as_tensor(y, dtype=torch.long)
    return float(F.cross_entropy(logits, yt)), float((logits.argmax(1) == yt).float().mean())


def _rdp_curve(
    sample_rate: float, noise_multiplier: float, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """dp-accounting's RDP curve (orders, values) of ``steps`` Poisson-subsampled Gaussian steps.

    :mod:`accountants.fast` caches the one-step curve per (q, sigma), which recurs every round for
    every client with the same data size.  RDP composes by adding curves over the same orders.
    """
    from accountants import dpsgd_event, new_accountant

    acc = new_accountant("rdp")
    acc.compose(dpsgd_event(sample_rate, noise_multiplier, steps))
    return acc.rdp_curve()


@functools.lru_cache(maxsize=4096)
def _rdp_epsilon(orders: bytes, curve: bytes, delta: float) -> float:
    """dp-accounting's epsilon at ``delta`` of an RDP curve, given by its float64 bytes.

    Cached because the runs of an audit's batch (and runs of one configuration) meet the same
    per-client curves round by round: a dp-fedavg audit of the quickstart converts about 1,400
    curves, 125 of them distinct. The value is dp-accounting's own, bit for bit."""
    import dp_accounting as dpa

    eps, _ = dpa.rdp.rdp_privacy_accountant.compute_epsilon(
        np.frombuffer(orders), np.frombuffer(curve), delta
    )
    return float(eps)


class _Budget:
    """Per-client epsilon of the events released so far, for the check before each round.

    ``rdp``: RDP curves added per client (dp-accounting's orders and conversion, identical to the
    ledger's rdp accountant). ``pld``: one dp-accounting PLD accountant per client, composed round
    by round (pessimistic, an upper bound).
    """

    def __init__(self, accountant: str, delta: float) -> None:
        self.accountant, self.delta = accountant, delta
        self.state: dict[int, Any] = {}  # per client: an RDP curve or a PLD accountant
        self.eps: dict[int, float] = {}

    def would_be(
        self, client: int, sample_rate: float, noise_multiplier: float, steps: int
    ) -> tuple[object, float]:
        """(state, epsilon) of ``client`` if it took part in one more round with these parameters."""
        if self.accountant == "rdp":
            orders, curve = _rdp_curve(float(sample_rate), float(noise_multiplier), int(steps))
            total = curve + self.state[client] if client in self.state else curve
            eps = _rdp_epsilon(
                np.asarray(orders, dtype=np.float64).tobytes(),
                np.asarray(total, dtype=np.float64).tobytes(),
                float(self.delta),
            )
            return total, eps
        from accountants import PLD_VDI, dpsgd_event, new_accountant

        acc = (
            copy.deepcopy(self.state[client])
            if client in self.state
            else new_accountant("pld", vdi=PLD_VDI)
        )
        acc.compose(dpsgd_event(sample_rate, noise_multiplier, steps))
        return acc, float(acc.get_epsilon(self.delta))

    def commit(self, client: int, state: object, eps: float) -> None:
        self.state[client], self.eps[client] = state, eps

    @property
    def worst(self) -> float:
        return max(self.eps.values(), default=0.0)


def _warnings(cfg: DpFedConfig, q_min: float, q_max: float) -> list[str]:
    out = [
        (
            f"Accounting is record-level, per client, add/remove-one neighbours: each round a client takes "
            f"part in is {cfg.local_steps} Poisson-subsampled Gaussian steps with q = B/n_k "
            f"(here {q_min:.4g}..{q_max:.4g}) and that round's noise multiplier; client sampling is not "
            "used for amplification and no trusted aggregator is assumed (each upload is a release)."
        ),
        (
            "privkit draws each local batch by Poisson sampling (rate B/n_k) where the paper partitions "
            "D_k into batches, so that the accountant's sampling model is the one that ran."
        ),
        (
            "The paper's formula (claims) is not a sound bound: it applies Wang-Balle-Kasiviswanathan "
            "Thm 9 (sampling without replacement, replace-one neighbours) with the add/remove Gaussian "
            "RDP j/(2 sigma^2) (replace-one needs 2j/sigma^2: 4x in RDP); it uses the client sampling "
            "rate s for record-level amplification (the record-level rate is B/n_k); it divides the "
            "noise variance by the number of clients per round (n sigma^2), which holds only if the "
            "adversary sees nothing but the aggregate (trusted server or secure aggregation); and its "
            "min{2, .} terms leave a floor that more noise does not lower."
        ),
    ]
    return out


class DpFedRun:
    """One run of the shared loop, held between rounds, so that many runs can be stepped together.

    :func:`_drive` drives one: :meth:`next_round` samples the round's clients (or says training has
    ended: all rounds run, or the budget / Renyi filter refuses the round), each sampled client
    runs :func:`_local_update` from :attr:`model` with :attr:`sigma`, :attr:`rho` and
    :meth:`client_seed`, and :meth:`finish_round` takes their states (in the sampled order):
    accounting, averaging, evaluation and the feedback. The batched path
    (:mod:`privkit.batched.many_dpfed`) runs the clients of many runs' rounds as one computation
    and hands each run its states the same way.
    """

    #: whether clients distill from the global model (FedKADP's loss, temperature :attr:`rho`)
    distill = False
    #: whether every round's row carries its metrics (test accuracy, public validation loss and
    #: accuracy) and the claims the paper's formula (Sec. 4.2); an audit's reference runs, never
    #: reported, skip those their training does not read (NaN; the final test accuracy stays)
    report_metrics = True
    #: whether the training reads the public validation metrics (FedKADP's feedback)
    needs_validation = False

    def __init__(
        self,
        federation,
        cfg: Any,  # a DpFedConfig (a FedKADPConfig in FedKADP's subclass)
        seed: int,
        *,
        method: str,
    ):
        self.federation, self.cfg, self.seed, self.method = federation, cfg, seed, method
        self.device = device = resolve_device(cfg)
        self.model, self.spec = new_model(federation, cfg, derive_seed(seed, "init"))
        self.model.to(device)
        K = self.num_clients = federation.num_clients
        self.per_round = max(round(K * cfg.client_fraction), 1)
        self.data, self.rates = dp_sgd_clients(federation, device, cfg.batch_size)
        self.x_val, self.y_val = federation.public_arrays("distill")
        if len(self.y_val) == 0:
            raise PrivkitError(
                "the federation has no public distill data for the feedback Metric; found 0 records"
            )
        self.x_test, self.y_test = federation.test_arrays()

        from accountants import Ledger

        self.ledger = Ledger()
        self.budget = _Budget(cfg.accountant, cfg.delta)
        self.rng = make_rng(seed, "client-sampling")
        self.sigma = cfg.noise_multiplier
        self.rho: float | None = None  # no distillation: cross-entropy alone
        l0, a0 = _public_eval(self.model, self.x_val, self.y_val, device)
        self.loss_hist, self.acc_hist = [l0], [a0]
        self.grad_norms: list[float] = []
        self.sigmas_used: list[float] = []
        self.rounds: list[dict] = []
        self.stop = f"completed all {cfg.rounds} rounds"
        self.t, self.ended = 0, False
        self.sampled: list[int] = []

    def next_round(self) -> list[int] | None:
        """Sample the next round's clients and check the budget before it; ``None`` once training
        has ended (no round past ``target_epsilon`` or the filter is ever released)."""
        from accountants import dpsgd_event

        cfg = self.cfg
        if self.ended or self.t >= cfg.rounds:
            self.ended = True
            return None
        t = self.t + 1
        sampled = np.sort(self.rng.choice(self.num_clients, size=self.per_round, replace=False))
        # Budget check BEFORE the round: never release a round past target_epsilon.
        pending = {}
        for k in sampled:
            ev = dpsgd_event(self.rates[k], self.sigma, cfg.local_steps)
            pending[int(k)] = (
                ev,
                *self.budget.would_be(int(k), self.rates[k], self.sigma, cfg.local_steps),
            )
        would = max(e for _, _, e in pending.values())
        if would > cfg.target_epsilon:
            self.stop = (
                f"stopped before round {t}: it would bring a client to epsilon {would:.4g} > "
                f"target {cfg.target_epsilon:g} ({cfg.accountant}, delta={cfg.delta:g})"
            )
            self.ended = True
            return None
        refusal = self._refuse(t, [int(k) for k in sampled])
        if refusal is not None:
            self.stop, self.ended = refusal, True
            return None
        self.t, self.pending = t, pending
        self.sampled = [int(k) for k in sampled]
        self.prev = _flat(self.model)
        return list(self.sampled)

    def _refuse(self, t: int, sampled: list[int]) -> str | None:
        """Why round ``t`` with these clients must not run beyond the budget check (None: it may)."""
        return None

    def client_seed(self, k: int) -> int:
        """The seed of client ``k``'s local update in the current round."""
        return client_seed(self.seed, self.t, k)

    def finish_round(
        self, states: list[dict[str, torch.Tensor]], receipts: list[list] | None = None
    ) -> None:
        """Account the round's clients (in the sampled order), average their states, evaluate,
        and (FedKADP) set the next round's temperature and noise multiplier.

        ``receipts`` (one list per sampled client, where the engine ran the local updates in this
        process): the releases each client made; the ledger records their composition, and a
        client whose releases differ from what the budget check admitted is an error (never a
        plan accounted in place of what ran)."""
        self.average_round(states, receipts)
        self.conclude_round()

    def average_round(
        self, states: list[dict[str, torch.Tensor]], receipts: list[list] | None = None
    ) -> None:
        """:meth:`finish_round` up to the new global model: the round's clients accounted, their
        states averaged into :attr:`model`."""
        from privkit.mechanisms.gaussian import compose_receipts

        t = self.t
        for i, k in enumerate(self.sampled):
            ev, acc, eps = self.pending[k]
            if receipts is not None:
                ran = compose_receipts(receipts[i])
                if ran != ev:
                    raise PrivkitError(
                        f"client {k} released {ran} in round {t}; the budget admitted {ev}"
                    )
                ev = ran
            self.budget.commit(k, acc, eps)
            self._spend(k)
            self.ledger.add(k, ev, f"round {t}: dp-sgd", round=t)
        self.model.load_state_dict(_mean_state(states))

    @property
    def validates(self) -> bool:
        """Whether :meth:`conclude_round` evaluates the global model on the public validation
        data (a reported run, or one whose training reads it: FedKADP's feedback)."""
        return self.report_metrics or self.needs_validation

    def conclude_round(self, validation: tuple[float, float] | None = None) -> None:
        """:meth:`finish_round` after :meth:`average_round`: the new global model evaluated, the
        round recorded, (FedKADP) the next round's temperature and noise multiplier set.
        ``validation``: that model's (loss, accuracy) on the public validation data where the
        caller computed them (the batched path, for an audit's reference runs, in one stacked
        pass); else, where :attr:`validates`, computed here."""
        t, device = self.t, self.device
        self.sigmas_used.append(self.sigma)
        nan = float("nan")
        if validation is None:
            validation = (
                _public_eval(self.model, self.x_val, self.y_val, device)
                if self.validates
                else (nan, nan)
            )
        val_loss, val_acc = validation
        test_acc = (
            accuracy(self.model, self.x_test, self.y_test, device) if self.report_metrics else nan
        )
        row = {
            "round": t,
            "test_accuracy": test_acc,
            "loss": val_loss,
            "val_accuracy": val_acc,
            "sigma": self.sigma,
            "rho": self.rho,
            "epsilon": self.budget.worst,
            "clients": list(self.sampled),
        }
        g_t = float((_flat(self.model) - self.prev).norm())
        self._feedback(row, g_t, val_loss, val_acc)
        self.grad_norms.append(g_t)
        self.loss_hist.append(val_loss)
        self.acc_hist.append(val_acc)
        self.rounds.append(row)

    def _spend(self, client: int) -> None:
        """Charge ``client``'s share of the round just accounted beyond the ledger (none here)."""

    def _feedback(self, row: dict, g_t: float, val_loss: float, val_acc: float) -> None:
        """Set the next round's parameters from this round's metrics (fixed here)."""

    def _claims(self) -> dict:
        """Claims beyond the paper's formula and privkit's epsilon (none here)."""
        return {}

    def _warnings(self) -> list[str]:
        return _warnings(self.cfg, min(self.rates), max(self.rates))

    def result(self) -> TrainResult:
        """The run's :class:`TrainResult` (after :meth:`next_round` returned ``None``)."""
        cfg, sigmas_used, per_round = self.cfg, self.sigmas_used, self.per_round
        test_acc = accuracy(self.model, self.x_test, self.y_test, self.device)
        # the paper's formula, only ever reported (an audit's reference run leaves it out: with
        # FedKADP's per-round noise multipliers it is a few ms a round)
        unreported = (math.nan, None)
        paper_server, paper_client = (
            (
                paper_epsilon(
                    sigmas_used, cfg.client_fraction, cfg.local_steps, cfg.delta, n=per_round
                ),
                paper_epsilon(sigmas_used, cfg.client_fraction, cfg.local_steps, cfg.delta, n=1),
            )
            if self.report_metrics
            else (unreported, unreported)
        )
        claims = {
            "epsilon": paper_server[0],
            "delta": cfg.delta,
            "order": paper_server[1],
            "epsilon_per_client_form": paper_client[0],
            "order_per_client_form": paper_client[1],
            "sample_rate_used": cfg.client_fraction,
            "clients_per_round": per_round,
            "rounds": len(sigmas_used),
            "composition": "RDP, WBK19 Thm 9 as stated in the paper",
            "source": "FedKADP Sec. 4.1-4.2 (server form with n sigma^2; per-client form with n=1)",
            "privkit_epsilon": self.budget.worst,
            "privkit_accountant": cfg.accountant,
            "target_epsilon": cfg.target_epsilon,
            "stop": self.stop,
        }
        claims.update(self._claims())
        warns = self._warnings()
        warns.append(f"Training {self.stop}.")
        return TrainResult(
            method=self.method,
            seed=self.seed,
            config=cfg.model_dump(),
            model=self.model.cpu(),
            model_spec=self.spec,
            ledger=self.ledger,
            rounds=self.rounds,
            test_accuracy=test_acc,
            warnings=warns,
            claims=claims,
        )


def _drive(run: DpFedRun, progress: bool = False) -> TrainResult:
    """Run ``run`` to its end, one client after the other."""
    cfg, method = run.cfg, run.method
    iterator: Iterable[int] = range(1, cfg.rounds + 1)
    if progress:
        from rich.progress import track

        iterator = track(iterator, description=f"{method} rounds")
    for _ in iterator:
        sampled = run.next_round()
        if sampled is None:
            break
        receipts: list[list] = [[] for _ in sampled]  # each client's releases, for the ledger
        states = [
            _local_update(
                run.model,
                *run.data[k],
                cfg,
                run.sigma,
                run.rho,
                run.client_seed(k),
                run.device,
                client=k,
                receipts=receipts[i],
            )
            for i, k in enumerate(sampled)
        ]
        run.finish_round(states, receipts)
    return run.result()


def dp_fedavg_run(federation, cfg: DpFedConfig, seed: int) -> DpFedRun:
    """The :class:`DpFedRun` that ``train("dp-fedavg", ...)`` drives."""
    return DpFedRun(federation, cfg, seed, method="dp-fedavg")


# method "dp-fedavg": config and registration in privkit.methods.dp_fedavg
def train_dp_fedavg(
    federation, config: DpFedConfig, seed: int, progress: bool = False
) -> TrainResult:
    """DP-FedAvg baseline (DP-FL of FedKADP Sec. 5.4): same DP-SGD, no distillation, fixed sigma."""
    return _drive(dp_fedavg_run(federation, config, seed), progress)
