"""FedAUX (Sattler et al., seed 003): pretraining + DP certainty scores + weighted ensemble distillation.

Preparation (App. C, Alg. 1):

1. h0 <- SimCLR on the auxiliary data at the server (:mod:`privkit.trainers.pretrain`).
2. The auxiliary data is split into disjoint ``D^-`` (20 %) and ``D_distill`` (80 %) parts (the
   federation's ``negative`` / ``distill``; disjoint, unlike the official code's two permutations).
3. Client i fits the exact L2-regularised binary logistic head separating ``phi(h0(D_i))`` (t=+1)
   from ``phi(h0(D^-))`` (t=-1), ``n = |D_i| + |D^-|`` (:func:`~privkit.trainers.heads.fit_binary_head`),
   and releases it through the Gaussian mechanism with sensitivity ``2/(lam n)`` (Thm 1) and noise
   from that same n (not ``|D_i| + |D_aux|`` as the main text's Eq. 10 prints).
4. Certainty scores ``s_i(x) = sigmoid(<w_i, phi(h0(x))>) + xi`` on ``D_distill`` (Eq. 6):
   post-processing of the DP head.

Training (Alg. 2): FedAvg rounds from h0, then per round the server distils
``softmax(sum_i s_i(x) f_i(x) / sum_i s_i(x))`` (Eq. 3, certainty-weighted logits) into the averaged
model (Adam 5e-5, batch 128, ``distill_epochs`` epochs).

Privacy: only the scoring heads are DP. The client models f_i are released unprotected, as in the
paper, so each participating client gets a ``NonPrivateEvent`` (label ``model-update``) per round
and the accountant reports epsilon = inf for the pipeline; the scoring part alone is
``ledger.epsilon(delta, labels=["scores"])``. ``phi`` is the per-example map
:func:`~privkit.trainers.heads.head_features` instead of the paper's Eq. 4 (division by the maximum
norm over ``D_i u D^-``, which depends on the private data and is sent to the server).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from privkit.methods.contract import TrainResult
from privkit.methods.fedaux import FedAUXConfig
from privkit.seeding import noise_rng
from privkit.trainers.common import embed, resolve_device
from privkit.trainers.fedavg import FederatedRun, drive, result_from_outcome
from privkit.trainers.feddf import distillation_hook
from privkit.trainers.heads import (
    HeadData,
    certainty_scores,
    fit_binary_head,
    head_features,
    release_head,
)
from privkit.trainers.pretrain import init_model

EQ4_NOTE = (
    "features enter the logistic heads through the per-example map [v/||v||, 1]/sqrt(2), "
    "v = h0(x) - (mean of h0 over the public data) "
    "(unit ball, bias inside the norm bound); the paper's Eq. 4 divides by max ||h0(x)|| over "
    "the client's private data, a data-dependent scale outside the sensitivity proof (and "
    "sent to the server), so privkit does not use it"
)


@dataclass
class ScoreRelease:
    """Per-client DP scoring heads and the certainty scores they give on the distillation data."""

    heads: np.ndarray  # (clients, d) noisy heads (zeros for an empty client)
    scores: np.ndarray  # (clients, n_distill)
    info: list[dict] = field(default_factory=list)  # per client: n, sensitivity, sigma, ...
    warnings: list[str] = field(default_factory=list)


class FrozenFeatures:
    """``phi(h0(x))``: the frozen extractor's features, centred on their public mean, in the unit ball.

    The centre is the mean of h0 over the public auxiliary data (``center=True``), so the map is
    fixed before any private record is seen.
    """

    def __init__(
        self,
        h0_model,
        federation,
        device: torch.device,
        batch_size: int = 1024,
        center: bool = True,
    ):
        self.model, self.device, self.batch_size = h0_model, device, batch_size
        self.center = (
            embed(h0_model, federation.public_arrays("all")[0], device, batch_size)
            .astype(np.float64)
            .mean(0)
            if center
            else None
        )

    @classmethod
    def with_center(
        cls, h0_model, center: np.ndarray | None, device: torch.device, batch_size: int = 1024
    ) -> FrozenFeatures:
        """The map with a centre computed elsewhere (the server's, sent to a client)."""
        out = cls.__new__(cls)
        out.model, out.device, out.batch_size, out.center = h0_model, device, batch_size, center
        return out

    def embed(self, x: np.ndarray) -> np.ndarray:
        """Raw features ``h0(x)`` (before the map)."""
        return embed(self.model, x, self.device, self.batch_size)

    def map(self, h: np.ndarray) -> np.ndarray:
        """``phi`` of raw features ``h``: :func:`~privkit.trainers.heads.head_features` with the centre."""
        return head_features(h, self.center)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.map(self.embed(x))

    def head_data(
        self, x: np.ndarray, labels: np.ndarray | None = None, negatives: np.ndarray | None = None
    ) -> HeadData:
        """The private records ``x`` as a head is fitted on them (mapped features in ``.X``), kept
        with their raw features so that an audit can refit the head with probe records."""
        h = self.embed(x)
        return HeadData(self.map(h), h, self.center, labels, negatives)


def release_scoring_heads(
    federation,
    phi: FrozenFeatures,
    *,
    lam: float,
    epsilon: float,
    delta: float,
    dp: bool,
    calibration: str,
    xi: float,
    seed: int,
    ledger,
    phi_neg: np.ndarray | None = None,
    phi_distill: np.ndarray | None = None,
    reproducible_noise: bool = False,
) -> ScoreRelease:
    """Fit, privatise and record every client's scoring head; return heads and scores.

    Each client's ledger gets ``GaussianDpEvent(sigma / (2/(lam n)))`` labelled ``scores``
    (replace-one neighbours, ``n = |D_i| + |D^-|``), or a ``NonPrivateEvent`` when ``dp`` is off.
    """
    if phi_neg is None:
        phi_neg = phi(federation.public_arrays("negative")[0])
    if phi_distill is None:
        phi_distill = phi(federation.public_arrays("distill")[0])
    K, d = federation.num_clients, phi_neg.shape[1]
    heads = np.zeros((K, d))
    scores = np.full((K, len(phi_distill)), xi)
    info: list[dict] = []
    warns: set[str] = set()
    for i in range(K):
        x_i, _ = federation.client_arrays(i)
        if len(x_i) == 0:
            info.append({"n": 0})
            continue
        rel = release_scoring_head(
            i,
            x_i,
            phi,
            phi_neg,
            lam=lam,
            epsilon=epsilon,
            delta=delta,
            dp=dp,
            calibration=calibration,
            seed=seed,
            reproducible_noise=reproducible_noise,
        )
        ledger.add(i, rel.event, "scores", neighbouring="replace_one")
        heads[i] = rel.weights
        scores[i] = certainty_scores(rel.weights, phi_distill, xi)
        warns.update(rel.info.pop("warnings", []))
        info.append(score_info(rel, len(x_i), len(phi_neg)))
    return ScoreRelease(heads, scores, info, sorted(warns))


def release_scoring_head(
    i: int,
    x_i: np.ndarray,
    phi: FrozenFeatures,
    phi_neg: np.ndarray,
    *,
    lam: float,
    epsilon: float,
    delta: float,
    dp: bool,
    calibration: str,
    seed: int,
    reproducible_noise: bool,
):
    """Client ``i``'s scoring head on its records ``x_i`` against the public negatives, released
    through the Gaussian mechanism (a :class:`~privkit.trainers.heads.HeadRelease`, whose ``clean``
    head never leaves the client). Every engine runs a client's release through this function."""
    data = phi.head_data(x_i, negatives=phi_neg)
    fit = fit_binary_head(data.X, phi_neg, lam)
    return release_head(
        fit,
        kind="binary",
        lam=lam,
        epsilon=epsilon if dp else None,
        delta=delta,
        calibration=calibration,  # type: ignore[arg-type]  # the config's literal
        rng=noise_rng(seed, f"score-noise-{i}", reproducible=reproducible_noise),
        client=i,
        label="scores",
        data=data,
    )


def score_info(rel, n_private: int, n_negative: int) -> dict:
    """What a scoring head's release reports about itself (no private value; its warnings apart)."""
    return {
        **{k: v for k, v in rel.info.items() if k != "warnings"},
        "sensitivity": rel.sensitivity,
        "sigma": rel.sigma,
        "n_private": n_private,
        "n_negative": n_negative,
    }


def eq10_warning(federation, lam: float, epsilon: float, delta: float, calibration: str) -> str:
    """How much smaller Eq. 10's sigma (|D_i| + |D_aux|) is than Thm 1's (|D_i| + |D^-|), worst client."""
    from accountants import calibrate_gaussian, gaussian_epsilon

    sizes = [len(c) for c in federation.clients if len(c)]
    n_neg, n_aux = len(federation.negative), len(federation.negative) + len(federation.distill)
    n_i = min(sizes)  # the ratio (n_i + n_neg)/(n_i + n_aux) is smallest for the smallest client
    sens = 2.0 / (lam * (n_i + n_neg))
    sigma_thm = calibrate_gaussian(epsilon, delta, sens, method=calibration).sigma
    sigma_eq10 = calibrate_gaussian(
        epsilon, delta, 2.0 / (lam * (n_i + n_aux)), method=calibration
    ).sigma
    true_eps = gaussian_epsilon(sigma_eq10, delta, sens, method="analytic")
    return (
        f"FedAUX Eq. 10 calibrates sigma with |D_i|+|D_aux| ({n_i}+{n_aux}) but Thm 1 / Alg. 1 bound "
        f"the sensitivity with |D_i|+|D^-| ({n_i}+{n_neg}); privkit uses |D_i|+|D^-|. Eq. 10's "
        f"sigma would be {sigma_thm / sigma_eq10:.2f}x too small for the smallest client, giving "
        f"epsilon={true_eps:.3g} (analytic, at delta={delta:g}) instead of the claimed {epsilon:g}"
    )


def fedaux_run(
    federation,
    config: FedAUXConfig,
    seed: int,
    progress: bool = False,
    teachers: Callable | None = None,
):
    """FedAUX's run (after the scores' release; the score-weighted distillation as its server hook)
    and what turns its outcome into the result (``teachers``:
    :func:`~privkit.trainers.feddf.distillation_hook`)."""
    from accountants import Ledger

    device = resolve_device(config)
    ledger = Ledger()
    model, spec, pinfo = init_model(federation, config, seed, progress=progress)
    if config.pretrain:
        h0_model = model
    else:  # scores need h0 even when the classifier starts from scratch
        h0_model, _, pinfo = init_model(
            federation, config.model_copy(update={"pretrain": True}), seed, progress=progress
        )
    phi = FrozenFeatures(
        h0_model, federation, device, config.eval_batch_size, config.center_features
    )
    release = release_scoring_heads(
        federation,
        phi,
        lam=config.score_lambda,
        epsilon=config.score_epsilon,
        delta=config.score_delta,
        dp=config.score_dp,
        calibration=config.calibration,
        xi=config.xi,
        seed=seed,
        ledger=ledger,
        reproducible_noise=config.reproducible_noise,
    )
    store: dict = {}
    hook = distillation_hook(
        federation, config, seed, scores=release.scores, store=store, teachers=teachers
    )
    run = FederatedRun(
        federation,
        config,
        seed,
        progress=progress,
        server_hook=hook,
        ledger=ledger,
        model=model,
        spec=spec,
        pretrain_info=pinfo,
        neighbouring="replace_one",
    )

    def finish(out) -> TrainResult:
        warnings = [
            EQ4_NOTE,
            "client models f_i are sent to the server in the clear (as in the paper): the pipeline "
            "has no finite epsilon; the DP claim covers the certainty scores only (ledger label "
            "'scores')",
            *release.warnings,
        ]
        if config.score_dp:
            warnings.insert(
                0,
                eq10_warning(
                    federation,
                    config.score_lambda,
                    config.score_epsilon,
                    config.score_delta,
                    config.calibration,
                ),
            )
        claims = {
            "epsilon": config.score_epsilon if config.score_dp else float("inf"),
            "delta": config.score_delta if config.score_dp else None,
            "composition": "basic",
            "labels": ["scores"],
            "scope": "certainty scores only; client models f_i are not protected",
            "pipeline_epsilon": float("inf"),
            "source": "FedAUX Sec. 3.5 (Thm 1, Eq. 10) and App. J",
            "mechanisms": {
                "scores": {
                    "epsilon": config.score_epsilon,
                    "delta": config.score_delta,
                    "lambda": config.score_lambda,
                    "calibration": config.calibration,
                    "dp": config.score_dp,
                    "clients": release.info,
                }
            },
        }
        artifacts = {
            "scores": release.scores.astype(np.float32),
            "score_heads": release.heads.astype(np.float32),
        }
        if "soft_labels" in store:
            artifacts["soft_labels"] = store["soft_labels"]
        return result_from_outcome(
            "fedaux",
            seed,
            config,
            out,
            artifacts=artifacts,
            warnings=warnings,
            claims=claims,
            federation=federation,
        )

    return run, finish


# method "fedaux": config and registration in privkit.methods.fedaux
def train_fedaux(
    federation, config: FedAUXConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedAUX (``pretrain=false`` drops h0 for the client models; scores always use h0)."""
    run, finish = fedaux_run(federation, config, seed, progress)
    return finish(drive(run, progress, "fedaux rounds"))


__all__ = [
    "FedAUXConfig",
    "FrozenFeatures",
    "ScoreRelease",
    "eq10_warning",
    "fedaux_run",
    "release_scoring_head",
    "release_scoring_heads",
    "score_info",
    "train_fedaux",
]
