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

Audits at the mechanism: inside an audit's :func:`privkit.mechanisms.probes.probing` block the opacus
optimizer takes the audit's canaries (mechanism label ``dp-sgd``, one probe set per probed client:
each client's records are records of the pooled data) as records of the pooled dataset: each
included canary joins each step with the loader's real sampling rate (drawn from the noise
stream), its raw gradient is clipped by opacus' own per-sample rule (``max_grad_norm``), then the
noise is added and every probe set observes the noisy sum (:func:`_take_probes_and_mutation`). An
audit's mutation (:mod:`privkit.mechanisms.mutations`) is run there too: noise std
``noise_multiplier * max_grad_norm * noise_factor``, per-sample clipping off for records and
canaries alike (the noise stays at the claimed clip norm). Outside audits nothing is installed.

Batched form: :func:`privkit.batched.many_dpsgd.train_dpsgd_runs` (the reference runs of an
audit: the same mechanism and opacus' streams, the models stacked on one axis).
"""

from __future__ import annotations

import functools
import math
import warnings as _warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from privkit.errors import PrivkitError
from privkit.mechanisms import mutations
from privkit.mechanisms.dp_random import DpRandom
from privkit.mechanisms.opacus_streams import secret_poisson_loader, use_noise_source
from privkit.methods.contract import TrainResult
from privkit.methods.dpsgd import PAPER, CentralConfig, DpsgdConfig  # noqa: F401  (re-exported)
from privkit.seeding import derive_seed, noise_generator
from privkit.trainers.common import accuracy, make_optimizer, new_model, resolve_device


def _loader(x, y, batch_size: int, generator: torch.Generator | None) -> DataLoader:
    # opacus's DPDataLoader replaces the batches by Poisson sampling drawn from this generator
    ds = TensorDataset(
        torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long)
    )
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=generator)


def _run_epochs(
    private, dp_opt, dp_loader, loss_fn, epochs, model, federation, device
) -> tuple[int, list[dict]]:
    """opacus' training loop; returns (steps taken, per-epoch metrics)."""
    x_test, y_test = federation.test_arrays()
    rounds, done = [], 0
    for epoch in epochs:
        total, count = 0.0, 0
        for xb, yb in dp_loader:
            xb, yb = xb.to(device), yb.to(device)
            dp_opt.zero_grad(set_to_none=True)
            if len(yb):
                loss = loss_fn(private(xb), yb)
                loss.backward()
                total, count = total + float(loss.detach()) * len(yb), count + len(yb)
            else:
                # an empty Poisson batch still takes a (noise-only) step, as the accountant counts:
                # opacus steps only once a backward pass has set the (here zero-length) per-sample
                # gradients; any function of no records gives them, the sum avoids the mean's 0 / 0
                private(xb).sum().backward()
            dp_opt.step()
            done += 1
        rounds.append(
            {
                "round": epoch,
                "test_accuracy": accuracy(model, x_test, y_test, device),
                "loss": total / max(count, 1),
                "steps": done,
            }
        )
    return done, rounds


@functools.lru_cache(maxsize=256)
def _calibrated(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str):
    """:func:`accountants.calibrate_noise_multiplier` for Poisson sampling, remembered: a pure
    function of its arguments (a root search over accountants' epsilons), which an audit asks
    once per run with the same arguments: 17 searches, 0.13 s of a 6 s DP-SGD audit."""
    from accountants import calibrate_noise_multiplier

    return calibrate_noise_multiplier(epsilon, delta, sample_rate, steps, accountant=accountant)


def _plan(federation, config: DpsgdConfig) -> tuple[float, int, float, list[str]]:
    """What ``train_dpsgd`` fixes before training: opacus' sample rate (1 / batches per epoch),
    the steps, the noise multiplier (given or calibrated for exactly them) and the notes."""
    n = len(federation.members)  # the pooled records' count, without gathering them
    if n < config.batch_size:
        raise PrivkitError(
            f"batch_size must be <= the pooled data size {n}; found {config.batch_size}"
        )
    batches = math.ceil(n / config.batch_size)  # len() of the DataLoader opacus replaces
    sample_rate = (
        1.0 / batches
    )  # opacus's DPDataLoader samples each record with rate 1 / (batches per epoch)
    steps = config.epochs * batches
    if config.noise_multiplier is None:
        cal = _calibrated(
            config.target_epsilon, config.delta, sample_rate, steps, config.calibration_accountant
        )
        return (
            sample_rate,
            steps,
            cal.noise_multiplier,
            [
                f"noise multiplier {cal.noise_multiplier:.5g} calibrated for epsilon <= {config.target_epsilon:g} at "
                f"delta={config.delta:g} ({config.calibration_accountant}; re-checked epsilon "
                f"{cal.epsilon:.5g}) for q={sample_rate:.5g}, {steps} steps"
            ],
        )
    sigma = float(config.noise_multiplier)
    return sample_rate, steps, sigma, [f"noise multiplier {sigma:g} given; target_epsilon not used"]


# method "dpsgd": config and registration in privkit.methods.dpsgd
def train_dpsgd(federation, config: DpsgdConfig, seed: int, progress: bool = False) -> TrainResult:
    """Centralised DP-SGD with opacus; see the module docstring for the ledger."""
    from opacus import PrivacyEngine

    device = resolve_device(config)
    x, y = federation.pooled_arrays()
    sample_rate, steps, sigma, notes = _plan(federation, config)
    model, spec = new_model(federation, config, derive_seed(seed, "init"))
    model.to(device).train()
    batches = noise_generator(seed, "poisson", reproducible=config.reproducible_noise)
    noise = noise_generator(seed, "noise", reproducible=config.reproducible_noise, device=device)
    # reproducible mode: opacus draws from the seeded torch generators itself; release mode: both
    # streams are privkit's AES stream, swapped in after make_private (privkit.mechanisms.opacus_streams)
    loader = _loader(x, y, config.batch_size, batches.source if batches.seeded_torch else None)  # type: ignore[arg-type]  # seeded_torch: a torch generator
    if abs(1.0 / len(loader) - sample_rate) > 1e-15:
        raise PrivkitError(
            f"loader has {len(loader)} batches per epoch; the plan assumed {1 / sample_rate:g}"
        )

    optimizer = make_optimizer(model.parameters(), config.optimizer, config.lr)
    with _warnings.catch_warnings():
        # opacus warns that secure_mode=False; privkit supplies the streams itself (AES-CTR keyed
        # from the OS in release mode, see privkit.seeding), since opacus's secure mode needs torchcsprng.
        _warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
        engine = PrivacyEngine(accountant="rdp")
        private, dp_opt, dp_loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=config.clip_norm,
            poisson_sampling=True,
            noise_generator=noise.source if noise.seeded_torch else None,
        )
    if abs(dp_loader.sample_rate - sample_rate) > 1e-12:
        raise PrivkitError(
            f"opacus sample rate {dp_loader.sample_rate} differs from the accounted {sample_rate}"
        )
    real_rate = (
        dp_loader.sample_rate
    )  # the rate its batches are drawn with (opacus' or privkit's loader)
    if not noise.seeded_torch:
        dp_loader = secret_poisson_loader(dp_loader, batches)
    dp_opt.privkit_sample_rate = sample_rate  # the rate each step's receipt states
    receipts = use_noise_source(dp_opt, noise)
    dim = sum(int(p.numel()) for p in dp_opt.params)
    probes = probe_sets(dim, federation.num_clients, config.clip_norm, sample_rate, sigma)
    _take_probes_and_mutation(dp_opt, probes, mutations.active(), noise, real_rate)

    epochs: Iterable[int] = range(1, config.epochs + 1)
    if progress:
        from rich.progress import track

        epochs = track(epochs, description="dpsgd epochs")
    loss_fn = torch.nn.CrossEntropyLoss()
    with _warnings.catch_warnings():
        # opacus' hooks on the first layer: inputs need no grad; harmless, one line per step
        _warnings.filterwarnings("ignore", message="Full backward hook is firing")
        done, rounds = _run_epochs(
            private, dp_opt, dp_loader, loss_fn, epochs, model, federation, device
        )
    if done != steps:
        raise PrivkitError(f"ran {done} DP-SGD steps but accounted {steps}")
    released, _ = new_model(federation, config, 0)
    released.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return dpsgd_result(
        federation,
        config,
        seed,
        released,
        spec,
        rounds,
        (sample_rate, steps, sigma, notes),
        device,
        receipts=receipts,
    )


