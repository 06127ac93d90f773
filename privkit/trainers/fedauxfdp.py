"""FedAUXfdp (Hoech et al., seed 000) and its Table 2 baselines FedAvg+P / FedD+P with DP heads.

One round, full participation, frozen h0 (SimCLR on public data, :mod:`privkit.trainers.pretrain`):

* client i fits the exact multinomial logistic class head over all C global classes on
  ``phi(h0(D_i))`` (Eq. 2, lambda ``class_lambda``) and releases it with Gaussian noise
  (Algorithm 1): sensitivity ``2 sqrt(C)/(lam |D_i|)`` (Thm 1, ``sensitivity_bound="paper"``) or
  privkit's ``2 sqrt(2)/(lam |D_i|)`` (``"cfree"``, proof in
  :func:`~privkit.trainers.heads.fit_multinomial_head`); noise ``classic`` (as the paper) or
  ``analytic``; ledger event ``GaussianDpEvent`` labelled ``class-head``;
* client i releases its DP scoring head as in FedAUX (label ``scores``,
  :func:`~privkit.trainers.fedaux.release_scoring_heads`);
* the server labels the distillation data with ``Y(x) = sum_i s_i(x) g_i(x) / sum_i s_i(x)``
  (Eq. 1, g_i = softmax of class head i: probabilities, as the paper writes it) and trains a
  student initialised from h0 (no parameter averaging) with KL for ``student_epochs`` epochs of Adam
  at ``student_lr``, batch 128 (paper: 10 epochs, 5e-5).

Claim (Sec. 4.3, Table 2): basic composition, ``(class_epsilon + score_epsilon,
class_delta + score_delta)`` = (0.6, 2e-5) at the defaults. The ledger lets the accountants give a
tighter (PLD/RDP) figure for the same two Gaussian releases.

Baselines (Table 2; methods note 1 [gap]: the paper does not say how they were privatised): each
client releases its class head ONCE through the Gaussian mechanism at the whole budget
``(class_epsilon + score_epsilon, class_delta + score_delta)``; no scores.

* ``fedavg-dphead`` (FedAvg+P): server model = h0 + the mean of the clients' DP heads.
* ``fedd-dphead`` (FedD+P): the equally weighted ensemble of DP heads labels ``D_distill`` with
  ``softmax(mean_i logits_i(x))``, the FedD/FedDF aggregation (Lin et al. 2020; FedAUX Eq. 2, which
  FedAUXfdp's FedD baseline is taken from); a student initialised from h0 is trained on it exactly
  as FedAUXfdp's. On the shared frozen h0 the mean of the heads' logits is the logit of the mean
  head, so FedD+P is a distilled FedAvg+P. ``ensemble="probabilities"`` averages the heads'
  softmax outputs instead (not the paper's baseline; a diagnostic that isolates the effect of
  averaging probabilities, which FedAUXfdp's Eq. 1 does, from the effect of the scores).

The released models carry the feature map inside them (``normalize=True`` features, the head on
``h/||h||`` scaled by 1/sqrt(2)), so a server head acts on raw inputs exactly as it was fitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from privkit.errors import PrivkitError
from privkit.methods.contract import TrainResult
from privkit.methods.fedauxfdp import DpHeadBaselineConfig, DpHeadConfig, FedAuxFdpConfig
from privkit.progress import progress_bar
from privkit.seeding import derive_seed, noise_rng
from privkit.trainers.common import accuracy, distill, new_model, resolve_device
from privkit.trainers.fedaux import (
    EQ4_NOTE,
    FrozenFeatures,
    ScoreRelease,
    release_scoring_head,
    score_info,
)
from privkit.trainers.heads import (
    HeadRelease,
    certainty_scores,
    fit_multinomial_head,
    head_probabilities,
    head_to_linear,
    release_head,
)
from privkit.trainers.pretrain import pretrain_h0

Aggregation = Literal["scores", "mean-head", "mean-ensemble"]


def _released_model(
    federation,
    cfg: DpHeadConfig,
    h0_state: dict,
    center: np.ndarray | None,
    W: np.ndarray | None,
    seed: int,
):
    """h0 + the feature map's centring/normalisation, with head ``W`` as an ``nn.Linear`` (random if None)."""
    model, spec = new_model(federation, cfg, derive_seed(seed, "student-init"), normalize=True)
    missing, unexpected = model.features.load_state_dict(h0_state, strict=False)
    if unexpected or any(not k.endswith("center") for k in missing):
        raise PrivkitError(f"h0 does not fit the model: missing {missing}, unexpected {unexpected}")
    if center is not None:
        model.features[-1].center.copy_(torch.as_tensor(center, dtype=torch.float32))  # type: ignore[index]  # a Sequential
    if W is not None:
        weight, bias = head_to_linear(W)
        with torch.no_grad():
            model.head.weight.copy_(torch.as_tensor(weight, dtype=torch.float32))
            model.head.bias.copy_(torch.as_tensor(bias, dtype=torch.float32))
    return model, spec


