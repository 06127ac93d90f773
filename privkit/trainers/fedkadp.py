"""FedKADP (Jiang et al., Electronics 2024; seed 004) and its baseline DP-FedAvg. ``feedback=false``
is the ablation without the bidirectional feedback (FedKADP's loss at a fixed temperature and
noise). The paper's other baseline, FedKD (Wu et al. 2022) with DP, is
:mod:`privkit.trainers.fedkd` (``fedkd-dp``).

All three share one loop (Algorithms 1-2):

* server: each round samples ``N = max(round(K s), 1)`` clients uniformly without replacement,
  sends them the global model ``w_{t-1}``, averages what they return (equal weights, Alg. 2 line 8);
* client (Alg. 1): ``student = teacher = w_{t-1}``; ``E`` DP-SGD steps (:mod:`dp_sgd_step`):
  per-sample clipping to ``c``, Gaussian noise ``sigma_t c`` on the sum, divided by ``B``; the
  loss is ``CE(y, student) + rho^2 KL(softmax(teacher/rho) || softmax(student/rho))`` (FedKADP)
  or ``CE`` alone (DP-FedAvg);
* FedKADP only: after each round the bidirectional-feedback ``Metric`` (Sec. 3.2) sets the next
  temperature ``rho`` (Eq. 17) and noise multiplier ``sigma`` (Eq. 20).

Where privkit departs from the paper, and why:

* **Sampling.** Alg. 1 partitions ``D_k`` into batches; privkit draws each batch by Poisson
  sampling with rate ``q_k = B / n_k``, the sampling that the subsampled-Gaussian accountant
  (add/remove-one neighbours) assumes, so the ledger matches what ran.
* **Budget check before the round.** Alg. 2 releases ``w_t`` and then checks ``eps_t > eps_T``,
  so its last round overshoots the budget. privkit computes, before round ``t``, the epsilon every
  sampled client *would* have after it, and stops if any exceeds ``target_epsilon``: no round past
  the budget is ever released.
* **Validation data.** The Metric's loss ``L_t`` and accuracy ``a_t`` are computed on the public
  data (the federation's ``distill`` part) only, never on client data, so the feedback reads only
  DP outputs and public data.
* **Accounting.** Per client, per round it took part in: ``E`` Poisson-subsampled Gaussian steps
  with ``q_k = B/n_k`` and that round's ``sigma_t`` (record-level, add/remove-one). The paper's
  own formula (Sec. 4.1) is reported beside it in ``claims`` with the reasons it is not sound.

Defaults the paper does not give (documented in the config fields): clip norm ``c = 1``, decay
``p = 0.95``, metric weights 0.25 each, ``Metric_DP = 60``, ``Metric_KD = 50``, steepness
``k = 0.1``, ``eps_T = 3``, ``delta = 1e-5``, the initial temperature (``rho_min``), and how the
Metric treats terms that are undefined in the first rounds (see :func:`feedback_metric`).
"""

from __future__ import annotations

import collections
import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from scipy.special import gammaln, logsumexp

from privkit.errors import PrivkitError
from privkit.methods.fedkadp import PAPER, QUICK, DpFedConfig, FedKADPConfig  # noqa: F401  (re-exported)
from privkit.seeding import derive_seed, make_rng, noise_generator
from privkit.trainers.base import TrainResult
from privkit.trainers.common import accuracy, as_tensor, new_model, predict_logits, resolve_device
from privkit.trainers.dp_sgd_step import DpSgdStep


# ============================================================================ feedback Metric (Sec. 3.2)
def metric_gradient(g_t: float, previous: list[float]) -> float:
    """``M_g = max(100 (1 - |g_t - g_avg| / g_avg), 0)``, ``g_avg`` = mean of the previous norms.

    In round 1 there is no previous norm: ``g_avg := g_t`` (M_g = 100).
    """
    g_avg = float(np.mean(previous)) if previous else g_t
    if g_avg <= 0:
        return 0.0
    return max(100.0 * (1.0 - abs(g_t - g_avg) / g_avg), 0.0)


