"""Audit controls: deliberately broken twins of privkit's DP-SGD, audited like everything else.

An audit that does not flag a mechanism known to be broken says nothing about the ones it passes.
Every ``privkit run`` report therefore carries controls: twins of one DP method of the run
(privkit's DP-SGD on the pooled client data, :class:`~privkit.trainers.dp_sgd_step.DpSgdStep`,
Poisson sampling), each *claiming the method's accounted epsilon*:

* ``correct``: DP-SGD as accounted. Audited white-box (gradient canaries) and black-box (canary
  records). Must not come out ``violation`` (a negative control: it fails at most at the audit's
  error rate, 5% per audit at the default confidence).
* ``noise removed``: the same with noise multiplier 0. Audited white-box. Must be a ``violation``.
* ``clipping and noise removed``: plain SGD on the same batches. Audited black-box with canary
  records. Must be a ``violation``.

One recipe for every twin: the DP method's model, clip norm, optimiser, learning rate and expected
batch size, trained for ``epochs`` epochs (by default the method's own; a black-box audit sees only
what the final model memorised, so longer training gives it more to see). The correct twin's noise
multiplier is calibrated so that its ledger gives exactly the claimed epsilon at ``delta`` for that
many steps (when ``epochs`` is the method's own, it is the method's noise multiplier).

Canaries. White-box: :class:`attacks.whitebox.GradientCanaries` (Dirac, norm = clip, each
included by a fair coin, sampled with the batch rate); the auditor knows every other record's
clipped gradient, the adversary DP is defined against. Black-box: out-of-distribution canary
records (:func:`attacks.canaries.insert_canaries`, ``kind="ood"``), each included by a fair coin,
scored by their loss on the final model. Both bounds: one-run (Steinke et al. 2023) over the
canaries alone, guesses :data:`attacks.canaries.POSITIVE_GUESSES`, testing the bare (epsilon,
delta) claim; beside it the f-DP bound against the twin's own ledger curve (Mahloujifar et al.
2024; the claim "as private as its ledger", which the correct twin satisfies exactly).

The twins' DP noise is seeded (reproducible): they are controls, never releases.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from privkit.errors import PrivkitError

SCHEMA_VERSION = 1
WHITE_BOX, BLACK_BOX = "white-box", "black-box"


@dataclass(frozen=True)
class ControlRecipe:
    """What every twin shares (from the DP method's trainer config and the federation)."""

    method: str
    spec: dict
    n: int
    clip_norm: float
    lr: float
    optimizer: str
    batch_size: int
    epochs: int
    method_epochs: int
    method_noise_multiplier: float
    config_delta: float

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)

    @property
    def sample_rate(self) -> float:  # as the dpsgd trainer (opacus' DPDataLoader): 1 / batches
        return 1.0 / self.batches_per_epoch

    @property
    def steps(self) -> int:
        return self.epochs * self.batches_per_epoch

    def to_dict(self) -> dict:
        return {**asdict(self), "sample_rate": self.sample_rate, "steps": self.steps}


def control_recipe(federation, trainer_config: dict, *, method: str = "dpsgd",
                   epochs: int | None = None) -> ControlRecipe:
    """The twins' recipe from a ``dpsgd`` trainer config (the one the run trains, or its defaults)."""
    from accountants import calibrate_noise_multiplier
    from privkit.models import model_spec
    from privkit.trainers.dpsgd import DpsgdConfig

    cfg = DpsgdConfig.model_validate(trainer_config)
    n = int(len(federation.pooled_arrays()[1]))
    if n < cfg.batch_size:
        raise PrivkitError(f"batch_size must be <= the pooled data size {n}; found {cfg.batch_size}")
    spec = model_spec(cfg.arch, federation.input_shape, federation.num_classes, width=cfg.width,
                      feature_dim=cfg.feature_dim)
    batches = math.ceil(n / cfg.batch_size)
    q, steps = 1.0 / batches, cfg.epochs * batches
    sigma = cfg.noise_multiplier
    if sigma is None:  # exactly what the trainer calibrates
        sigma = calibrate_noise_multiplier(cfg.target_epsilon, cfg.delta, q, steps,
                                           accountant=cfg.calibration_accountant).noise_multiplier
    if epochs is not None and epochs < 1:
        raise PrivkitError(f"controls epochs must be >= 1; found {epochs}")
    return ControlRecipe(method=method, spec=spec, n=n, clip_norm=cfg.clip_norm, lr=cfg.lr,
                         optimizer=cfg.optimizer, batch_size=cfg.batch_size,
                         epochs=epochs or cfg.epochs, method_epochs=cfg.epochs,
                         method_noise_multiplier=float(sigma), config_delta=cfg.delta)


def _ledger(recipe: ControlRecipe, sigma: float, steps: int):
    from accountants import Ledger, dpsgd_event

    ledger = Ledger()
    ledger.add(0, dpsgd_event(recipe.sample_rate, sigma, steps), "dp-sgd (audit control)")
    return ledger


def _sgd_loss(logits, target, aux):
    return F.cross_entropy(logits, target)


