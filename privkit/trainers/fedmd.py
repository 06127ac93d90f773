"""FedMD-NFDP (Sun & Lyu, IJCAI'21; seed 001) and its baselines FedMD-NP and FedMD-LDP.

Federated model distillation between parties with heterogeneous models (Algorithm 1):

1. every party starts from a model pretrained on the labelled public data (one pretraining run
   per distinct architecture: "the same pretrained model" of Algorithm 1, line 2);
2. FedMD-NFDP: each party draws ONE random subset of ``k`` of its ``n`` private records (with or
   without replacement) and keeps it for the whole run; FedMD-NP and FedMD-LDP use all records;
3. initialisation: ``T1`` epochs on the private (sub)set;
4. ``R`` rounds: the server samples a public subset X_p; every party shares its knowledge on X_p
   (logits, softmax or argmax votes, Table 3); the server averages it; every party digests
   (``T2`` epochs towards the average on X_p) and revisits (``T3`` epochs on its private
   (sub)set).  Sharing happens at the start of each round on that round's X_p (the order of
   the original FedMD code), so there are exactly ``R`` releases per party.

Privacy (record level, per party):

* FedMD-NFDP: everything a party releases is a post-processing of its k-subset (and public
  data), so the ledger holds one :class:`accountants.NfdpSubsampleEvent` per party and nothing
  per round.  Theorems 1-2 use the natural logarithm; the paper's Table 2 prints
  ``k log10((n+1)/n)``, so its epsilons are ``ln 10 = 2.303x`` too small (methods.md section 4).
  The theorems' delta is ``>= 1/n`` for every k >= 1, which permits publishing records in the
  clear (the subset release does exactly that): privkit warns.
* FedMD-NP: no guarantee (:class:`accountants.NonPrivateEvent`).
* FedMD-LDP: each party adds Gaussian noise to every shared prediction vector.  Sensitivity: a
  softmax or one-hot vector lies in the probability simplex, whose L2 diameter is ``sqrt(2)``;
  a clipped logit vector (L2 norm <= c) lies in a ball of diameter ``2c``.  The model is an
  arbitrary function of the private data, so changing one record (adding/removing it or
  replacing it: the bound is the output space's diameter, valid under either relation) may move
  every prediction by up to that diameter.  The R x |X_p| vector releases are composed (a
  composition of Gaussians with equal noise multiplier is one Gaussian with multiplier
  ``z / sqrt(R |X_p|)``), and the noise is calibrated with the analytic Gaussian mechanism so the
  total matches NFDP's theorem (epsilon, delta) at the same k.  The party's own model is trained
  on all its data without noise; privkit releases it (it is the model the audits attack), so the
  ledger also records it as a non-private release.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from privkit.errors import PrivkitError
from privkit.methods.contract import TrainResult
from privkit.methods.fedmd import (  # noqa: F401  (re-exported)
    PAPER,
    FedMDConfig,
    FedMDLdpConfig,
    FedMDNfdpConfig,
    FedMDNpConfig,
    PartyModel,
)
from privkit.models import FeatureClassifier, build_from_spec, model_spec
from privkit.seeding import derive_seed, make_rng, noise_rng, seed_torch, torch_generator

if TYPE_CHECKING:  # pragma: no cover
    from privkit.data import Federation
from privkit.mechanisms.gaussian import compose_receipts
from privkit.mechanisms.output_perturbation import gaussian_output_perturbation
from privkit.trainers.common import (
    accuracy,
    as_tensor,
    distill,
    make_optimizer,
    minibatches,
    predict_logits,
    resolve_device,
    train_supervised,
)

LN10 = math.log(10.0)
KNOWLEDGE_MODES = ("logits", "softmax", "argmax")
NP_REASON = (
    "FedMD-NP: parties share predictions of models trained on all their private data, "
    "without noise; no privacy guarantee"
)
LDP_MODEL_REASON = (
    "FedMD-LDP: the party's own model is trained on all its private data without "
    "noise; only its shared predictions are noised. privkit releases the model for "
    "evaluation and audits, so this release has no guarantee"
)


# ----------------------------------------------------------------------------- party models
def party_model_specs(config: FedMDConfig, num_parties: int) -> list[PartyModel]:
    """The architecture of each party (cyclic over ``party_models`` or the derived cycle)."""
    if config.party_models:
        cycle = list(config.party_models)
    else:
        base = PartyModel(arch=config.arch, width=config.width, feature_dim=config.feature_dim)
        cycle = [base]
        if config.heterogeneous:
            cycle.append(
                PartyModel(
                    arch=config.arch,
                    width=max(1, config.width // 2),
                    feature_dim=max(2, config.feature_dim // 2),
                )
            )
            cycle.append(
                PartyModel(
                    arch=config.arch,
                    width=config.width + config.width // 2,
                    feature_dim=config.feature_dim + config.feature_dim // 2,
                    depth=2 if config.arch == "mlp" else 1,
                )
            )
    if not config.heterogeneous:
        cycle = cycle[:1]
    return [cycle[i % len(cycle)] for i in range(num_parties)]


def _spec_dict(p: PartyModel, input_shape, num_classes: int) -> dict:
    return model_spec(
        p.arch, input_shape, num_classes, width=p.width, feature_dim=p.feature_dim, depth=p.depth
    )


def label_split(federation, config: FedMDConfig) -> tuple[list[int], list[int]]:
    """(public classes, private classes) the run uses; both all classes when ``labels="shared"``."""
    C = federation.num_classes
    if config.labels == "shared":
        if config.public_classes is not None or config.private_classes is not None:
            raise PrivkitError(
                "public_classes/private_classes need labels='disjoint'; found "
                f"labels='shared' with public_classes={config.public_classes}, "
                f"private_classes={config.private_classes}"
            )
        return list(range(C)), list(range(C))
    pub = (
        sorted(config.public_classes) if config.public_classes is not None else list(range(C // 2))
    )
    priv = (
        sorted(config.private_classes)
        if config.private_classes is not None
        else [c for c in range(C) if c not in pub]
    )
    for name, cls in (("public_classes", pub), ("private_classes", priv)):
        if not cls or max(cls) >= C or len(set(cls)) != len(cls):
            raise PrivkitError(f"{name} must be distinct classes in [0, {C}); found {cls}")
    if set(pub) & set(priv):
        raise PrivkitError(
            "public_classes and private_classes must be disjoint with labels='disjoint'; "
            f"found both holding {sorted(set(pub) & set(priv))}"
        )
    return pub, priv


def restrict(
    x: np.ndarray, y: np.ndarray, classes: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The records whose label is in ``classes``: (x, y, positions kept)."""
    keep = np.flatnonzero(np.isin(y, classes))
    return x[keep], y[keep], keep