def dpsgd_result(
    federation,
    config: DpsgdConfig,
    seed: int,
    released,
    spec: dict,
    rounds: list[dict],
    plan: tuple[float, int, float, list[str]],
    device,
    *,
    receipts: list,
) -> TrainResult:
    """``train_dpsgd``'s :class:`TrainResult` for the released model, the per-epoch rows (round,
    test accuracy, loss, steps) and the :func:`_plan` that ran; its ledger records the composition
    of ``receipts``, the receipts of the releases that ran (opacus' steps', or the batched
    form's, :mod:`privkit.batched.many_dpsgd`), never an event rebuilt from the plan.

    Parameters
    ----------
    federation : Federation
        The federation the run trained on (pooled); every client's ledger holds the event.
    config : DpsgdConfig
        The run's config.
    seed : int
        The run's seed.
    released : torch.nn.Module
        The released model (on the CPU).
    spec : dict
        Its model spec.
    rounds : list[dict]
        The per-epoch rows (round, test accuracy, loss, steps); each gains its sigma and epsilon.
    plan : tuple
        ``(sample_rate, steps, sigma, notes)`` of :func:`_plan`.
    device : torch.device
        Where the test accuracy is computed.
    receipts : list of Receipt
        One per release that ran, in order (at least one).
    """
    from accountants import Ledger, dpsgd_epsilon
    from privkit.mechanisms.gaussian import compose_receipts

    sample_rate, steps, sigma, notes = plan
    event = compose_receipts(receipts)  # what ran, never the plan in its place
    ledger = Ledger()
    for k in range(federation.num_clients):
        ledger.add(k, event, "dp-sgd (pooled data)")
    warns = notes + [
        (
            "Record-level DP over the pooled data (add/remove-one neighbours, Poisson sampling as run by "
            "opacus' DPDataLoader); every client's ledger holds the same event, as every record is "
            "protected alike. Centralised training assumes a trusted curator who sees all records."
        )
    ]
    claims = {
        "noise_multiplier": sigma,
        "sample_rate": sample_rate,
        "steps": steps,
        "delta": config.delta,
        "target_epsilon": config.target_epsilon if config.noise_multiplier is None else None,
        "source": "DP-SGD (Abadi et al. 2016), accounted by privkit",
    }
    for row in rounds:  # epsilon after each epoch, by the accountant the calibration uses
        row["sigma"] = sigma
        row["epsilon"] = dpsgd_epsilon(
            sample_rate, sigma, row["steps"], config.delta, accountant=config.calibration_accountant
        )
    x_test, y_test = federation.test_arrays()
    return TrainResult(
        method="dpsgd",
        seed=seed,
        config=config.model_dump(),
        model=released,
        model_spec=spec,
        ledger=ledger,
        rounds=rounds,
        test_accuracy=accuracy(released, x_test, y_test, device),
        warnings=warns,
        claims=claims,
    )


