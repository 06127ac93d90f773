"""Centralised DP-SGD (Abadi et al. 2016) on the pooled client data, through opacus.

The reference point for every report and the simplest audit target: one model trained on all
clients' records with opacus's ``PrivacyEngine`` (Poisson sampling via ``DPDataLoader``, flat
per-sample clipping, Gaussian noise ``noise_multiplier * clip_norm`` on the summed gradient,
normalised by the expected batch size). The noise multiplier is either given or calibrated from
``(target_epsilon, delta)`` with :func:`accountants.calibrate_noise_multiplier` for the exact
sample rate and number of steps that run.

Ledger: record-level DP over the pooled dataset holds for every record, so each client gets the
same entry ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)`` (labelled
"dp-sgd (pooled data)"); per-client entries keep the reports comparable with the federated methods.

Batched form: :func:`train_dpsgd_many` trains M models with the same mechanism (Poisson rate, steps,
noise multiplier, clipping, optimiser, initialisation) at once on privkit's batched path
(:mod:`privkit.trainers.batched_sgd`), e.g. the shadow or reference models of an audit; only the
random streams differ from opacus'.
"""

from __future__ import annotations

import warnings as _warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

from privkit.errors import PrivkitError
from privkit.methods.dpsgd import PAPER, CentralConfig, DpsgdConfig  # noqa: F401  (re-exported)
from privkit.seeding import derive_seed, noise_generator
from privkit.trainers.base import TrainResult
from privkit.trainers.common import accuracy, make_optimizer, new_model, resolve_device
from privkit.trainers.opacus_streams import secret_poisson_loader, use_noise_source


def _loader(x, y, batch_size: int, generator: torch.Generator | None) -> DataLoader:
    # opacus's DPDataLoader replaces the batches by Poisson sampling drawn from this generator
    ds = TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long))
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=generator)


def _run_epochs(private, dp_opt, dp_loader, loss_fn, epochs, model, federation, device) -> tuple[int, list[dict]]:
    """opacus' training loop; returns (steps taken, per-epoch metrics)."""
    x_test, y_test = federation.test_arrays()
    rounds, done = [], 0
    for epoch in epochs:
        total, count = 0.0, 0
        for xb, yb in dp_loader:
            xb, yb = xb.to(device), yb.to(device)
            dp_opt.zero_grad(set_to_none=True)
            if len(yb):  # an empty Poisson batch still takes a (noise-only) step
                loss = loss_fn(private(xb), yb)
                loss.backward()
                total, count = total + float(loss.detach()) * len(yb), count + len(yb)
            dp_opt.step()
            done += 1
        rounds.append({"round": epoch, "test_accuracy": accuracy(model, x_test, y_test, device),
                       "loss": total / max(count, 1), "steps": done})
    return done, rounds


# method "dpsgd": config and registration in privkit.methods.dpsgd
def train_dpsgd(federation, config: DpsgdConfig, seed: int, progress: bool = False) -> TrainResult:
    """Centralised DP-SGD with opacus; see the module docstring for the ledger."""
    from opacus import PrivacyEngine

    from accountants import Ledger, calibrate_noise_multiplier, dpsgd_epsilon, dpsgd_event

    device = resolve_device(config)
    x, y = federation.pooled_arrays()
    if len(y) < config.batch_size:
        raise PrivkitError(f"batch_size must be <= the pooled data size {len(y)}; found {config.batch_size}")
    model, spec = new_model(federation, config, derive_seed(seed, "init"))
    model.to(device).train()
    batches = noise_generator(seed, "poisson", reproducible=config.reproducible_noise)
    noise = noise_generator(seed, "noise", reproducible=config.reproducible_noise, device=device)
    # reproducible mode: opacus draws from the seeded torch generators itself; release mode: both
    # streams are privkit's AES stream, swapped in after make_private (privkit.trainers.opacus_streams)
    loader = _loader(x, y, config.batch_size, batches.source if batches.seeded_torch else None)
    # opacus's DPDataLoader samples each record with rate 1 / (batches per epoch)
    sample_rate = 1.0 / len(loader)
    steps = config.epochs * len(loader)
    notes: list[str] = []
    if config.noise_multiplier is None:
        cal = calibrate_noise_multiplier(config.target_epsilon, config.delta, sample_rate, steps,
                                         accountant=config.calibration_accountant)
        sigma = cal.noise_multiplier
        notes.append(f"noise multiplier {sigma:.5g} calibrated for epsilon <= {config.target_epsilon:g} at "
                     f"delta={config.delta:g} ({config.calibration_accountant}; re-checked epsilon "
                     f"{cal.epsilon:.5g}) for q={sample_rate:.5g}, {steps} steps")
    else:
        sigma = float(config.noise_multiplier)
        notes.append(f"noise multiplier {sigma:g} given; target_epsilon not used")

    optimizer = make_optimizer(model.parameters(), config.optimizer, config.lr)
    with _warnings.catch_warnings():
        # opacus warns that secure_mode=False; privkit supplies the streams itself (AES-CTR keyed
        # from the OS in release mode, see privkit.seeding), since opacus's secure mode needs torchcsprng.
        _warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
        engine = PrivacyEngine(accountant="rdp")
        private, dp_opt, dp_loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma,
            max_grad_norm=config.clip_norm, poisson_sampling=True,
            noise_generator=noise.source if noise.seeded_torch else None)
    if abs(dp_loader.sample_rate - sample_rate) > 1e-12:
        raise PrivkitError(f"opacus sample rate {dp_loader.sample_rate} differs from the accounted {sample_rate}")
    if not noise.seeded_torch:
        dp_loader = secret_poisson_loader(dp_loader, batches)
        use_noise_source(dp_opt, noise)

    epochs = range(1, config.epochs + 1)
    if progress:
        from rich.progress import track

        epochs = track(epochs, description="dpsgd epochs")
    loss_fn = torch.nn.CrossEntropyLoss()
    with _warnings.catch_warnings():
        # opacus' hooks on the first layer: inputs need no grad; harmless, one line per step
        _warnings.filterwarnings("ignore", message="Full backward hook is firing")
        done, rounds = _run_epochs(private, dp_opt, dp_loader, loss_fn, epochs, model, federation, device)
    if done != steps:
        raise PrivkitError(f"ran {done} DP-SGD steps but accounted {steps}")

    event = dpsgd_event(sample_rate, sigma, steps)
    ledger = Ledger()
    for k in range(federation.num_clients):
        ledger.add(k, event, "dp-sgd (pooled data)")
    released, _ = new_model(federation, config, 0)
    released.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    warns = notes + [
        ("Record-level DP over the pooled data (add/remove-one neighbours, Poisson sampling as run by "
        "opacus' DPDataLoader); every client's ledger holds the same event, as every record is "
        "protected alike. Centralised training assumes a trusted curator who sees all records.")]
    claims = {"noise_multiplier": sigma, "sample_rate": sample_rate, "steps": steps, "delta": config.delta,
              "target_epsilon": config.target_epsilon if config.noise_multiplier is None else None,
              "source": "DP-SGD (Abadi et al. 2016), accounted by privkit"}
    for row in rounds:  # epsilon after each epoch, by the accountant the calibration uses
        row["sigma"] = sigma
        row["epsilon"] = dpsgd_epsilon(sample_rate, sigma, row["steps"], config.delta,
                                       accountant=config.calibration_accountant)
    x_test, y_test = federation.test_arrays()
    return TrainResult(method="dpsgd", seed=seed, config=config.model_dump(), model=released, model_spec=spec,
                       ledger=ledger, rounds=rounds, test_accuracy=accuracy(released, x_test, y_test, device),
                       warnings=warns, claims=claims)