def pretrain_parties(
    federation,
    config: FedMDConfig,
    seed: int,
    device: torch.device,
    public: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[FeatureClassifier], list[dict]]:
    """One model per distinct architecture, pretrained on the labelled public data, copied to parties.

    Algorithm 1 initialises every party "with the same pretrained model"; parties sharing an
    architecture share that model's weights. ``public`` (x, y): the labelled public records to
    pretrain on (default: all of the federation's public data).
    """
    specs, jobs = pretraining(federation, config, seed, public)
    for job in jobs.values():
        if job.epochs > 0:
            train_supervised(
                job.model,
                job.x,
                job.targets,
                epochs=job.epochs,
                batch_size=job.batch_size,
                lr=config.lr,
                device=device,
                seed=job.seed,
            )
    return party_models(specs, jobs, device), specs


def pretraining(
    federation,
    config: FedMDConfig,
    seed: int,
    public: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[list[dict], dict[str, PartyJob]]:
    """What :func:`pretrain_parties` trains: every party's spec, and per distinct architecture (in
    the parties' order) its freshly initialised model in a job that pretrains it (supervised Adam
    epochs on the public records: the jobs the batched path trains for many runs at once)."""
    specs = [
        _spec_dict(p, federation.input_shape, federation.num_classes)
        for p in party_model_specs(config, federation.num_clients)
    ]
    xpub, ypub = public if public is not None else federation.public_arrays("all")
    if config.pretrain_epochs > 0 and len(ypub) and ypub.max() >= federation.num_classes:
        raise PrivkitError(
            f"public labels go up to {int(ypub.max())} but the private task has "
            f"{federation.num_classes} classes; set pretrain_epochs=0 to skip "
            "pretraining on labelled public data"
        )
    jobs: dict[str, PartyJob] = {}
    for spec in specs:
        key = repr(sorted(spec.items()))
        if key in jobs:
            continue
        # initialisation draws from torch's global generator (seeded here); training does not
        seed_torch(derive_seed(seed, f"fedmd-init-{len(jobs)}"))
        jobs[key] = PartyJob(
            build_from_spec(spec),
            xpub,
            ypub,
            False,
            config.pretrain_epochs,
            config.pretrain_batch_size,
            derive_seed(seed, f"fedmd-pretrain-{len(jobs)}"),
        )
    return specs, jobs


def party_models(
    specs: list[dict], jobs: dict[str, PartyJob], device: torch.device
) -> list[FeatureClassifier]:
    """Every party's model: a copy of its architecture's model in ``jobs`` (pretrained by then)."""
    pretrained = {
        key: {k: v.detach().clone() for k, v in job.model.state_dict().items()}
        for key, job in jobs.items()
    }
    models = []
    for spec in specs:
        m = build_from_spec(spec)
        m.load_state_dict(pretrained[repr(sorted(spec.items()))])
        models.append(m.to(device))
    return models


# ----------------------------------------------------------------------------- private subsets
def draw_subset(n: int, k: int, replacement: bool, rng: np.random.Generator) -> np.ndarray:
    """Positions (into the party's n records) of its NFDP subset of size k, drawn once.

    With replacement: k i.i.d. uniform draws (Theorem 2); without: a uniform k-subset (Theorem 1).
    """
    if n < 1:
        raise PrivkitError(f"a party needs at least one private record to subsample; found n={n}")
    if not replacement and k > n:
        raise PrivkitError(f"k must be <= n for sampling without replacement; found k={k}, n={n}")
    return rng.choice(n, size=k, replace=replacement).astype(np.int64)


# ----------------------------------------------------------------------------- knowledge
def share_knowledge(logits: np.ndarray, mode: str) -> np.ndarray:
    """What a party uploads for each public record: logits, softmax probabilities or a one-hot vote."""
    if mode == "logits":
        return logits.astype(np.float32)
    if mode == "softmax":
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z)
        return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)
    if mode == "argmax":
        votes = np.zeros_like(logits, dtype=np.float32)
        votes[np.arange(len(logits)), logits.argmax(axis=1)] = 1.0
        return votes
    raise PrivkitError(f"knowledge must be one of {', '.join(KNOWLEDGE_MODES)}; found {mode!r}")