def _weighted_labels(probs: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """Eq. 1: ``sum_i w_i(x) g_i(x) / sum_i w_i(x)`` for probs (clients, N, C); equal weights if None."""
    w = np.ones(probs.shape[:2]) if weights is None else weights
    return ((w[:, :, None] * probs).sum(0) / w.sum(0)[:, None]).astype(np.float32)


@dataclass
class DpHeadsSetup:
    """What the server prepares before the clients release their heads: h0, the feature map, the
    public features, and the budget each class head is released at."""

    method: str
    aggregation: Aggregation
    h0_state: dict
    h0_spec: dict
    pretrain_info: dict
    phi: FrozenFeatures
    phi_neg: np.ndarray | None
    phi_distill: np.ndarray
    phi_test: np.ndarray
    class_epsilon: float
    class_delta: float
    baseline: bool
    active: list[int]


@dataclass
class ClientHeads:
    """One client's releases: its DP class head and (FedAUXfdp) its DP scoring head. The clean
    heads stay with the client; what leaves it is ``weights`` and the ledger events."""

    client: int
    class_release: HeadRelease
    score_release: Any  # a HeadRelease (FedAUXfdp) or None
    n_private: int


def dp_heads_setup(
    method: str,
    aggregation: Aggregation,
    federation,
    cfg: DpHeadConfig,
    seed: int,
    progress: bool = False,
) -> DpHeadsSetup:
    """The server's side before the round: h0 (public data only), the feature map and public features."""
    device = resolve_device(cfg)
    h0_state, pinfo = pretrain_h0(federation, cfg, seed, progress=progress)
    h0_model, h0_spec = new_model(federation, cfg, derive_seed(seed, "h0"))
    h0_model.features.load_state_dict(h0_state)
    phi = FrozenFeatures(h0_model, federation, device, cfg.eval_batch_size, cfg.center_features)
    x_distill, _ = federation.public_arrays("distill")
    x_test, _ = federation.test_arrays()
    baseline = aggregation != "scores"
    eps_total, delta_total = cfg.budget()
    eps_c, delta_c = (eps_total, delta_total) if baseline else (cfg.class_epsilon, cfg.class_delta)
    phi_neg = None if baseline else phi(federation.public_arrays("negative")[0])
    active = [i for i in range(federation.num_clients) if len(federation.clients[i])]
    return DpHeadsSetup(
        method,
        aggregation,
        h0_state,
        h0_spec,
        pinfo,
        phi,
        phi_neg,
        phi(x_distill),
        phi(x_test),
        eps_c,
        delta_c,
        baseline,
        active,
    )


def release_client_heads(
    i: int,
    x_i: np.ndarray,
    y_i: np.ndarray,
    phi: FrozenFeatures,
    phi_neg: np.ndarray | None,
    cfg: DpHeadConfig,
    seed: int,
    *,
    num_classes: int,
    class_epsilon: float,
    class_delta: float,
) -> ClientHeads:
    """Client ``i``'s round: its class head (and, with ``phi_neg``, its scoring head) fitted on its
    records and released through the Gaussian mechanism. Every engine runs a client through this."""
    data = phi.head_data(x_i, labels=y_i)
    fit = fit_multinomial_head(data.X, y_i, num_classes, cfg.class_lambda)
    rel = release_head(
        fit,
        kind="multinomial",
        lam=cfg.class_lambda,
        epsilon=class_epsilon if cfg.class_dp else None,
        delta=class_delta,
        calibration=cfg.calibration,
        rng=noise_rng(seed, f"class-noise-{i}", reproducible=cfg.reproducible_noise),
        num_classes=num_classes,
        bound=cfg.sensitivity_bound,
        client=i,
        label="class-head",
        data=data,
    )
    score = None
    if phi_neg is not None:
        score = release_scoring_head(
            i,
            x_i,
            phi,
            phi_neg,
            lam=cfg.score_lambda,
            epsilon=cfg.score_epsilon,
            delta=cfg.score_delta,
            dp=cfg.score_dp,
            calibration=cfg.calibration,
            seed=seed,
            reproducible_noise=cfg.reproducible_noise,
        )
    return ClientHeads(i, rel, score, len(y_i))


def run_dp_heads(
    method: str,
    aggregation: Aggregation,
    federation,
    cfg: DpHeadConfig,
    seed: int,
    progress: bool = False,
) -> TrainResult:
    """The one-round DP-head pipeline behind ``fedauxfdp``, ``fedavg-dphead`` and ``fedd-dphead``."""
    setup = dp_heads_setup(method, aggregation, federation, cfg, seed, progress)
    releases = []
    with progress_bar(progress) as bar:
        task = bar.add_task(f"{method}: DP class heads", total=len(setup.active))
        for i in setup.active:
            x_i, y_i = federation.client_arrays(i)
            releases.append(
                release_client_heads(
                    i,
                    x_i,
                    y_i,
                    setup.phi,
                    setup.phi_neg,
                    cfg,
                    seed,
                    num_classes=federation.num_classes,
                    class_epsilon=setup.class_epsilon,
                    class_delta=setup.class_delta,
                )
            )
            bar.advance(task)
    return dp_heads_result(setup, federation, cfg, seed, releases)


def dp_heads_result(
    setup: DpHeadsSetup, federation, cfg: DpHeadConfig, seed: int, releases: list[ClientHeads]
) -> TrainResult:
    """The server's side after the round: the ledger, the labeller and the released model(s), from
    the clients' releases (in client order)."""
    from accountants import Ledger

    method, aggregation, phi, h0_state = setup.method, setup.aggregation, setup.phi, setup.h0_state
    device = resolve_device(cfg)
    bs = cfg.eval_batch_size
    ledger = Ledger()
    x_distill, _ = federation.public_arrays("distill")
    x_test, y_test = federation.test_arrays()
    phi_distill, phi_test = setup.phi_distill, setup.phi_test
    C, K = federation.num_classes, federation.num_clients
    baseline, active = setup.baseline, setup.active
    heads = np.zeros((K, C, phi_distill.shape[1]))
    class_info: list[dict] = []
    warns: set[str] = set()
    for r in releases:
        rel = r.class_release
        ledger.add(r.client, rel.event, "class-head", neighbouring="replace_one")
        heads[r.client] = rel.weights
        info = {k: v for k, v in rel.info.items() if k != "warnings"}
        warns.update(rel.info.get("warnings", []))
        # which classes a client holds is private: it is neither released nor used
        class_info.append(
            {"client": r.client, **info, "sensitivity": rel.sensitivity, "sigma": rel.sigma}
        )

    scores = None
    score_rel = None
    if not baseline:
        score_rel = _score_release(releases, K, phi_distill, len(setup.phi_neg), cfg.xi, ledger)  # type: ignore[arg-type]  # not baseline: set
        scores = score_rel.scores[active]
        warns.update(score_rel.warnings)

    rounds_entry: dict = {"round": 1}
    artifacts: dict[str, np.ndarray] = {"heads": heads.astype(np.float32)}
    if aggregation == "mean-head":
        model, spec = _released_model(
            federation, cfg, h0_state, phi.center, heads[active].mean(0), seed
        )
    else:
        if aggregation == "mean-ensemble" and getattr(cfg, "ensemble", "logits") == "logits":
            # FedD (FedAUX Eq. 2): softmax of the mean logit = the mean head's probabilities
            mean_head = heads[active].mean(0)
            labels = head_probabilities(mean_head, phi_distill).astype(np.float32)
            test_probs = head_probabilities(mean_head, phi_test)[None]
        else:
            probs = np.stack([head_probabilities(heads[i], phi_distill) for i in active])
            labels = _weighted_labels(probs, scores)
            test_probs = np.stack([head_probabilities(heads[i], phi_test) for i in active])
        artifacts["soft_labels"] = labels
        # the labeller itself on the test set (post-processing of released heads/scores): a diagnostic
        test_w = None
        if score_rel is not None:
            test_w = np.stack(
                [certainty_scores(score_rel.heads[i], phi_test, cfg.xi) for i in active]
            )
        rounds_entry["labeller_test_accuracy"] = float(
            (_weighted_labels(test_probs, test_w).argmax(1) == y_test).mean()
        )
        model, spec = _released_model(federation, cfg, h0_state, phi.center, None, seed)
        params = list(model.head.parameters()) if cfg.student_freeze else None
        rounds_entry["distill_kl"] = distill(
            model,
            x_distill,
            labels,
            epochs=cfg.student_epochs,
            batch_size=cfg.student_batch_size,
            lr=cfg.student_lr,
            device=device,
            seed=derive_seed(seed, "student"),
            params=params,
        )
    if score_rel is not None:
        artifacts["scores"] = score_rel.scores.astype(np.float32)
        artifacts["score_heads"] = score_rel.heads.astype(np.float32)
    rounds_entry["test_accuracy"] = accuracy(model, x_test, y_test, device, bs)

    client_models, client_specs, client_acc = [], [], []
    if cfg.keep_client_models:
        for i in active:
            m, s = _released_model(federation, cfg, h0_state, phi.center, heads[i], seed)
            client_models.append(m)
            client_specs.append(s)
            client_acc.append(accuracy(m, x_test, y_test, device, bs))
        artifacts["client_model_ids"] = np.asarray(active, dtype=np.int64)

    warnings = _warnings(federation, cfg, baseline, class_info, setup.pretrain_info) + sorted(warns)
    claims = _claims(
        method, cfg, baseline, setup.class_epsilon, setup.class_delta, class_info, score_rel
    )
    return TrainResult(
        method=method,
        seed=seed,
        config=cfg.model_dump(),
        model=model.cpu(),
        model_spec=spec,
        ledger=ledger,
        rounds=[rounds_entry],
        test_accuracy=rounds_entry["test_accuracy"],
        artifacts=artifacts,
        client_models=[m.cpu() for m in client_models],
        client_model_specs=client_specs,
        client_accuracy=client_acc,
        warnings=warnings,
        claims=claims,
    )


def _score_release(
    releases: list[ClientHeads], K: int, phi_distill: np.ndarray, n_negative: int, xi: float, ledger
) -> ScoreRelease:
    """The clients' scoring heads as FedAUX's :class:`ScoreRelease` (ledger entries ``scores``)."""
    heads = np.zeros((K, phi_distill.shape[1]))
    scores = np.full((K, len(phi_distill)), xi)
    info: list[dict] = [{"n": 0} for _ in range(K)]
    warns: set[str] = set()
    for r in releases:
        rel = r.score_release
        ledger.add(r.client, rel.event, "scores", neighbouring="replace_one")
        heads[r.client] = rel.weights
        scores[r.client] = certainty_scores(rel.weights, phi_distill, xi)
        warns.update(rel.info.get("warnings", []))
        info[r.client] = score_info(rel, r.n_private, n_negative)
    return ScoreRelease(heads, scores, info, sorted(warns))


def _warnings(
    federation, cfg: DpHeadConfig, baseline: bool, class_info: list[dict], pinfo: dict
) -> list[str]:
    out = [
        EQ4_NOTE,
        f"class heads cover all C={federation.num_classes} global classes; choosing C from a client's own "
        "labels (the paper's 'fewer classes, less noise') would depend on the private data, and so would "
        "reporting how many classes each client holds (privkit does neither)",
        f"h0 pretrained (SimCLR) on {pinfo.get('size')} public examples ({pinfo.get('data')} part), "
        f"{pinfo.get('epochs')} epochs: no privacy cost",
    ]
    if cfg.class_dp and class_info:
        paper = np.mean([c["sensitivity_paper"] for c in class_info])
        cfree = np.mean([c["sensitivity_cfree"] for c in class_info])
        out.append(
            f"class-head sensitivity bound used: {cfg.sensitivity_bound} (mean over clients: paper "
            f"2 sqrt(C)/(lam n) = {paper:.4g}, C-free 2 sqrt(2)/(lam n) = {cfree:.4g}; the C-free "
            f"bound needs {paper / cfree:.2f}x less noise for the same guarantee)"
        )
    if baseline:
        out.append(
            "baseline privatisation (the paper does not state it): each class head is released once "
            f"at the whole budget ({cfg.budget()[0]:g}, {cfg.budget()[1]:g}); no scores"
        )
    return out


def _claims(
    method: str,
    cfg: DpHeadConfig,
    baseline: bool,
    eps_c: float,
    delta_c: float,
    class_info: list[dict],
    score_rel,
) -> dict:
    eps, delta = cfg.budget()
    dp = cfg.class_dp and (baseline or cfg.score_dp)
    mech = {
        "class-head": {
            "epsilon": eps_c,
            "delta": delta_c,
            "lambda": cfg.class_lambda,
            "calibration": cfg.calibration,
            "sensitivity_bound": cfg.sensitivity_bound,
            "dp": cfg.class_dp,
            "clients": class_info,
        }
    }
    if score_rel is not None:
        mech["scores"] = {
            "epsilon": cfg.score_epsilon,
            "delta": cfg.score_delta,
            "lambda": cfg.score_lambda,
            "calibration": cfg.calibration,
            "dp": cfg.score_dp,
            "clients": score_rel.info,
        }
    return {
        "epsilon": eps if dp else float("inf"),
        "delta": delta if dp else None,
        "composition": "basic",
        "labels": ["class-head"] + ([] if baseline else ["scores"]),
        "scope": "server model and every client release (heads, scores)",
        "source": (
            "FedAUXfdp Table 2 (baseline privatisation assumed: one release at the total budget)"
            if baseline
            else "FedAUXfdp Sec. 4.3 (basic composition), Table 2"
        ),
        "mechanisms": mech,
    }


# method "fedauxfdp": config and registration in privkit.methods.fedauxfdp
def train_fedauxfdp(
    federation, config: FedAuxFdpConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedAUXfdp. See the module docstring."""
    return run_dp_heads("fedauxfdp", "scores", federation, config, seed, progress)


# method "fedavg-dphead": config and registration in privkit.methods.fedauxfdp
def train_fedavg_dphead(
    federation, config: DpHeadBaselineConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedAvg+P baseline of FedAUXfdp's Table 2."""
    return run_dp_heads("fedavg-dphead", "mean-head", federation, config, seed, progress)


# method "fedd-dphead": config and registration in privkit.methods.fedauxfdp
def train_fedd_dphead(
    federation, config: DpHeadBaselineConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedD+P baseline of FedAUXfdp's Table 2."""
    return run_dp_heads("fedd-dphead", "mean-ensemble", federation, config, seed, progress)


__all__ = [
    "ClientHeads",
    "DpHeadBaselineConfig",
    "DpHeadConfig",
    "DpHeadsSetup",
    "FedAuxFdpConfig",
    "dp_heads_result",
    "dp_heads_setup",
    "release_client_heads",
    "run_dp_heads",
    "train_fedauxfdp",
    "train_fedavg_dphead",
    "train_fedd_dphead",
]
