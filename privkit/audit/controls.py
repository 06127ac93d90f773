"""Audit controls: deliberately broken twins of privkit's DP-SGD, audited like everything else.

An audit that does not flag a mechanism known to be broken says nothing about the ones it passes.
Every ``privkit run`` report therefore carries controls: twins of one DP method of the run
(privkit's DP-SGD, :class:`~privkit.mechanisms.dp_sgd_step.DpSgdStep`, with Poisson sampling, on the
pooled client data), each *claiming the method's accounted epsilon* at the report's delta:

* ``correct``: DP-SGD exactly as the method is accounted (its model, clip norm, optimiser,
  learning rate, expected batch size, epochs and noise multiplier). Audited white-box and
  black-box; must not come out ``violation`` (a negative control fails only at the audit's error
  rate, 5% per audit at the default confidence).
* ``noise removed``: the same with noise multiplier 0. Audited white-box; must be a ``violation``.
* ``clipping and noise removed``: SGD without clipping or noise, i.e. non-private training of the
  same model on the same data, with the settings of privkit's non-private baseline (``centralized``
  quick: SGD, learning rate 0.1, batch 64) for ``black_box_epochs`` epochs. Audited black-box;
  must be a ``violation``. It trains longer than the method because a black-box audit sees only
  what the final model memorised: at the demo's 3 epochs no canary is memorised (measured: the
  bound is 0), so a 3-epoch twin would test nothing.

Canaries. White-box: :class:`attacks.whitebox.GradientCanaries` (Dirac, norm = clip norm, each
included by a fair coin and sampled with the batch rate); the auditor knows every other record's
clipped gradient (the adversary DP is defined against), so each canary's view is exactly the
accounted subsampled Gaussian. Black-box: out-of-distribution canary records
(:func:`attacks.canaries.insert_canaries`, ``kind="ood"``) in the twins' training data, each
included by a fair coin, scored by their loss on the final model. The bound: one-run (Steinke et
al. 2023) over the canaries alone, guesses :data:`attacks.canaries.ONE_SIDED_GUESSES`, testing the
bare (epsilon, delta) claim (the same claim the method verdicts test).

The twins' DP noise is seeded (reproducible): they are controls, never releases.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from privkit.errors import PrivkitError

SCHEMA_VERSION = 1
WHITE_BOX, BLACK_BOX = "white-box", "black-box"
TWINS = ("correct", "noise removed", "clipping and noise removed")
#: The non-private twin's optimiser: privkit's non-private baseline (``centralized``, quick config).
NON_PRIVATE: dict[str, Any] = {"optimizer": "sgd", "lr": 0.1, "batch_size": 64}


@dataclass(frozen=True)
class ControlRecipe:
    """How one twin trains (privkit's DP-SGD loop): Poisson rate ``sample_rate`` over ``n`` records
    for ``steps`` steps, the update divided by the expected batch size ``sample_rate * n``."""

    spec: dict
    n: int
    clip_norm: float
    lr: float
    optimizer: str
    sample_rate: float
    steps: int
    epochs: int

    @classmethod
    def of(
        cls,
        spec: dict,
        n: int,
        *,
        clip_norm: float,
        lr: float,
        optimizer: str,
        batch_size: int,
        epochs: int,
    ) -> ControlRecipe:
        """As the dpsgd trainer (opacus' DPDataLoader) sets it: rate 1 / batches per epoch."""
        batches = math.ceil(n / batch_size)
        return cls(
            spec=spec,
            n=n,
            clip_norm=clip_norm,
            lr=lr,
            optimizer=optimizer,
            sample_rate=1.0 / batches,
            steps=epochs * batches,
            epochs=epochs,
        )

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.n

    def to_dict(self) -> dict:
        return {**asdict(self), "expected_batch_size": self.expected_batch_size}


def method_recipe(federation, trainer_config: dict) -> tuple[ControlRecipe, float, float]:
    """The DP method's recipe, its noise multiplier (as its trainer calibrates it) and its delta,
    from a ``dpsgd`` trainer config."""
    from accountants import calibrate_noise_multiplier
    from privkit.models import model_spec
    from privkit.trainers.dpsgd import DpsgdConfig

    cfg = DpsgdConfig.model_validate(trainer_config)
    n = len(federation.pooled_arrays()[1])
    if n < cfg.batch_size:
        raise PrivkitError(
            f"batch_size must be <= the pooled data size {n}; found {cfg.batch_size}"
        )
    spec = model_spec(
        cfg.arch,
        federation.input_shape,
        federation.num_classes,
        width=cfg.width,
        feature_dim=cfg.feature_dim,
    )
    recipe = ControlRecipe.of(
        spec,
        n,
        clip_norm=cfg.clip_norm,
        lr=cfg.lr,
        optimizer=cfg.optimizer,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
    )
    sigma = cfg.noise_multiplier
    if sigma is None:  # exactly what the trainer calibrates
        sigma = calibrate_noise_multiplier(
            cfg.target_epsilon,
            cfg.delta,
            recipe.sample_rate,
            recipe.steps,
            accountant=cfg.calibration_accountant,
        ).noise_multiplier
    return recipe, float(sigma), cfg.delta


def claimed_epsilon(recipe: ControlRecipe, sigma: float, delta: float) -> float:
    """Epsilon at ``delta`` of the recipe's ledger (privkit's accountants, ``best``)."""
    from accountants import Ledger, dpsgd_event

    ledger = Ledger()
    ledger.add(0, dpsgd_event(recipe.sample_rate, sigma, recipe.steps), "dp-sgd (audit control)")
    return float(ledger.epsilon(delta))


def _loss(logits, target, aux):
    return F.cross_entropy(logits, target)


def train_twin(
    recipe: ControlRecipe,
    x: np.ndarray,
    y: np.ndarray,
    *,
    noise_multiplier: float | None,
    seed: int,
    gradient_canaries=None,
) -> torch.nn.Module:
    """One twin: DP-SGD (``noise_multiplier`` given; 0 = noise removed) or, with ``None``, SGD
    without clipping or noise on Poisson batches (gradient sum / expected batch size, as DP-SGD)."""
    from privkit.mechanisms.dp_sgd_step import DpSgdStep, poisson_batch
    from privkit.models import build_from_spec
    from privkit.seeding import derive_seed, seed_torch, torch_generator
    from privkit.trainers.common import make_optimizer

    if len(y) != recipe.n:
        raise PrivkitError(f"the recipe expects n = {recipe.n} records; found {len(y)}")
    seed_torch(derive_seed(seed, "init"))
    model = build_from_spec(recipe.spec)
    opt = make_optimizer(model.parameters(), recipe.optimizer, recipe.lr)
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
    batches, noise = (
        torch_generator(derive_seed(seed, "poisson")),
        torch_generator(derive_seed(seed, "noise")),
    )
    q, n = recipe.sample_rate, recipe.n
    step = None if noise_multiplier is None else DpSgdStep(recipe.clip_norm, noise_multiplier, q, n)
    for _ in range(recipe.steps):
        b = poisson_batch(n, q, batches)
        if step is not None:
            step.apply(model, opt, xt[b], yt[b], _loss, noise, canaries=gradient_canaries)
        elif len(b):
            opt.zero_grad(set_to_none=True)
            (F.cross_entropy(model(xt[b]), yt[b], reduction="sum") / (q * n)).backward()
            opt.step()
    return model.eval()


@dataclass
class _Setting:
    """What every twin of one :func:`run_controls` call shares."""

    method: ControlRecipe
    non_private: ControlRecipe
    claimed: float
    sigma: float
    delta: float
    seed: int
    data: Any  # attacks.canaries.CanaryData: the twins' training data with the record canaries
    num_classes: int
    white_box_canaries: int
    x_test: np.ndarray
    y_test: np.ndarray


def run_controls(
    federation,
    trainer_config: dict,
    *,
    delta: float,
    seed: int = 0,
    method: str = "dpsgd",
    black_box_epochs: int = 20,
    white_box_canaries: int = 1000,
    black_box_canaries: int = 1000,
    canary_options: dict | None = None,
    progress: bool = False,
) -> dict:
    """Train and audit the three twins (see the module docstring); returns the ``controls.json`` record.

    Parameters
    ----------
    federation : the run's federation (the pooled client data is the twins' training data).
    trainer_config : the DP method's ``dpsgd`` trainer config.
    delta : the report's delta (the claimed epsilon and every bound are at it).
    seed : audit seed (canaries, coins, twins' seeds).
    method : the DP method's name in the run (for the report).
    black_box_epochs : training length of the non-private twin.
    white_box_canaries, black_box_canaries : number of gradient / record canaries.
    canary_options : options of the record canaries (:func:`attacks.canaries.make_canaries`;
        default: 2% of the input coordinates, at least enough for distinct patterns, lit 5 times
        the pool's range above its minimum).
    """
    from attacks.canaries import insert_canaries
    from privkit.progress import progress_bar

    if black_box_epochs < 1:
        raise PrivkitError(f"black_box_epochs must be >= 1; found {black_box_epochs}")
    recipe, sigma, _ = method_recipe(federation, trainer_config)
    claimed = claimed_epsilon(recipe, sigma, delta)
    x, y = federation.pooled_arrays()
    x_test, y_test = federation.test_arrays()
    options = {
        "ood_fraction": _ood_fraction(int(np.prod(x.shape[1:])), black_box_canaries),
        "ood_amplitude": 5.0,
        **(canary_options or {}),
    }
    data = insert_canaries(
        x,
        y,
        black_box_canaries,
        kind="ood",
        seed=seed,
        num_classes=federation.num_classes,
        **options,
    )
    # every twin trains on all pooled records (ood canaries have no source) + the included canaries;
    # the DP twins keep the method's sampling rate and steps, so their ledger is the method's
    n = len(data.y_train)
    non_private = ControlRecipe.of(
        recipe.spec, n, clip_norm=recipe.clip_norm, epochs=black_box_epochs, **NON_PRIVATE
    )
    st = _Setting(
        method=replace(recipe, n=n),
        claimed=claimed,
        sigma=sigma,
        delta=delta,
        seed=seed,
        data=data,
        non_private=non_private,
        num_classes=federation.num_classes,
        white_box_canaries=white_box_canaries,
        x_test=x_test,
        y_test=y_test,
    )
    out: list[dict] = []
    with progress_bar(progress) as bar:
        task = bar.add_task("audit controls", total=len(TWINS))
        for i, name in enumerate(TWINS):
            bar.update(task, info=name)
            out += _run_twin(st, name, i)
            bar.advance(task)
    positives = [c for c in out if c["expected"] == "violation"]
    lacks_power = [c for c in positives if not c["caught"]]
    false_alarms = [c for c in out if c["expected"] != "violation" and c["caught"]]
    return {
        "schema_version": SCHEMA_VERSION,
        "method": method,
        "claimed_epsilon": claimed,
        "delta": delta,
        "seed": seed,
        "noise_multiplier": sigma,
        "recipes": {"dp-sgd": st.method.to_dict(), "non-private": st.non_private.to_dict()},
        "controls": out,
        "power": not lacks_power,
        "false_alarm": bool(false_alarms),
        "message": _message(claimed, delta, method, lacks_power, false_alarms),
    }


def _ood_fraction(d: int, n: int) -> float:
    """2% of the input coordinates (16 pixels of MNIST's 784), or the fewest that give every one
    of ``n`` canaries its own pattern with room to spare (small inputs)."""
    lit = max(1, round(0.02 * d))
    while lit < d and math.comb(d, lit) < 4 * n:
        lit += 1
    return lit / d


def _run_twin(st: _Setting, name: str, index: int) -> list[dict]:
    """Train one twin and audit it: white-box where it runs DP-SGD, black-box unless only the noise
    is gone (with clipping kept, no canary record can show missing noise: issue 13's measurement)."""
    from attacks.canaries import canary_scores
    from attacks.recipe import predict_logits
    from attacks.whitebox import GradientCanaries
    from privkit.models import build_from_spec
    from privkit.seeding import derive_seed

    data = st.data
    sig = {"correct": st.sigma, "noise removed": 0.0}.get(name)  # None: no clipping, no noise
    recipe = st.method if sig is not None else st.non_private
    wb = None
    if sig is not None:
        params = [p for p in build_from_spec(recipe.spec).parameters() if p.requires_grad]
        wb = GradientCanaries.for_parameters(
            params,
            st.white_box_canaries,
            clip_norm=recipe.clip_norm,
            sample_rate=recipe.sample_rate,
            noise_multiplier=st.sigma,
            seed=st.seed,
        )
    model = train_twin(
        recipe,
        data.x_train,
        data.y_train,
        noise_multiplier=sig,
        seed=derive_seed(st.seed, f"control/{index}"),
        gradient_canaries=wb,
    )
    acc = float((predict_logits(model, st.x_test).argmax(1) == st.y_test).mean())
    mech = {
        "correct": f"DP-SGD as accounted: clip {recipe.clip_norm:g}, noise multiplier {st.sigma:.4g}, "
        f"{recipe.epochs} epochs",
        "noise removed": f"DP-SGD with noise multiplier 0 (claims {st.sigma:.4g}), clip "
        f"{recipe.clip_norm:g}, {recipe.epochs} epochs",
    }.get(
        name,
        f"SGD without clipping or noise (lr {recipe.lr:g}, expected batch "
        f"{recipe.expected_batch_size:.0f}), {recipe.epochs} epochs",
    )
    base = {
        "name": name,
        "expected": "no violation" if name == "correct" else "violation",
        "mechanism": mech,
        "recipe": recipe.to_dict(),
        "test_accuracy": acc,
    }
    out = []
    if wb is not None:
        s = wb.summary()
        note = (
            f"{s['canaries']} Dirac gradient canaries ({s['included']} included by fair coins, "
            f"sampled at q = {s['sample_rate']:.4g} over {s['steps']} steps); score = "
            "log-likelihood ratio of each step's component along the canary under the claim"
        )
        out.append(
            _entry(
                base, WHITE_BOX, _audit(wb.scores(), wb.included, st, "gradient-canaries", note), s
            )
        )
    if name != "noise removed":
        z = predict_logits(model, data.canary_x, st.num_classes)
        note = (
            f"{data.m} out-of-distribution canary records ({int(data.included.sum())} included by "
            "fair coins); score = -loss on the final model"
        )
        audit = _audit(
            canary_scores(z, data.canary_y, "loss"), data.included, st, "canary-records", note
        )
        out.append(_entry(base, BLACK_BOX, audit, data.summary()))
    return out


def _audit(scores: np.ndarray, included: np.ndarray, st: _Setting, name: str, note: str) -> dict:
    """The control's verdict record: one-run bound over the canaries, (epsilon, delta) claim."""
    from attacks import audit_scores
    from attacks.canaries import ONE_SIDED_GUESSES

    return audit_scores(
        {name: scores},
        included,
        accounted_epsilon=st.claimed,
        delta=st.delta,
        seed=st.seed,
        guesses=ONE_SIDED_GUESSES,
        inclusion="random",
        notes={name: note},
    ).to_dict()


def _entry(base: dict, mode: str, audit: dict, canaries: dict) -> dict:
    caught = audit["status"] == "violation"
    passed = caught if base["expected"] == "violation" else not caught
    return {
        **base,
        "audit_mode": mode,
        "verdict": audit,
        "caught": caught,
        "passed": passed,
        "canaries": canaries,
    }


def _message(claimed: float, delta: float, method: str, lacks: list, alarms: list) -> str:
    base = f"twins of {method} claiming epsilon {claimed:.3f} at delta={delta:g}"
    if lacks:
        which = "; ".join(f"{c['name']} ({c['audit_mode']})" for c in lacks)
        return (
            f"This audit lacked the power to see a violation: its positive control(s) {which} "
            f"were not caught ({base}); a 'consistent' verdict here says little."
        )
    text = f"Every positive control was caught ({base})."
    if alarms:
        which = "; ".join(f"{c['name']} ({c['audit_mode']})" for c in alarms)
        text += (
            f" The correct twin was flagged ({which}): a false alarm, which a 95% audit gives "
            "in about 1 run in 20 per audit."
        )
    return text