def aggregate_knowledge(shares: list[np.ndarray]) -> np.ndarray:
    """f_Agg of Algorithm 1: the unweighted mean over parties, per public record."""
    if not shares:
        raise PrivkitError("aggregate_knowledge needs at least one party's share; found 0")
    return np.mean(np.stack(shares), axis=0).astype(np.float32)


def project_to_simplex_rows(p: np.ndarray) -> np.ndarray:
    """Post-processing of noisy probability rows into distributions (clip at 0, renormalise).

    A row that is all non-positive becomes uniform.
    """
    q = np.clip(p, 0.0, None)
    s = q.sum(axis=1, keepdims=True)
    uniform = np.full_like(q, 1.0 / q.shape[1])
    return np.where(s > 0, q / np.where(s > 0, s, 1.0), uniform).astype(np.float32)


def clip_rows(v: np.ndarray, c: float) -> np.ndarray:
    """Scale each row to L2 norm at most ``c``."""
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return (v * np.minimum(1.0, c / np.maximum(norms, 1e-12))).astype(np.float32)


def knowledge_sensitivity(mode: str, logit_clip: float) -> float:
    """L2 sensitivity of one shared vector: the diameter of its output set."""
    return 2.0 * logit_clip if mode == "logits" else math.sqrt(2.0)