def train_twin(recipe: ControlRecipe, x: np.ndarray, y: np.ndarray, *, noise_multiplier: float | None,
               seed: int, gradient_canaries=None) -> torch.nn.Module:
    """One twin: DP-SGD (``noise_multiplier`` given; 0 = noise removed) or, with ``None``, SGD
    without clipping or noise on the same Poisson batches (gradient sum / expected batch size)."""
    from privkit.models import build_from_spec
    from privkit.seeding import derive_seed, seed_torch, torch_generator
    from privkit.trainers.common import make_optimizer
    from privkit.trainers.dp_sgd_step import DpSgdStep, poisson_batch

    seed_torch(derive_seed(seed, "init"))
    model = build_from_spec(recipe.spec)
    opt = make_optimizer(model.parameters(), recipe.optimizer, recipe.lr)
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
    batches, noise = torch_generator(derive_seed(seed, "poisson")), torch_generator(derive_seed(seed, "noise"))
    q, n = recipe.sample_rate, len(yt)
    step = None if noise_multiplier is None else DpSgdStep(recipe.clip_norm, noise_multiplier, q, n)
    for _ in range(recipe.steps):
        b = poisson_batch(n, q, batches)
        if step is not None:
            step.apply(model, opt, xt[b], yt[b], _sgd_loss, noise, canaries=gradient_canaries)
        elif len(b):
            opt.zero_grad(set_to_none=True)
            (F.cross_entropy(model(xt[b]), yt[b], reduction="sum") / (q * n)).backward()
            opt.step()
    return model.eval()


def _audit(scores: np.ndarray, included: np.ndarray, st: _Setting, *, name: str, note: str) -> dict:
    """The control's verdict (generic one-run bound) and the ledger-curve f-DP bound beside it."""
    from accountants import ledger_curve
    from attacks import audit_scores
    from attacks.canaries import POSITIVE_GUESSES

    common = dict(accounted_epsilon=st.claimed, delta=st.delta, seed=st.seed, guesses=POSITIVE_GUESSES,
                  inclusion="random", notes={name: note})
    generic = audit_scores({name: scores}, included, **common)
    curve = audit_scores({name: scores}, included, curve=ledger_curve(st.ledger), **common)
    out = generic.to_dict()
    out["ledger_curve"] = {k: curve.to_dict(with_attacks=False)[k] for k in (
        "status", "epsilon_lower_bound", "epsilon_ceiling", "detectable_epsilon", "claim_tested")}
    return out


def _entry(name: str, expected: str, mode: str, mechanism: str, audit: dict, accuracy: float,
           extra: dict | None = None) -> dict:
    caught = audit["status"] == "violation"
    passed = caught if expected == "violation" else not caught
    return {"name": name, "expected": expected, "audit_mode": mode, "mechanism": mechanism,
            "verdict": audit, "caught": caught, "passed": passed, "test_accuracy": accuracy,
            **(extra or {})}


@dataclass
class _Setting:
    """What every twin of one run_controls call shares."""

    recipe: ControlRecipe
    claimed: float
    sigma: float
    delta: float
    seed: int
    ledger: Any
    data: Any  # attacks.canaries.CanaryData: the twins' training data with record canaries
    num_classes: int
    white_box_canaries: int
    x_test: np.ndarray
    y_test: np.ndarray


TWINS = ("correct", "noise removed", "clipping and noise removed")


def run_controls(federation, trainer_config: dict, *, delta: float, seed: int = 0,
                 method: str = "dpsgd", epochs: int | None = None, white_box_canaries: int = 1000,
                 black_box_canaries: int = 1000, canary_options: dict | None = None,
                 progress: bool = False) -> dict:
    """Train and audit the three twins (see the module docstring); returns the ``controls.json`` record.

    Parameters
    ----------
    federation : the run's federation (the pooled client data is the twins' training data).
    trainer_config : the DP method's ``dpsgd`` trainer config.
    delta : the report's delta (the claimed epsilon and every bound are at it).
    seed : audit seed (canaries, coins, twins' seeds).
    method : the DP method's name in the run (for the report).
    epochs : the twins' training length (default: the method's).
    white_box_canaries, black_box_canaries : number of gradient / record canaries.
    canary_options : options of the record canaries (:func:`attacks.canaries.make_canaries`).
    """
    from accountants import calibrate_noise_multiplier
    from attacks.canaries import insert_canaries
    from privkit.progress import progress_bar

    recipe = control_recipe(federation, trainer_config, method=method, epochs=epochs)
    claimed = float(_ledger(recipe, recipe.method_noise_multiplier,
                            recipe.method_epochs * recipe.batches_per_epoch).epsilon(delta))
    if recipe.epochs == recipe.method_epochs:
        sigma = recipe.method_noise_multiplier
    else:  # the same claim over the twins' longer (or shorter) training
        sigma = calibrate_noise_multiplier(claimed, delta, recipe.sample_rate, recipe.steps).noise_multiplier
    x, y = federation.pooled_arrays()
    x_test, y_test = federation.test_arrays()
    data = insert_canaries(x, y, black_box_canaries, kind="ood", seed=seed,
                           num_classes=federation.num_classes, **(canary_options or {}))
    # the twins train on every pooled record (ood canaries have no source) plus the included canaries
    recipe = ControlRecipe(**{**asdict(recipe), "n": len(data.y_train)})
    setting = _Setting(recipe=recipe, claimed=claimed, sigma=sigma, delta=delta, seed=seed,
                       ledger=_ledger(recipe, sigma, recipe.steps), data=data,
                       num_classes=federation.num_classes, white_box_canaries=white_box_canaries,
                       x_test=x_test, y_test=y_test)
    out: list[dict] = []
    with progress_bar(progress) as bar:
        task = bar.add_task("audit controls", total=len(TWINS))
        for i, name in enumerate(TWINS):
            bar.update(task, info=name)
            out += _run_twin(setting, name, i)
            bar.advance(task)
    positives = [c for c in out if c["expected"] == "violation"]
    lacks_power = [c for c in positives if not c["caught"]]
    false_alarms = [c for c in out if c["expected"] != "violation" and c["caught"]]
    return {"schema_version": SCHEMA_VERSION, "method": method, "claimed_epsilon": claimed,
            "delta": delta, "seed": seed, "noise_multiplier": sigma, "recipe": recipe.to_dict(),
            "controls": out, "power": not lacks_power, "false_alarm": bool(false_alarms),
            "message": _message(claimed, delta, method, lacks_power, false_alarms)}


