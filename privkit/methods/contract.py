"""The trainer contract: a pure function of (federation, config, seed) -> :class:`TrainResult`.

A trainer never computes an epsilon itself: every time a mechanism touches a client's private data
it appends an event to the result's :class:`accountants.Ledger`. The result carries the released
model(s) (what audits attack), per-round metrics, and any artifact a client shares with the server
(scores, heads, soft labels, distilled samples), so audits can attack those too.

The config models and the registry live in :mod:`privkit.methods` (torch-free, re-exported here);
this module imports torch only to save or load checkpoints, so that validating a run stays fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from privkit.errors import PrivkitError
from privkit.methods import get_trainer, make_config
from privkit.methods.base import TrainerConfig
from privkit.methods.registry import (  # noqa: F401  (re-exported from their former home)
    REGISTRY,
    TrainerFn,
    TrainerSpec,
    register_trainer,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from accountants import Ledger
    from privkit.data import Federation

SCHEMA_VERSION = 1


@dataclass
class TrainResult:
    """What a trainer returns.

    Attributes
    ----------
    method : str
        The registered method that trained it.
    seed : int
        The run seed.
    config : dict
        The method's full trainer config (JSON-able).
    model : torch.nn.Module
        The released global model (the default audit target).
    model_spec : dict
        JSON spec rebuilding ``model``'s architecture (:func:`privkit.models.build_from_spec`).
    ledger : accountants.Ledger
        Every privacy event, per client, with labels.
    rounds : list of dict
        Per-round metrics, each a dict with at least ``round`` and ``test_accuracy``.
    test_accuracy : float
        The released model's final test accuracy, as a fraction.
    artifacts : dict of str to numpy.ndarray
        Arrays a client shared with the server, keyed ``"<name>"`` or ``"<name>/client_<i>"``.
    client_models : list of torch.nn.Module
        Personalised or per-party models that are released too.
    client_model_specs : list of dict
        The spec of each of ``client_models``.
    client_accuracy : list of float
        The test accuracy of each of ``client_models``.
    warnings : list of str
        Caveats a reviewer must see (data-dependent choices, sampling mismatches, ...).
    claims : dict
        The paper's own privacy claim for this method, e.g.
        ``{"epsilon": 0.6, "delta": 2e-5, "composition": "basic", "source": "FedAUXfdp Table 2"}``.
    reproducible_noise : bool
        True when the DP noise was derived from the run seed (not for release).
    chance_accuracy : float
        The test accuracy of a constant guess (NaN until :meth:`check_chance` sets it).
    """

    method: str
    seed: int
    config: dict
    model: torch.nn.Module
    model_spec: dict
    ledger: Ledger
    rounds: list[dict] = field(default_factory=list)
    test_accuracy: float = float("nan")
    artifacts: dict[str, np.ndarray] = field(default_factory=dict)
    client_models: list[torch.nn.Module] = field(default_factory=list)
    client_model_specs: list[dict] = field(default_factory=list)
    client_accuracy: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    claims: dict = field(default_factory=dict)
    reproducible_noise: bool = (
        False  # True: DP noise derived from the stored seed ("not for release")
    )
    chance_accuracy: float = float("nan")

    @property
    def near_chance(self) -> bool:
        """True when the final test accuracy is at or near chance (:mod:`privkit.methods.chance`)."""
        from privkit.methods.chance import chance_warning

        return (
            chance_warning(self.method, float(self.test_accuracy), self.chance_accuracy) is not None
        )

    def check_chance(self, federation) -> None:
        """Record the federation's chance accuracy (unless the trainer set its own, e.g. a test set
        restricted to some classes) and add the near-chance warning if it applies."""
        import math

        from privkit.methods.chance import chance_level, chance_warning

        if math.isnan(self.chance_accuracy):
            self.chance_accuracy = chance_level(federation)
        w = chance_warning(self.method, float(self.test_accuracy), self.chance_accuracy)
        if w is not None and w not in self.warnings:
            self.warnings.insert(0, w)

    # ------------------------------------------------------------------ persistence
    def metrics(self) -> dict:
        """``metrics.json``: accuracies, rounds, and the utility warnings (near chance)."""
        from privkit.methods.chance import near_chance_threshold

        chance = float(self.chance_accuracy)
        return {
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "seed": self.seed,
            "test_accuracy": float(self.test_accuracy),
            "rounds": self.rounds,
            "client_accuracy": [float(a) for a in self.client_accuracy],
            "chance_accuracy": chance,
            "near_chance_threshold": near_chance_threshold(chance),
            "near_chance": self.near_chance,
            "warnings": [w for w in self.warnings if w.startswith("near-chance accuracy")],
        }

    def save(self, run_dir: str | Path) -> Path:
        """Write checkpoints, ``ledger.json``, ``metrics.json``, ``train.json``, ``artifacts.npz``."""
        import torch

        from privkit.files import write_json, write_text, write_with

        out = Path(run_dir)
        ckpt = out / "checkpoints"
        for name, m in [("model.pt", self.model)] + [
            (f"client_{i}.pt", m) for i, m in enumerate(self.client_models)
        ]:
            state = {k: v.detach().cpu() for k, v in m.state_dict().items()}
            write_with(ckpt / name, lambda buf, state=state: torch.save(state, buf))  # type: ignore[misc]
        write_text(out / "ledger.json", json.dumps(self.ledger.to_dict(), indent=2) + "\n")
        write_json(out / "metrics.json", self.metrics())
        if self.artifacts:
            write_with(
                out / "artifacts.npz",
                lambda buf: np.savez_compressed(buf, **self.artifacts),  # type: ignore[arg-type]  # numpy's stub
            )
        meta = {
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "seed": self.seed,
            "config": self.config,
            "model_spec": self.model_spec,
            "client_model_specs": self.client_model_specs,
            "warnings": self.warnings,
            "claims": self.claims,
            "reproducible_noise": self.reproducible_noise,
        }
        write_json(out / "train.json", meta)  # last: its presence means a finished run
        return out

    @classmethod
    def load(cls, run_dir: str | Path) -> TrainResult:
        from accountants import Ledger
        from privkit.files import checked, read_json
        from privkit.models import build_from_spec

        out = Path(run_dir)
        meta_path = out / "train.json"
        if not meta_path.is_file():
            raise PrivkitError(
                f"no trained model in {out}: {meta_path.name} not found (run `privkit train` first)"
            )
        meta = read_json(meta_path, "training record")
        metrics = read_json(out / "metrics.json", "metrics file")
        model = _load_checkpoint(
            build_from_spec(meta["model_spec"]), out / "checkpoints" / "model.pt"
        )
        clients = [
            _load_checkpoint(build_from_spec(spec), out / "checkpoints" / f"client_{i}.pt")
            for i, spec in enumerate(meta.get("client_model_specs", []))
        ]
        artifacts = {}
        if (out / "artifacts.npz").is_file():
            try:
                with np.load(checked(out / "artifacts.npz", "artifacts file")) as data:
                    artifacts = {k: data[k] for k in data.files}
            except (OSError, ValueError, EOFError) as exc:
                raise PrivkitError(
                    f"artifacts file {out / 'artifacts.npz'} is unreadable or "
                    f"corrupted ({type(exc).__name__}); re-run `privkit train`"
                ) from None
        return cls(
            method=meta["method"],
            seed=meta["seed"],
            config=meta["config"],
            model=model,
            model_spec=meta["model_spec"],
            ledger=Ledger.load(checked(out / "ledger.json", "ledger file")),
            rounds=metrics["rounds"],
            test_accuracy=metrics["test_accuracy"],
            artifacts=artifacts,
            client_models=clients,
            client_model_specs=meta.get("client_model_specs", []),
            client_accuracy=metrics.get("client_accuracy", []),
            warnings=meta.get("warnings", []),
            claims=meta.get("claims", {}),
            chance_accuracy=float(metrics.get("chance_accuracy", float("nan"))),
            reproducible_noise=bool(meta.get("reproducible_noise", False)),
        )


def _load_checkpoint(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """Load ``path`` into ``model``; a missing, truncated or foreign file is one error naming it."""
    import pickle
    import zipfile

    import torch

    from privkit.files import checked

    if not path.is_file():
        raise PrivkitError(f"checkpoint not found: {path} (run `privkit train` first)")
    checked(path, "checkpoint")
    try:
        state = torch.load(path, weights_only=True)
    except (
        RuntimeError,
        OSError,
        EOFError,
        ValueError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
    ) as exc:
        # torch reports truncation and garbage as RuntimeError/UnpicklingError with paragraphs of
        # advice about weights_only that do not apply here: the file itself is damaged
        raise PrivkitError(
            f"checkpoint {path} is unreadable or corrupted ({type(exc).__name__}); "
            "re-run `privkit train`"
        ) from None
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:120]
        raise PrivkitError(
            f"checkpoint {path} does not match the model in train.json "
            f"({type(exc).__name__}: {first}); re-run `privkit train`"
        ) from None
    return model


def train(
    method: str,
    federation: Federation,
    config: dict | TrainerConfig | None = None,
    seed: int = 0,
    progress: bool = False,
) -> TrainResult:
    """Run ``method`` on ``federation``; same (federation, config, seed) -> same result.

    Parameters
    ----------
    method : str
        A registered method (:data:`privkit.methods.REGISTRY`).
    federation : Federation
        The clients' data, public data and test set (:func:`privkit.data.build_federation`).
    config : dict or TrainerConfig, optional
        The method's config or overrides of its defaults (None: the defaults).
    seed : int
        The run seed.
    progress : bool
        Show a progress bar.

    Returns
    -------
    TrainResult
    """
    spec = get_trainer(method)
    cfg = make_config(method, config)
    result = spec.fn(federation, cfg, seed, progress=progress)
    if result.method != method:
        raise PrivkitError(f"trainer {method} returned a result labelled {result.method!r}")
    result.check_chance(federation)
    stamp_noise(result, cfg.reproducible_noise)  # "not for release" goes first, before near-chance
    return result


def stamp_noise(result: TrainResult, reproducible: bool) -> None:
    """Record how the DP randomness was drawn in the result, its ledger and its warnings."""
    from accountants import NOT_FOR_RELEASE

    result.reproducible_noise = bool(reproducible)
    result.ledger.reproducible_noise = bool(reproducible)
    if reproducible and NOT_FOR_RELEASE not in result.warnings:
        result.warnings.insert(
            0,
            f"{NOT_FOR_RELEASE}: the DP noise and sampling were derived from the run "
            "seed stored in this run directory, so they can be regenerated",
        )