# ----------------------------------------------------------------------------- digest / revisit
def regress_logits(
    model: torch.nn.Module,
    x: np.ndarray,
    targets: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    device: torch.device,
    seed: int,
) -> float:
    """Digest with logit targets: mean absolute error to the averaged logits (original FedMD code)."""
    if len(x) == 0 or epochs == 0:
        return float("nan")
    model.to(device).train()
    opt = make_optimizer(model.parameters(), "adam", lr)
    xt, tt = as_tensor(x, device, torch.float32), as_tensor(targets, device, torch.float32)
    gen = torch_generator(seed)
    last = float("nan")
    for _ in range(epochs):
        total = 0.0
        for idx in minibatches(len(xt), batch_size, gen):
            idx = idx.to(device)
            loss = F.l1_loss(model(xt[idx]), tt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        last = total / len(xt)
    return last


def digest(
    model: torch.nn.Module,
    x_pub: np.ndarray,
    consensus: np.ndarray,
    mode: str,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    device: torch.device,
    seed: int,
) -> float:
    """Digest (Algorithm 1, line 14): train towards the aggregated knowledge on the public subset."""
    if epochs == 0:
        return float("nan")
    if mode == "logits":
        return regress_logits(
            model,
            x_pub,
            consensus,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            device=device,
            seed=seed,
        )
    return distill(
        model,
        x_pub,
        consensus,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        device=device,
        seed=seed,
    )


def revisit(
    model: torch.nn.Module,
    x_priv: np.ndarray,
    y_priv: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    device: torch.device,
    seed: int,
) -> float:
    """Revisit (line 17) and initialisation (line 4): supervised epochs on the party's own records."""
    if epochs == 0:
        return float("nan")
    return train_supervised(
        model, x_priv, y_priv, epochs=epochs, batch_size=batch_size, lr=lr, device=device, seed=seed
    )


# ----------------------------------------------------------------------------- the loop
@functools.lru_cache(maxsize=4096)
def analytic_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The analytic Gaussian mechanism's std for ``(epsilon, delta)`` at ``sensitivity``
    (:func:`accountants.calibrate_gaussian`), remembered: a pure function of its arguments (a
    bisection), which an audit's FedMD-LDP runs ask once per party (17 runs x 20 parties, 0.7 s of
    a 25 s audit), mostly for the same few party sizes."""
    from accountants import calibrate_gaussian

    return calibrate_gaussian(epsilon, delta, sensitivity=sensitivity, method="analytic").sigma


def _ldp_plan(federation, config: FedMDLdpConfig, m_pub: int, sizes: list[int]) -> dict:
    """Per-party Gaussian noise std for the shared vectors, calibrated to the target (epsilon, delta)."""
    from accountants import nfdp_epsilon_delta

    sens = knowledge_sensitivity(config.knowledge, config.logit_clip)
    queries = config.rounds * m_pub
    plan: dict[str, Any] = {"sensitivity": sens, "queries": queries, "sigma": [], "target": []}
    if queries == 0:
        return plan
    for i, n in enumerate(sizes):
        if config.epsilon is not None and config.delta is not None:
            eps, delta = config.epsilon, config.delta
        else:
            if n == 0:
                raise PrivkitError(
                    f"party {i} holds no records of the private classes, so NFDP's (epsilon, delta) "
                    "at its n is undefined; found n=0 (set epsilon and delta explicitly)"
                )
            if not config.match_replacement and config.match_k > n:
                raise PrivkitError(
                    f"match_k must be <= n for sampling without replacement; found "
                    f"match_k={config.match_k}, n={n} (party {i})"
                )
            eps, delta = nfdp_epsilon_delta(n, config.match_k, config.match_replacement)
            if config.epsilon is not None:
                eps = config.epsilon
            if config.delta is not None:
                delta = config.delta
        if not 0 < delta < 1:
            raise PrivkitError(
                f"delta must be in (0, 1) to calibrate FedMD-LDP; found {delta} for "
                f"party {i} (set delta explicitly)"
            )
        # R*|X_p| Gaussian releases of sensitivity s with std sigma compose into one Gaussian of
        # sensitivity s*sqrt(queries) with std sigma: calibrate that one exactly (analytic).
        plan["sigma"].append(analytic_sigma(float(eps), float(delta), sens * math.sqrt(queries)))
        plan["target"].append((float(eps), float(delta)))
    return plan


#: ``(party models, records) -> each party's logits`` (float32 arrays, in the models' order)
PartyLogits = Callable[[Sequence[torch.nn.Module], np.ndarray], list[np.ndarray]]


def _evaluate(models, xt, yt, device, batch_size) -> list[float]:
    return [accuracy(m, xt, yt, device, batch_size) for m in models]


@dataclass
class PartyJob:
    """One party's training call of a phase: a revisit (its private records and labels, the
    initialisation included) or a digest (the public subset and the consensus)."""

    model: torch.nn.Module
    x: np.ndarray
    targets: np.ndarray
    digest: bool
    epochs: int
    batch_size: int
    seed: int

    def run(self, config: FedMDConfig, device: torch.device) -> None:
        """Train the party's model as the single run does (:func:`digest` / :func:`revisit`)."""
        if self.digest:
            digest(
                self.model,
                self.x,
                self.targets,
                config.knowledge,
                epochs=self.epochs,
                batch_size=self.batch_size,
                lr=config.lr,
                device=device,
                seed=self.seed,
            )
        else:
            revisit(
                self.model,
                self.x,
                self.targets,
                epochs=self.epochs,
                batch_size=self.batch_size,
                lr=config.lr,
                device=device,
                seed=self.seed,
            )


