"""Configuration checks before anything runs: what will run against what will be accounted.

:func:`check_training` reads an opacus ``PrivacyEngine`` / ``DPOptimizer`` / data loader, a torch
``DataLoader`` and its sampler, a torch model, and a Flower ``LocalDpMod``, ``ClientApp`` or
strategy, and returns one :class:`Finding` per mismatch, each with the epsilon that holds where
privkit can compute it.  ``privkit check SCRIPT.py`` runs it on the objects a script builds.

torch, opacus and Flower are imported only when an object of theirs is given.
"""

from __future__ import annotations

from typing import Any

from privkit.check.findings import Finding, TrainingCheck

__all__ = ["Finding", "TrainingCheck", "check_training"]


def _validated(
    delta: float,
    steps: int | None,
    epochs: int | None,
    noise_multiplier: float | None,
    sample_rate: float | None,
    neighbouring: str,
) -> tuple[float, int | None, int | None, float | None, float | None]:
    from accountants._validate import check_choice, check_int, check_open_unit, check_positive
    from accountants.dpsgd import NEIGHBOURINGS

    delta = check_open_unit(delta, "delta")
    if steps is not None and epochs is not None:
        raise ValueError(
            f"give at most one of steps or epochs; found steps={steps!r} and epochs={epochs!r}"
        )
    steps = None if steps is None else check_int(steps, "steps")
    epochs = None if epochs is None else check_int(epochs, "epochs")
    if noise_multiplier is not None:
        noise_multiplier = check_positive(noise_multiplier, "noise_multiplier")
    if sample_rate is not None:
        sample_rate = check_positive(sample_rate, "sample_rate")
        if sample_rate > 1:
            raise ValueError(f"sample_rate must be in (0, 1]; found {sample_rate!r}")
    check_choice(neighbouring, "neighbouring", tuple(NEIGHBOURINGS))
    return delta, steps, epochs, noise_multiplier, sample_rate


def check_training(
    *objects: Any,
    delta: float,
    steps: int | None = None,
    epochs: int | None = None,
    noise_multiplier: float | None = None,
    sample_rate: float | None = None,
    release: bool = False,
    neighbouring: str = "replace_one",
) -> TrainingCheck:
    """Every mismatch between what a training configuration will run and what it will account.

    Parameters
    ----------
    *objects : object
        opacus ``PrivacyEngine``, ``DPOptimizer``, ``GradSampleModule`` and ``DPDataLoader``
        (e.g. ``*engine.make_private(...)``), torch ``DataLoader`` and ``nn.Module``, Flower
        ``LocalDpMod``, ``ClientApp`` and strategies; tuples and lists are opened, a dict names its
        objects by its keys.  A lone torch ``Sampler`` or plain optimizer is accepted and skipped.
    delta : float
        Delta in (0, 1) of every epsilon (a ``LocalDpMod`` is checked at its own delta).
    steps : int, optional
        Number of DP-SGD steps the training runs.
    epochs : int, optional
        Or the number of epochs (``epochs * len(loader)`` steps); without either, findings are
        still named but carry no epsilon.
    noise_multiplier : float, optional
        The multiplier the accountant uses; by default the DPOptimizer's.  Required for epsilons
        of a plain torch loader.
    sample_rate : float, optional
        The Poisson rate the accountant uses, where it is not opacus' own (e.g. a hand-written
        loop calling an accountant); by default the rate ``make_private`` gave opacus'
        accountant, else each loader's ``batch_size / len(dataset)``.
    release : bool
        Whether the model is for release: then opacus' ``secure_mode`` off changes the epsilon.
    neighbouring : {"replace_one", "add_remove"}
        Client-level relation of Flower's mechanisms (:mod:`privkit.flower.mechanisms`);
        ``"add_remove"`` is the zero-out relation Flower's own accountant uses.

    Returns
    -------
    TrainingCheck
        The findings; ``exit_code`` is 1 when one of them changes the epsilon.

    Raises
    ------
    ValueError
        For a bad parameter or an object of no recognised kind (the message names it).
    """
    from privkit.check.flower import flower_findings
    from privkit.check.loaders import Accounting, loader_findings, loader_steps
    from privkit.check.models import statistics_findings, unwrap
    from privkit.check.objects import KINDS, classify, flatten
    from privkit.check.opacus import noise_finding, read_opacus, secure_mode_finding

    delta, steps, epochs, noise_multiplier, sample_rate = _validated(
        delta, steps, epochs, noise_multiplier, sample_rate, neighbouring
    )
    by_kind: dict[str, list[tuple[str, Any]]] = {kind: [] for kind in KINDS}
    checked = []
    for name, obj in flatten(objects):
        kind = classify(obj)
        if kind is None:
            raise ValueError(
                "objects must be opacus (PrivacyEngine, DPOptimizer, DPDataLoader), torch "
                "(DataLoader, nn.Module) or Flower (LocalDpMod, ClientApp, strategy) objects; "
                f"found {type(obj).__name__} as {name}"
            )
        by_kind[kind].append((name, obj))
        checked.append(f"{name} ({KINDS[kind]})")
    setup = read_opacus(by_kind["engine"], by_kind["optimizer"])
    run = setup.noise_multiplier if setup.noise_multiplier is not None else noise_multiplier
    acc = Accounting(
        delta=delta,
        noise_multiplier=noise_multiplier if noise_multiplier is not None else run,
        noise_run=run,
        sample_rate=sample_rate if sample_rate is not None else setup.sample_rate,
        rate_source="the sample_rate given" if sample_rate is not None else setup.rate_source,
        steps=steps,
        epochs=epochs,
    )
    findings: list[Finding | None] = []
    if noise_multiplier is not None:
        first = by_kind["loader"][0][1] if by_kind["loader"] else None
        rate = acc.sample_rate
        if rate is None and first is not None:  # the loader's own: Poisson q, else batch / N
            rate = getattr(first.batch_sampler, "sample_rate", None)
            if rate is None and first.batch_size:
                rate = first.batch_size / len(first.dataset)
        n_steps = steps if first is None else loader_steps(first, acc)
        findings.append(noise_finding(noise_multiplier, setup, rate, n_steps, delta))
    for name, loader in by_kind["loader"]:
        findings += loader_findings(name, loader, acc)
    models = {id(unwrap(m)): (name, m) for name, m in reversed(by_kind["model"])}
    for name, m in reversed(models.values()):
        findings += statistics_findings(name, m)
    findings.append(secure_mode_finding(setup, release))
    flower = [(n, k, o) for k in ("local_dp", "client_app", "strategy") for n, o in by_kind[k]]
    if flower:
        findings += flower_findings(flower, delta, neighbouring)
    return TrainingCheck(tuple(f for f in findings if f is not None), delta, tuple(checked))