def metric_loss(loss_t: float, loss_prev: float) -> float:
    """``M_l = 100 (1 - r_l)`` if ``r_l < 0`` else ``100 max(1 - r_l / 2, 0)``; ``r_l = (L_t - L_{t-1}) / L_{t-1}``."""
    if loss_prev <= 0 or not math.isfinite(loss_prev):
        return 100.0
    r = (loss_t - loss_prev) / loss_prev
    return 100.0 * (1.0 - r) if r < 0 else 100.0 * max(1.0 - 0.5 * r, 0.0)


def metric_accuracy(a_t: float, a_prev: float, a_prev2: float | None, clip: float = 100.0) -> float:
    """``M_a = 100 (a_t - a_{t-1}) / (a_{t-1} - a_{t-2})``, capped to ``[-clip, clip]``.

    Undefined (no ``a_{t-2}``, or a zero denominator) gives 0. The cap is privkit's: the paper's
    ratio is unbounded and a tiny denominator would otherwise decide the whole Metric.
    """
    if a_prev2 is None or a_prev == a_prev2:
        return 0.0
    value = 100.0 * (a_t - a_prev) / (a_prev - a_prev2)
    return float(min(max(value, -clip), clip))


def metric_time(t: int, total: int) -> float:
    """``M_t = 100 / (1 + exp(-(t/T - 0.5)))``: rises from ~37.8 (t=0) to ~62.2 (t=T).

    The minus sign is lost in the paper's HTML; rising is the reading under which Sec. 5.1's
    "temperature rises as training progresses" holds.
    """
    return 100.0 / (1.0 + math.exp(-(t / total - 0.5)))


def feedback_metric(components: dict[str, float], weights: dict[str, float]) -> float:
    """``Metric = w_g M_g + w_l M_l + w_a M_a + w_t M_t`` (keys ``g``, ``l``, ``a``, ``t``)."""
    return float(sum(weights[k] * components[k] for k in ("g", "l", "a", "t")))


def adapt_temperature(metric: float, rho_min: float, rho_max: float, steepness: float, metric_kd: float) -> float:
    """Eq. 17: ``rho_t = rho_min + (rho_max - rho_min) / (1 + exp(-k (Metric - Metric_KD)))``."""
    z = -steepness * (metric - metric_kd)
    sig = 1.0 / (1.0 + math.exp(z)) if z < 700 else 0.0
    return rho_min + (rho_max - rho_min) * sig


def adapt_noise(sigma: float, metric: float, decay: float, metric_dp: float) -> float:
    """Eq. 20: ``sigma_t = p sigma_{t-1}`` if ``Metric >= Metric_DP`` else ``sigma_{t-1}``."""
    return sigma * decay if metric >= metric_dp else sigma


# ============================================================================ the paper's privacy formula (Sec. 4.1)
def _log_binom(a: int, j: np.ndarray) -> np.ndarray:
    return gammaln(a + 1) - gammaln(j + 1) - gammaln(a - j + 1)


def paper_round_rdp(alpha: int, sample_rate: float, sigma: float, local_steps: int, n: int = 1) -> float:
    """One round of the paper's RDP bound at integer order ``alpha >= 2`` (Sec. 4.1), as stated.

    ``E/(alpha-1) log(1 + s^2 C(alpha,2) min(4(e^{1/(n sigma^2)} - 1), 2 e^{1/(n sigma^2)})
    + 2 sum_{j=3}^{alpha} s^j C(alpha,j) e^{j(j-1)/(2 n sigma^2)})``. ``n = 1`` is the per-client
    form, ``n`` = clients per round the server form ("following Noble et al.").
    """
    if alpha < 2:
        raise PrivkitError(f"alpha must be an integer >= 2; found {alpha}")
    v = 1.0 / (n * sigma ** 2)
    second = sample_rate ** 2 * math.comb(alpha, 2) * min(4.0 * math.expm1(v), 2.0 * math.exp(v))
    log_terms = [math.log1p(second)]
    if alpha >= 3:
        j = np.arange(3, alpha + 1, dtype=float)
        higher = logsumexp(math.log(2.0) + j * math.log(sample_rate) + _log_binom(alpha, j)
                           + j * (j - 1) * v / 2.0)
        log_terms.append(float(higher))
    return local_steps * float(logsumexp(log_terms)) / (alpha - 1)