class FedMDRun:
    """One FedMD run held between its phases, so that many runs' parties can train together.

    :meth:`init_jobs` are the initialisation's revisits; each round, :meth:`next_round` shares the
    parties' knowledge on the round's public subset and returns the digests, then
    :meth:`revisit_jobs` the revisits; :meth:`record` evaluates after each phase pair. The jobs of
    a phase are independent (each its own party's model), so the single run runs them in turn and
    the batched path (:mod:`privkit.batched.many_fedmd`) all at once.
    """

    def __init__(
        self,
        federation: Federation,
        config: Any,  # a FedMDConfig; FedMDNfdpConfig or FedMDLdpConfig by variant
        seed: int,
        variant: str,
        pretrain: bool = True,
    ):
        import dp_accounting as dpa

        from accountants import Ledger, NfdpSubsampleEvent, NonPrivateEvent

        self.federation, self.config, self.seed, self.variant = federation, config, seed, variant
        n_parties = federation.num_clients
        if config.released_party >= n_parties:
            raise PrivkitError(
                f"released_party must be < {n_parties} (the number of parties); found "
                f"{config.released_party}"
            )
        self.device = device = resolve_device(config)
        pub_classes, priv_classes = label_split(federation, config)
        self.xpub, ypub, _ = restrict(*federation.public_arrays("all"), pub_classes)
        self.pretraining: dict[str, PartyJob] = {}
        if pretrain:
            self.models, self.specs = pretrain_parties(
                federation, config, seed, device, public=(self.xpub, ypub)
            )
        else:  # the batched path pretrains many runs' models at once (pretrain_jobs, then start)
            self.models = []
            self.specs, self.pretraining = pretraining(
                federation, config, seed, public=(self.xpub, ypub)
            )
        self.xt, self.yt, _ = restrict(*federation.test_arrays(), priv_classes)
        self.m_pub = m_pub = min(config.public_subset, len(self.xpub))
        self.ledger = ledger = Ledger()
        self.warnings: list[str] = []
        self.claims: dict = {}
        self.artifacts: dict[str, np.ndarray] = {}
        warnings = self.warnings
        if config.labels == "disjoint":
            warnings.append(
                f"disjoint label spaces (as the paper): public data and pretraining use classes "
                f"{pub_classes} only ({len(self.xpub)} public records), parties train on their records of "
                f"classes {priv_classes} only, and test accuracy is over the test records of those "
                f"classes ({len(self.yt)}); a party's records of other classes are never used"
            )

        # Private (sub)sets, fixed for the whole run. n is the party's number of private-class
        # records: the label filter keeps or drops each record on its own label, so adding or
        # removing one record changes the filtered set by at most that record.
        self.private: list[tuple[np.ndarray, np.ndarray]] = []
        sizes: list[int] = []
        for i, idx in enumerate(federation.clients):
            x, y, keep = restrict(*federation.client_arrays(i), priv_classes)
            idx = idx[keep]
            sizes.append(len(idx))
            if variant == "nfdp" and len(idx):
                if not config.replacement and config.k > len(idx):
                    raise PrivkitError(
                        f"k must be <= n for sampling without replacement; found k={config.k}, "
                        f"n={len(idx)} (party {i}); use replacement=true or a smaller k"
                    )
                # The subsample is NFDP's only randomness: secret in release mode (AES-CTR keyed from OS entropy) and
                # stored only in reproducible mode, where the run is not for release anyway.
                pos = draw_subset(
                    len(idx),
                    config.k,
                    config.replacement,
                    noise_rng(seed, f"fedmd-subset-{i}", reproducible=config.reproducible_noise),
                )
                if config.reproducible_noise:
                    self.artifacts[f"subset_indices/client_{i}"] = idx[pos]
                x, y = x[pos], y[pos]
            self.private.append((x, y))

        _record_privacy(
            variant,
            federation,
            config,
            ledger,
            warnings,
            self.claims,
            sizes,
            NfdpSubsampleEvent,
            NonPrivateEvent,
        )
        self.plan = plan = _ldp_plan(federation, config, m_pub, sizes) if variant == "ldp" else None
        if plan is not None:
            _record_ldp(
                federation, config, plan, ledger, warnings, self.claims, dpa, NonPrivateEvent, sizes
            )
        if m_pub < config.public_subset:
            warnings.append(
                f"public_subset={config.public_subset} capped at the public data size {m_pub}"
            )
        self.pub_rng = make_rng(seed, "fedmd-public")
        self.rounds: list[dict] = []
        self.t = 0

    def pretrain_jobs(self) -> list[PartyJob]:
        """The pretraining of a run made with ``pretrain=False``: one job per distinct
        architecture, to run (as :func:`pretrain_parties` trains them) before :meth:`start`."""
        return list(self.pretraining.values())

    def start(self) -> None:
        """Every party's model from its architecture's pretrained model (``pretrain=False``)."""
        self.models = party_models(self.specs, self.pretraining, self.device)
        self.pretraining = {}

    def init_jobs(self) -> list[PartyJob]:
        """Initialisation phase (no collaboration): T1 epochs on the private (sub)set."""
        cfg = self.config
        return [
            PartyJob(
                m,
                *self.private[i],
                False,
                cfg.init_epochs,
                cfg.revisit_batch_size,
                derive_seed(self.seed, f"fedmd-init-train-{i}"),
            )
            for i, m in enumerate(self.models)
        ]

    def record(self, accs: list[float] | None = None) -> None:
        """Evaluate every party after the current round (round 0: after the initialisation);
        ``accs``: the parties' test accuracies computed by the caller (the batched engine's
        stacked evaluation of an audit's reference runs)."""
        if accs is None:
            accs = _evaluate(
                self.models, self.xt, self.yt, self.device, self.config.eval_batch_size
            )
        self.rounds.append(_round_record(self.t, accs, self.config))

    def next_round(self, party_logits: PartyLogits | None = None) -> list[PartyJob] | None:
        """Start the next round: the parties share their knowledge on its public subset, the server
        averages it; returns the digests (``None`` after the last round). ``party_logits(models,
        x)`` gives every party's logits on the subset (default: each model's own forward pass;
        the batched engine passes a stacked one for an audit's reference runs)."""
        cfg, plan, t = self.config, self.plan, self.t + 1
        if t > cfg.rounds:
            return None
        self.t = t
        sel = np.sort(self.pub_rng.choice(len(self.xpub), size=self.m_pub, replace=False))
        x_p = self.xpub[sel]
        if party_logits is None:
            logits = [predict_logits(m, x_p, self.device, cfg.eval_batch_size) for m in self.models]
        else:
            logits = party_logits(self.models, x_p)
        shares = []
        for i in range(len(self.models)):
            share = share_knowledge(logits[i], cfg.knowledge)
            if plan is not None:
                if cfg.knowledge == "logits":
                    share = clip_rows(share, cfg.logit_clip)
                rng = noise_rng(
                    self.seed, f"fedmd-ldp-{i}-{t}", reproducible=cfg.reproducible_noise
                )
                # each shared vector is one Gaussian release; the ledger records their receipts
                receipts: list = []
                share = gaussian_output_perturbation(
                    share,
                    sigma=plan["sigma"][i],
                    sensitivity=plan["sensitivity"],
                    rng=rng,
                    client=i,
                    label="ldp predictions",
                    rows=True,
                    dtype=np.float32,
                    receipts=receipts,
                )
                self.ledger.add(
                    i,
                    compose_receipts(receipts),
                    label="ldp predictions",
                    round=t,
                    neighbouring="add_remove",
                )
            shares.append(share)
        consensus = aggregate_knowledge(shares)
        if plan is not None and cfg.knowledge != "logits":
            consensus = project_to_simplex_rows(consensus)  # post-processing of the noisy mean
        return [
            PartyJob(
                m,
                x_p,
                consensus,
                True,
                cfg.digest_epochs,
                cfg.digest_batch_size,
                derive_seed(self.seed, f"fedmd-digest-{i}-{t}"),
            )
            for i, m in enumerate(self.models)
        ]

    def revisit_jobs(self) -> list[PartyJob]:
        """The current round's revisits: T3 epochs on each party's private (sub)set."""
        cfg = self.config
        return [
            PartyJob(
                m,
                *self.private[i],
                False,
                cfg.revisit_epochs,
                cfg.revisit_batch_size,
                derive_seed(self.seed, f"fedmd-revisit-{i}-{self.t}"),
            )
            for i, m in enumerate(self.models)
        ]

    def result(self) -> TrainResult:
        cfg, yt = self.config, self.yt
        client_acc = self.rounds[-1]["client_accuracy"]
        r = cfg.released_party
        return TrainResult(
            method=f"fedmd-{self.variant}",
            seed=self.seed,
            config=cfg.model_dump(),
            model=self.models[r],
            model_spec=self.specs[r],
            ledger=self.ledger,
            rounds=self.rounds,
            test_accuracy=client_acc[r],
            artifacts=self.artifacts,
            client_models=self.models,  # type: ignore[arg-type]  # a list of modules
            client_model_specs=self.specs,
            client_accuracy=client_acc,
            warnings=self.warnings,
            claims=self.claims,
            chance_accuracy=float(np.bincount(yt).max() / len(yt)) if len(yt) else float("nan"),
        )


