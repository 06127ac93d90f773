"""``privkit check``: what a training script will run against what it will account (:mod:`privkit.check`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import typer

from privkit.cli.app import app, print_json
from privkit.cli.budget import JSON_OPT, _int, _num, _num_opt


@app.command("check")
def check(
    script: Path = typer.Argument(
        ..., help="Python file that builds the training objects (its __main__ block does not run)."
    ),
    call: str | None = typer.Option(
        None,
        "--call",
        help="Zero-argument function of SCRIPT returning the objects (else its module globals).",
        metavar="FUNCTION",
    ),
    delta_: str = _num_opt(..., "--delta", "Delta in (0, 1) of every epsilon."),  # type: ignore[arg-type]  # ...: typer's required option
    steps_: str | None = _num_opt(None, "--steps", "DP-SGD steps the training runs.", "INT"),
    epochs_: str | None = _num_opt(
        None, "--epochs", "Or epochs (epochs x len(loader) steps).", "INT"
    ),
    noise_: str | None = _num_opt(
        None, "--noise-multiplier", "Multiplier the accountant uses (default: the DPOptimizer's)."
    ),
    rate_: str | None = _num_opt(
        None, "--sample-rate", "Poisson rate the accountant uses (default: opacus' own)."
    ),
    release: bool = typer.Option(
        False, "--release", help="The model is for release: secure_mode off changes the epsilon."
    ),
    neighbouring: str = typer.Option(
        "replace_one", "--neighbouring", help="replace_one | add_remove: Flower's client relation."
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Name every mismatch between what SCRIPT will run and what it will account, one line each.

    Exit code 1 when a finding changes the epsilon, 0 otherwise, 2 for bad input.
    """
    from accountants._validate import check_choice, check_open_unit, check_positive

    # every option is checked before SCRIPT runs
    delta = check_open_unit(cast(float, _num(delta_, "--delta")), "--delta")  # required: not None
    steps, epochs = _int(steps_, "--steps"), _int(epochs_, "--epochs")
    if steps is not None and epochs is not None:
        raise ValueError(
            f"give at most one of --steps or --epochs; found {steps_!r} and {epochs_!r}"
        )
    noise, rate = _num(noise_, "--noise-multiplier"), _num(rate_, "--sample-rate")
    if noise is not None:
        check_positive(noise, "--noise-multiplier")
    if rate is not None and not 0 < rate <= 1:
        raise ValueError(f"--sample-rate must be in (0, 1]; found {rate_!r}")
    check_choice(neighbouring, "--neighbouring", ("replace_one", "add_remove"))
    from privkit.check import check_training
    from privkit.check.script import objects_from_script

    objects, skipped = objects_from_script(script, call)
    result = check_training(
        objects,
        delta=delta,
        steps=steps,
        epochs=epochs,
        noise_multiplier=noise,
        sample_rate=rate,
        release=release,
        neighbouring=neighbouring,
    )
    if as_json:
        print_json({"script": str(script), **result.to_dict(), "skipped": skipped})
    else:
        for line in skipped:
            sys.stderr.write(f"skipped: {line}\n")
        sys.stdout.write("\n".join(result.lines()) + "\n")
    raise typer.Exit(result.exit_code)