def paper_epsilon(sigmas: list[float], sample_rate: float, local_steps: int, delta: float, n: int = 1,
                  max_order: int = 256) -> tuple[float, int]:
    """The paper's ``min_alpha sum_t eps_t(alpha, sigma_t) + log(1/delta)/(alpha-1)`` (Sec. 4.2).

    ``sample_rate`` is the paper's ``s`` (the *client* sampling rate), summed over all rounds that
    ran. Returns ``(epsilon, alpha)``; orders are the integers 2..``max_order``. This reproduces the
    paper's arithmetic; it is NOT a sound bound (see the trainer's warnings).
    """
    if not sigmas:
        return 0.0, 2
    counts = collections.Counter(float(s) for s in sigmas)  # rounds with equal sigma cost the same
    best = (math.inf, 2)
    for alpha in range(2, max_order + 1):
        eps = sum(c * paper_round_rdp(alpha, sample_rate, s, local_steps, n) for s, c in counts.items())
        eps += math.log(1.0 / delta) / (alpha - 1)
        best = min(best, (eps, alpha))
    return best


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
        return ce + rho ** 2 * kl

    return loss


def _local_update(global_model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: DpFedConfig,
                  sigma: float, rho: float | None, seed: int, device: torch.device,
                  client: int = 0) -> dict[str, torch.Tensor]:
    """Algorithm 1 on one client: ``E`` Poisson-sampled DP-SGD steps from the global model (taking
    an audit's probes when ``client``'s mechanism is probed: :mod:`privkit.probes`)."""
    n = len(y)
    step = DpSgdStep(cfg.clip_norm, sigma, min(1.0, cfg.batch_size / n), n)
    student = copy.deepcopy(global_model).to(device).train()
    teacher = copy.deepcopy(global_model).to(device).eval() if rho is not None else None
    params = [p for p in student.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(params, lr=cfg.lr) if cfg.optimizer == "sgd"
           else torch.optim.Adam(params, lr=cfg.lr))
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
        step.apply(student, opt, xb, yb, loss_fn, noise_gen, aux, canaries=canaries)
    return {k: v.detach() for k, v in student.state_dict().items()}