def run_fedmd(
    federation, config: FedMDConfig, seed: int, variant: str, progress: bool = False
) -> TrainResult:
    """Run FedMD in one of its variants: ``"nfdp"``, ``"np"`` or ``"ldp"``.

    Returns a :class:`TrainResult` whose ``model`` is party ``released_party``'s model and whose
    ``client_models`` are all parties' models.
    """
    run = FedMDRun(federation, config, seed, variant)
    for job in run.init_jobs():
        job.run(config, run.device)
    run.record()
    iterator: Iterable[int] = range(1, config.rounds + 1)
    if progress:
        from rich.progress import track

        iterator = track(iterator, description=f"fedmd-{variant}")
    for _ in iterator:
        digests = run.next_round()
        for d, r in zip(digests, run.revisit_jobs()):  # type: ignore[arg-type]  # per party: digest, then revisit
            d.run(config, run.device)
            r.run(config, run.device)
        run.record()
    return run.result()


def _round_record(t: int, accs: list[float], config: FedMDConfig) -> dict:
    return {
        "round": t,
        "test_accuracy": accs[config.released_party],
        "mean_client_accuracy": float(np.mean(accs)),
        "client_accuracy": accs,
    }


def nfdp_claim(n: int, k: int, replacement: bool) -> dict:
    """One party's NFDP guarantee as the theorems state it, with Table 2's log10 convention beside it.

    Returns ``n``, ``k``, ``epsilon`` (natural log, Theorem 1 or 2), ``delta``,
    ``epsilon_table2_log10`` (``epsilon / ln 10``: what the paper's Table 2 prints) and ``one_over_n``.
    """
    from accountants import nfdp_epsilon_delta

    eps, delta = nfdp_epsilon_delta(n, k, replacement)
    return {
        "n": n,
        "k": k,
        "replacement": replacement,
        "epsilon": eps,
        "delta": delta,
        "epsilon_table2_log10": eps / LN10,
        "one_over_n": 1.0 / n,
    }