def _run_twin(st: _Setting, name: str, index: int) -> list[dict]:
    """Train one twin and audit it (white-box where it runs DP-SGD, black-box unless noise-only)."""
    from attacks.canaries import canary_scores
    from attacks.recipe import predict_logits
    from attacks.whitebox import GradientCanaries
    from privkit.models import build_from_spec
    from privkit.seeding import derive_seed

    r, data = st.recipe, st.data
    sig = {"correct": st.sigma, "noise removed": 0.0}.get(name)  # None: no clipping, no noise
    wb = None
    if sig is not None:
        params = [p for p in build_from_spec(r.spec).parameters() if p.requires_grad]
        wb = GradientCanaries.for_parameters(params, st.white_box_canaries, clip_norm=r.clip_norm,
                                             sample_rate=r.sample_rate, noise_multiplier=st.sigma,
                                             seed=st.seed)
    model = train_twin(r, data.x_train, data.y_train, noise_multiplier=sig,
                       seed=derive_seed(st.seed, f"control/{index}"), gradient_canaries=wb)
    acc = float((predict_logits(model, st.x_test).argmax(1) == st.y_test).mean())
    mech = {"correct": f"DP-SGD, clip {r.clip_norm:g}, noise multiplier {st.sigma:.4g}",
            "noise removed": f"DP-SGD, clip {r.clip_norm:g}, noise multiplier 0 (claims {st.sigma:.4g})",
            }.get(name, "SGD without clipping or noise on the same Poisson batches")
    expected = "no violation" if name == "correct" else "violation"
    out = []
    if wb is not None:
        s = wb.summary()
        note = (f"{s['canaries']} Dirac gradient canaries ({s['included']} included by fair coins, "
                f"sampled at q = {s['sample_rate']:.4g} over {s['steps']} steps), score = "
                "log-likelihood ratio of each step's component along the canary under the claim")
        audit = _audit(wb.scores(), wb.included, st, name="gradient-canaries", note=note)
        out.append(_entry(name, expected, WHITE_BOX, mech, audit, acc, {"canaries": s}))
    if name != "noise removed":  # with clipping kept, canary records cannot show missing noise
        scores = canary_scores(predict_logits(model, data.canary_x, st.num_classes), data.canary_y, "loss")
        note = (f"{data.m} out-of-distribution canary records ({int(data.included.sum())} included by "
                "fair coins), score = -loss on the final model")
        audit = _audit(scores, data.included, st, name="canary-records", note=note)
        out.append(_entry(name, expected, BLACK_BOX, mech, audit, acc, {"canaries": data.summary()}))
    return out


def _message(claimed: float, delta: float, method: str, lacks: list, alarms: list) -> str:
    base = f"twins of {method} claiming epsilon {claimed:.3f} at delta={delta:g}"
    if lacks:
        which = "; ".join(f"{c['name']} ({c['audit_mode']})" for c in lacks)
        return (f"This audit lacked the power to see a violation: its positive control(s) {which} "
                f"were not caught ({base}). Its 'consistent' verdicts say little.")
    text = f"Every positive control was caught ({base})."
    if alarms:
        which = "; ".join(f"{c['name']} ({c['audit_mode']})" for c in alarms)
        text += (f" The correct twin was flagged ({which}): a false alarm, which a 95% audit "
                 "gives in about 1 run in 20 per audit")
    return text


def controls_summary(record: dict) -> dict[str, Any]:
    """A short dict for logs: name/mode -> verdict and bound."""
    return {f"{c['name']} ({c['audit_mode']})": (c["verdict"]["status"], c["verdict"]["epsilon_lower_bound"])
            for c in record["controls"]}