def _mean_state(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@torch.no_grad()
def _public_eval(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, device: torch.device) -> tuple[float, float]:
    """(cross-entropy loss, accuracy) of ``model`` on public validation data."""
    logits = torch.as_tensor(predict_logits(model, x, device))
    yt = torch.as_tensor(y, dtype=torch.long)
    return float(F.cross_entropy(logits, yt)), float((logits.argmax(1) == yt).float().mean())


def _rdp_curve(sample_rate: float, noise_multiplier: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """dp-accounting's RDP curve (orders, values) of ``steps`` Poisson-subsampled Gaussian steps.

    :mod:`accountants.fast` caches the one-step curve per (q, sigma), which recurs every round for
    every client with the same data size.  RDP composes by adding curves over the same orders.
    """
    from accountants import dpsgd_event, new_accountant

    acc = new_accountant("rdp")
    acc.compose(dpsgd_event(sample_rate, noise_multiplier, steps))
    return acc.rdp_curve()


class _Budget:
    """Per-client epsilon of the events released so far, for the check before each round.

    ``rdp``: RDP curves added per client (dp-accounting's orders and conversion, identical to the
    ledger's rdp accountant). ``pld``: one dp-accounting PLD accountant per client, composed round
    by round (pessimistic, an upper bound).
    """

    def __init__(self, accountant: str, delta: float) -> None:
        self.accountant, self.delta = accountant, delta
        self.state: dict[int, object] = {}
        self.eps: dict[int, float] = {}

    def would_be(self, client: int, sample_rate: float, noise_multiplier: float, steps: int) -> tuple[object, float]:
        """(state, epsilon) of ``client`` if it took part in one more round with these parameters."""
        import dp_accounting as dpa

        if self.accountant == "rdp":
            orders, curve = _rdp_curve(float(sample_rate), float(noise_multiplier), int(steps))
            total = curve + self.state[client] if client in self.state else curve
            eps, _ = dpa.rdp.rdp_privacy_accountant.compute_epsilon(orders, total, self.delta)
            return total, float(eps)
        from accountants import PLD_VDI, dpsgd_event, new_accountant

        acc = copy.deepcopy(self.state[client]) if client in self.state else new_accountant("pld", vdi=PLD_VDI)
        acc.compose(dpsgd_event(sample_rate, noise_multiplier, steps))
        return acc, float(acc.get_epsilon(self.delta))

    def commit(self, client: int, state: object, eps: float) -> None:
        self.state[client], self.eps[client] = state, eps

    @property
    def worst(self) -> float:
        return max(self.eps.values(), default=0.0)


def _plan_filter(cfg: DpFedConfig, q_max: float):
    """FedKADP's Rényi filter (Feldman & Zrnic 2021), fixed before training from the config alone.

    The order is the one that affords the most rounds at the initial noise multiplier for the client
    with the largest sampling rate; its budget converts to exactly ``target_epsilon`` at ``delta``.
    """
    from accountants import RenyiFilter, plan_order
    from accountants.fast import poisson_gaussian_rdp
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    orders = [a for a in DEFAULT_RDP_ORDERS if a >= 1.1]
    order, _ = plan_order(cfg.target_epsilon, cfg.delta,
                          lambda a: cfg.local_steps * poisson_gaussian_rdp(q_max, cfg.noise_multiplier, a), orders)
    return RenyiFilter.for_epsilon(cfg.target_epsilon, cfg.delta, order)


def _round_rdp(order: float, sample_rate: float, sigma: float, steps: int) -> float:
    from accountants.fast import poisson_gaussian_rdp

    return steps * float(poisson_gaussian_rdp(sample_rate, sigma, [order])[0])


def _warnings(cfg: DpFedConfig, adaptive: bool, q_min: float, q_max: float) -> list[str]:
    out = [
        (f"Accounting is record-level, per client, add/remove-one neighbours: each round a client takes "
        f"part in is {cfg.local_steps} Poisson-subsampled Gaussian steps with q = B/n_k "
        f"(here {q_min:.4g}..{q_max:.4g}) and that round's noise multiplier; client sampling is not "
        "used for amplification and no trusted aggregator is assumed (each upload is a release)."),
        ("privkit draws each local batch by Poisson sampling (rate B/n_k) where the paper partitions "
        "D_k into batches, so that the accountant's sampling model is the one that ran."),
        ("The paper's formula (claims) is not a sound bound: it applies Wang-Balle-Kasiviswanathan "
        "Thm 9 (sampling without replacement, replace-one neighbours) with the add/remove Gaussian "
        "RDP j/(2 sigma^2) (replace-one needs 2j/sigma^2: 4x in RDP); it uses the client sampling "
        "rate s for record-level amplification (the record-level rate is B/n_k); it divides the "
        "noise variance by the number of clients per round (n sigma^2), which holds only if the "
        "adversary sees nothing but the aggregate (trusted server or secure aggregation); and its "
        "min{2, .} terms leave a floor that more noise does not lower."),
    ]
    if adaptive:
        out.append(
            "sigma_t and rho_t are chosen from training metrics (global-model gradient norm, loss and "
            "accuracy on public data), and so is when training stops: the ledger's composition of the "
            "recorded rounds assumes their parameters were fixed in advance and does not cover that. "
            "privkit runs FedKADP under a Renyi filter (Feldman & Zrnic 2021, Thm. 3.1): the order is "
            "fixed before training from the initial noise multiplier, each client's RDP at that order is "
            "summed round by round, and no round is released that would pass the budget, so every client "
            "is (target_epsilon, delta)-DP whatever the adaptive choices (claims['adaptive_filter']).")
    return out


def _run(federation, cfg: DpFedConfig, seed: int, *, method: str, distill: bool, adaptive: bool,
         progress: bool = False) -> TrainResult:
    from accountants import Ledger, dpsgd_event

    device = resolve_device(cfg)
    model, spec = new_model(federation, cfg, derive_seed(seed, "init"))
    model.to(device)
    K = federation.num_clients
    per_round = max(round(K * cfg.client_fraction), 1)
    clients = [federation.client_arrays(k) for k in range(K)]
    if any(len(y) == 0 for _, y in clients):
        raise PrivkitError("every client needs at least one record for DP-SGD; found an empty client")
    data = [(as_tensor(x, device, torch.float32), as_tensor(y, device, torch.long)) for x, y in clients]
    rates = [min(1.0, cfg.batch_size / len(y)) for _, y in clients]
    x_val, y_val = federation.public_arrays("distill")
    if len(y_val) == 0:
        raise PrivkitError("the federation has no public distill data for the feedback Metric; found 0 records")
    x_test, y_test = federation.test_arrays()

    ledger = Ledger()
    budget = _Budget(cfg.accountant, cfg.delta)
    rdp_filter = _plan_filter(cfg, max(rates)) if adaptive else None
    rng = make_rng(seed, "client-sampling")
    sigma = cfg.noise_multiplier
    rho = (cfg.rho_min if adaptive else cfg.temperature) if distill else None
    loss_hist, acc_hist = [], []
    l0, a0 = _public_eval(model, x_val, y_val, device)
    loss_hist.append(l0)
    acc_hist.append(a0)
    grad_norms: list[float] = []
    sigmas_used: list[float] = []
    rounds: list[dict] = []
    stop = f"completed all {cfg.rounds} rounds"
    weights = ({"g": cfg.weight_gradient, "l": cfg.weight_loss, "a": cfg.weight_accuracy,
                "t": cfg.weight_time} if adaptive else None)

    iterator = range(1, cfg.rounds + 1)
    if progress:
        from rich.progress import track

        iterator = track(iterator, description=f"{method} rounds")
    for t in iterator:
        sampled = np.sort(rng.choice(K, size=per_round, replace=False))
        # Budget check BEFORE the round: never release a round past target_epsilon.
        pending = {}
        for k in sampled:
            ev = dpsgd_event(rates[k], sigma, cfg.local_steps)
            pending[int(k)] = (ev, *budget.would_be(int(k), rates[k], sigma, cfg.local_steps))
        would = max(e for _, _, e in pending.values())
        if would > cfg.target_epsilon:
            stop = (f"stopped before round {t}: it would bring a client to epsilon {would:.4g} > "
                    f"target {cfg.target_epsilon:g} ({cfg.accountant}, delta={cfg.delta:g})")
            break
        spend = {}
        if rdp_filter is not None:  # the guarantee under adaptivity: the filter must admit the round
            spend = {int(k): _round_rdp(rdp_filter.order, rates[k], sigma, cfg.local_steps) for k in sampled}
            refused = [k for k, r in spend.items() if not rdp_filter.admits(k, r)]
            if refused:
                stop = (f"stopped before round {t}: the Renyi filter (order {rdp_filter.order:g}, budget "
                        f"{rdp_filter.budget:.4g}) would be passed by client {refused[0]}")
                break
        prev = _flat(model)
        states = []
        for k in sampled:
            k = int(k)
            cseed = derive_seed(seed, f"round{t}/client{k}")
            states.append(_local_update(model, *data[k], cfg, sigma, rho, cseed, device, client=k))
            ev, acc, eps = pending[k]
            budget.commit(k, acc, eps)
            if rdp_filter is not None:
                rdp_filter.spend(k, spend[k])
            ledger.add(k, ev, f"round {t}: dp-sgd", round=t)
        model.load_state_dict(_mean_state(states))
        sigmas_used.append(sigma)
        val_loss, val_acc = _public_eval(model, x_val, y_val, device)
        test_acc = accuracy(model, x_test, y_test, device)
        row = {"round": t, "test_accuracy": test_acc, "loss": val_loss, "val_accuracy": val_acc,
               "sigma": sigma, "rho": rho, "epsilon": budget.worst, "clients": [int(k) for k in sampled]}
        g_t = float((_flat(model) - prev).norm())
        if adaptive:
            comp = {"g": metric_gradient(g_t, grad_norms), "l": metric_loss(val_loss, loss_hist[-1]),
                    "a": metric_accuracy(val_acc, acc_hist[-1], acc_hist[-2] if len(acc_hist) > 1 else None,
                                         cfg.accuracy_clip),
                    "t": metric_time(t, cfg.rounds)}
            metric = feedback_metric(comp, weights)
            row.update({"metric": metric, "metric_components": comp})
            rho = adapt_temperature(metric, cfg.rho_min, cfg.rho_max, cfg.steepness, cfg.metric_kd)
            sigma = adapt_noise(sigma, metric, cfg.decay, cfg.metric_dp)
        grad_norms.append(g_t)
        loss_hist.append(val_loss)
        acc_hist.append(val_acc)
        rounds.append(row)

    test_acc = accuracy(model, x_test, y_test, device)
    paper_server = paper_epsilon(sigmas_used, cfg.client_fraction, cfg.local_steps, cfg.delta, n=per_round)
    paper_client = paper_epsilon(sigmas_used, cfg.client_fraction, cfg.local_steps, cfg.delta, n=1)
    claims = {
        "epsilon": paper_server[0], "delta": cfg.delta, "order": paper_server[1],
        "epsilon_per_client_form": paper_client[0], "order_per_client_form": paper_client[1],
        "sample_rate_used": cfg.client_fraction, "clients_per_round": per_round,
        "rounds": len(sigmas_used), "composition": "RDP, WBK19 Thm 9 as stated in the paper",
        "source": "FedKADP Sec. 4.1-4.2 (server form with n sigma^2; per-client form with n=1)",
        "privkit_epsilon": budget.worst, "privkit_accountant": cfg.accountant,
        "target_epsilon": cfg.target_epsilon, "stop": stop,
    }
    if rdp_filter is not None:
        claims["adaptive_filter"] = rdp_filter.to_dict(cfg.delta)
        ledger.adaptive = claims["adaptive_filter"]
    warns = _warnings(cfg, adaptive, min(rates), max(rates))
    warns.append(f"Training {stop}.")
    return TrainResult(method=method, seed=seed, config=cfg.model_dump(), model=model.cpu(), model_spec=spec,
                       ledger=ledger, rounds=rounds, test_accuracy=test_acc, warnings=warns, claims=claims)


# method "fedkadp": config and registration in privkit.methods.fedkadp
def train_fedkadp(federation, config: FedKADPConfig, seed: int, progress: bool = False) -> TrainResult:
    """FedKADP (Algorithms 1-2) with per-client record-level accounting (``feedback=false``: ablation)."""
    return _run(federation, config, seed, method="fedkadp", distill=True, adaptive=config.feedback,
                progress=progress)


# method "dp-fedavg": config and registration in privkit.methods.fedkadp
def train_dp_fedavg(federation, config: DpFedConfig, seed: int, progress: bool = False) -> TrainResult:
    """DP-FedAvg baseline (DP-FL of FedKADP Sec. 5.4): same DP-SGD, no distillation, fixed sigma."""
    return _run(federation, config, seed, method="dp-fedavg", distill=False, adaptive=False, progress=progress)