def _record_privacy(
    variant,
    federation,
    config,
    ledger,
    warnings,
    claims,
    sizes,
    NfdpSubsampleEvent,
    NonPrivateEvent,
) -> None:
    """Ledger events, warnings and the paper's claim for NFDP / NP (LDP: see :func:`_record_ldp`).

    ``sizes``: each party's number of private-class records (the NFDP theorems' n).
    """
    from accountants import EpsilonDeltaEvent
    from accountants.nfdp import record_exposure_warning

    if variant == "np":
        for i in range(federation.num_clients):
            ledger.add(i, NonPrivateEvent(NP_REASON), label="shared predictions (all data)")
        warnings.append(
            "FedMD-NP gives no privacy guarantee: predictions of models trained on all "
            "private data are shared in the clear"
        )
        claims.update(
            {"epsilon": float("inf"), "delta": 1.0, "source": "FedMD-NFDP Table 2 (FedMD-NP row)"}
        )
        return
    if variant != "nfdp":
        return
    per_client = []
    exposed = 0
    for i, n in enumerate(sizes):
        if n == 0:  # nothing to subsample: the party trains on public data only
            ledger.add(
                i,
                EpsilonDeltaEvent(0.0, 0.0),
                label="no private-class records",
                neighbouring="add_remove",
            )
            warnings.append(
                f"party {i} holds no records of the private classes: it releases "
                "predictions of its pretrained model only (epsilon 0)"
            )
            continue
        ledger.add(
            i,
            NfdpSubsampleEvent(n=n, k=config.k, replacement=config.replacement),
            label="nfdp subsample",
            neighbouring="add_remove",
        )
        claim = nfdp_claim(n, config.k, config.replacement)
        per_client.append({"client": i, **claim})
        if record_exposure_warning(claim["delta"], n) is not None:
            exposed += 1
    if not per_client:
        raise PrivkitError(
            "no party holds records of the private classes; found 0 records in every party"
        )
    worst = max(per_client, key=lambda c: (c["delta"], c["epsilon"]))
    theorem = (
        "Theorem 2 (with replacement)" if config.replacement else "Theorem 1 (without replacement)"
    )
    claims.update(
        {
            "epsilon": max(c["epsilon"] for c in per_client),
            "delta": max(c["delta"] for c in per_client),
            "log": "natural",
            "neighbouring": "add_remove",
            "source": f"FedMD-NFDP {theorem}",
            "per_client": per_client,
            "table2_convention": (
                "the paper's Table 2 prints k*log10((n+1)/n): its epsilons are in "
                "log10 and the true (natural-log) epsilon is ln(10) = 2.303x larger; "
                "epsilon_table2_log10 gives the value in the table's convention"
            ),
        }
    )
    if exposed:
        warnings.append(
            f"{exposed} of {len(per_client)} parties have delta >= 1/n (worst: party {worst['client']}, "
            f"n={worst['n']}, k={config.k}: delta={worst['delta']:.4g} >= 1/n={worst['one_over_n']:.4g}): "
            "such a guarantee permits publishing records in the clear, and the NFDP subset release "
            "does exactly that for each sampled record"
        )
    warnings.append(
        "NFDP's exact privacy profile is flat: the subset release is (0, delta)-DP and no smaller "
        "delta holds at any epsilon, so the theorems' epsilon buys nothing (accountants.nfdp)"
    )
    warnings.append(
        "FedMD-NFDP Table 2 reports epsilon in log10 (k*log10((n+1)/n)); privkit reports the "
        f"theorems' natural-log epsilon, 2.303x larger (worst party here: {worst['epsilon']:.4g} "
        f"= {worst['epsilon_table2_log10']:.4g} in Table 2's convention)"
    )