def _sigma(config: DpsgdConfig, sample_rate: float, steps: int) -> float:
    """The noise multiplier ``train_dpsgd`` uses: given, or calibrated for exactly (q, steps)."""
    from accountants import calibrate_noise_multiplier

    if config.noise_multiplier is not None:
        return float(config.noise_multiplier)
    return calibrate_noise_multiplier(config.target_epsilon, config.delta, sample_rate, steps,
                                      accountant=config.calibration_accountant).noise_multiplier


def dpsgd_recipe(config: DpsgdConfig, n: int):
    """The :class:`~privkit.trainers.batched_sgd.SGDRecipe` running ``train_dpsgd``'s mechanism on
    ``n`` records: Poisson rate ``1 / ceil(n / batch_size)`` (opacus' ``DPDataLoader``),
    ``epochs * ceil(n / batch_size)`` steps, the same noise multiplier, clip norm, optimiser and lr."""
    from dataclasses import replace

    from privkit.trainers.batched_sgd import SGDRecipe

    if n < config.batch_size:
        raise PrivkitError(f"batch_size must be <= the pooled data size {n}; found {config.batch_size}")
    recipe = SGDRecipe(epochs=config.epochs, batch_size=config.batch_size, lr=config.lr, clip=config.clip_norm,
                       sampling="poisson", optimizer=config.optimizer)
    sigma = _sigma(config, recipe.sample_rate(n), recipe.steps(n))
    return replace(recipe, noise_multiplier=sigma)


def train_dpsgd_many(federation, config: DpsgdConfig | dict, indices: list, seeds: list[int],
                     device: str = "cpu") -> list[torch.nn.Module]:
    """M dpsgd models at once: model j is DP-SGD on ``federation.private[indices[j]]`` with seed
    ``seeds[j]`` (its initialisation is ``train_dpsgd``'s for that seed; sampling and noise secret
    unless ``reproducible_noise``). Returns CPU models."""
    import numpy as np

    from privkit.trainers.base import make_config
    from privkit.trainers.batched_sgd import load_states, train_many

    cfg = make_config("dpsgd", config)
    sizes = sorted({len(ix) for ix in indices})
    groups = {n: [j for j, ix in enumerate(indices) if len(ix) == n] for n in sizes}
    _, spec = new_model(federation, cfg, 0)
    out: list = [None] * len(indices)
    for n, members in groups.items():  # one recipe (noise multiplier) per data size
        recipe = dpsgd_recipe(cfg, n)
        states = train_many(spec, federation.private.x, federation.private.y,
                            [np.asarray(indices[j]) for j in members], recipe,
                            [derive_seed(seeds[j], "init") for j in members], device=device,
                            reproducible=cfg.reproducible_noise)
        for j, model in zip(members, load_states(spec, states)):
            out[j] = model
    return out