def probe_sets(
    dim: int, num_clients: int, clip_norm: float, sample_rate: float, sigma: float
) -> list:
    """The audit canaries the pooled mechanism must take (:func:`privkit.mechanisms.probes.canaries_for`,
    label ``dp-sgd``): one probe set per probed client, as every client's ledger holds the
    mechanism's entry; none outside an audit.

    Parameters
    ----------
    dim : int
        The number of trainable parameters (the optimizer's, in its order).
    num_clients : int
        The federation's clients (each one's records are records of the pooled data).
    clip_norm : float
        The claimed clip norm (opacus' ``max_grad_norm``).
    sample_rate : float
        The claimed Poisson rate of the pooled mechanism.
    sigma : float
        The claimed noise multiplier.
    """
    from privkit.mechanisms.probes import canaries_for

    sets = [
        canaries_for(
            k,
            "dp-sgd",
            dim=dim,
            clip_norm=clip_norm,
            sample_rate=sample_rate,
            noise_multiplier=sigma,
        )
        for k in range(num_clients)
    ]
    return [c for c in sets if c is not None]


def _opacus_clip_factor(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """opacus' per-sample clipping factor (``DPOptimizer.clip_and_accumulate``)."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def _mask(source: DpRandom, n: int, rate: float) -> torch.Tensor:
    """``n`` Bernoulli(``rate``) draws from ``source`` as a CPU bool tensor (a seeded torch
    generator on an accelerator draws there: torch cannot draw on the CPU from it)."""
    gen: Any = source.source  # a torch generator when seeded_torch
    if source.seeded_torch and gen.device.type != "cpu":
        return (torch.rand(n, generator=gen, device=gen.device) < rate).cpu()
    return source.mask(n, rate=rate)


def _summed_additions(
    added: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe sets' sparse additions summed coordinate by coordinate, in the sets' order (as their
    dense vectors add: ``0 + a_1 + a_2 + ...``); empty when there are none."""
    if not added:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    coords = torch.cat([c for c, _ in added])
    at, where = torch.unique(coords, return_inverse=True)
    return at, torch.zeros(at.numel()).index_add_(0, where, torch.cat([v for _, v in added]))


def _take_probes_and_mutation(
    dp_opt, probes: list, mutation, noise: DpRandom, sample_rate: float
) -> None:
    """Make the opacus ``DPOptimizer`` ``dp_opt`` take an audit's canaries and run its mutation.

    Per step, in ``add_noise`` (after opacus clipped and summed the batch into ``summed_grad``):
    each probe set's included canaries are sampled at ``sample_rate`` from the noise stream, their
    raw gradients (norm ``raw_norm``) clipped by opacus' rule and added to ``summed_grad``; then the
    noise is added (by privkit's release primitive, :func:`use_noise_source`, which draws
    ``noise_factor`` times the claimed std), and each probe set observes the
    released sum, its clean sum being the records' clipped sum plus the *other* sets' canaries
    (records of other clients, to it). With clipping off, opacus clips neither records nor
    canaries (``max_grad_norm`` is infinite while it clips, the claimed one when it draws noise).
    Installs nothing when there is nothing to do, so a run outside audits is opacus' own.
    """
    if not probes and mutation.clipping:  # the noise factor acts in the release primitive
        return
    params = list(dp_opt.params)
    clip = dp_opt.max_grad_norm if mutation.clipping else math.inf
    if not mutation.clipping:
        clip_and_accumulate = dp_opt.clip_and_accumulate

        def unclipped() -> None:
            claimed = dp_opt.max_grad_norm
            dp_opt.max_grad_norm = math.inf  # opacus' factor min(1, inf / (norm + 1e-6)) is 1
            try:
                clip_and_accumulate()
            finally:
                dp_opt.max_grad_norm = claimed

        dp_opt.clip_and_accumulate = unclipped

    add_noise = dp_opt.add_noise  # opacus' own, or privkit's stream (use_noise_source)

    def probed_add_noise() -> None:
        # in place (opacus has marked summed_grad as processed), taken out after the release
        step = ProbedStep(probes, noise, sample_rate, clip, [p.summed_grad for p in params])
        add_noise()  # privkit's release primitive: it scales the noise by the mutation's factor
        step.observe([p.grad for p in params])

    dp_opt.add_noise = probed_add_noise


class ProbedStep:
    """One step of the pooled mechanism taking an audit's probe sets (opacus' rule): built before
    the release, it samples each set's included canaries at ``sample_rate`` from the noise stream,
    clips their raw gradients by opacus' rule at ``clip`` and adds them in place to ``summed``
    (the step's clipped sum, in the parameters' order); :meth:`observe` takes them out again and
    lets each set observe the release, its clean sum being the records' clipped sum plus the
    *other* sets' canaries (records of other clients, to it). Shared by the single run and its
    batched form (:mod:`privkit.batched.many_dpsgd`).

    Parameters
    ----------
    probes : list of attacks.whitebox.GradientCanaries
        The probe sets (:func:`probe_sets`), in order; none: nothing is drawn or added.
    noise : DpRandom
        The step's noise stream: the canaries' sampling is drawn from it, before the noise.
    sample_rate : float
        The rate the mechanism's batches are drawn with.
    clip : float
        The clip norm opacus clips with (``inf``: clipping switched off by an audit's mutation).
    summed : list of torch.Tensor
        The step's clipped sum, one tensor per parameter; modified in place until
        :meth:`observe`.
    """

    def __init__(
        self,
        probes: list,
        noise: DpRandom,
        sample_rate: float,
        clip: float,
        summed: list[torch.Tensor],
    ):
        from attacks.whitebox import add_in_place

        self.probes, self.summed = probes, summed
        self.added: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # each probe set's (flat coordinates, values): its sampled canaries only
        for can in probes:
            raw = torch.full((len(can.included_ids),), can.raw_norm)
            weights = (
                _mask(noise, len(can.included_ids), sample_rate).to(torch.float32)
                * _opacus_clip_factor(raw, clip)
                * raw
            )
            self.added.append(can.sparse_addition(weights))
        self._restore = add_in_place(summed, *_summed_additions(self.added))

    def observe(self, released: list[torch.Tensor]) -> None:
        """Take the canaries out of the clipped sum (bit for bit) and let each probe set observe
        ``released``, the step's noisy sum (the parameters' order)."""
        from attacks.whitebox import add_at

        self._restore()
        for i, can in enumerate(self.probes):
            others = _summed_additions([a for j, a in enumerate(self.added) if j != i])
            can.observe(released, clean=add_at(self.summed, *others))