def _record_ldp(
    federation, config, plan, ledger, warnings, claims, dpa, NonPrivateEvent, sizes
) -> None:
    sens, queries = plan["sensitivity"], plan["queries"]
    per_client = []
    for i in range(federation.num_clients):
        ledger.add(i, NonPrivateEvent(LDP_MODEL_REASON), label="party model")
        if not queries:
            continue
        # the rounds' "ldp predictions" entries come from the releases' receipts as they run
        # (FedMdRun.next_round): per round SelfComposed(Gaussian(z), vectors shared)
        z = plan["sigma"][i] / sens
        eps, delta = plan["target"][i]
        per_client.append(
            {
                "client": i,
                "n": sizes[i],
                "epsilon": eps,
                "delta": delta,
                "sigma": plan["sigma"][i],
                "noise_multiplier": z,
            }
        )
    if per_client:
        claims.update(
            {
                "epsilon": max(c["epsilon"] for c in per_client),
                "delta": max(c["delta"] for c in per_client),
                "labels": ["ldp predictions"],
                "neighbouring": "add_remove (the sensitivity bound is the output set's diameter, so it "
                "holds under replace-one too)",
                "sensitivity": sens,
                "queries": queries,
                "source": (
                    "FedMD-NFDP, FedMD-LDP baseline: Gaussian noise on shared predictions at NFDP's "
                    "(epsilon, delta), composed over rounds and queries (Fig. 3c)"
                ),
                "per_client": per_client,
            }
        )
        smin = min(c["sigma"] for c in per_client)
        warnings.append(
            f"FedMD-LDP noise std per shared coordinate >= {smin:.4g} (sensitivity {sens:.4g} per "
            f"vector, {queries} vector releases composed): the paper reports that utility collapses"
        )
    warnings.append(
        "FedMD-LDP protects only the shared predictions; the released party model is "
        "trained on all private data without noise (ledger label 'party model')"
    )


# method "fedmd-nfdp": config and registration in privkit.methods.fedmd
def train_fedmd_nfdp(
    federation, config: FedMDNfdpConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedMD-NFDP (Algorithm 1) with one NFDP subsample event per party."""
    return run_fedmd(federation, config, seed, "nfdp", progress)


# method "fedmd-np": config and registration in privkit.methods.fedmd
def train_fedmd_np(
    federation, config: FedMDNpConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedMD-NP baseline (all private data, no guarantee)."""
    return run_fedmd(federation, config, seed, "np", progress)


# method "fedmd-ldp": config and registration in privkit.methods.fedmd
def train_fedmd_ldp(
    federation, config: FedMDLdpConfig, seed: int, progress: bool = False
) -> TrainResult:
    """FedMD-LDP baseline: noised predictions; the released party model itself is non-private."""
    return run_fedmd(federation, config, seed, "ldp", progress)
