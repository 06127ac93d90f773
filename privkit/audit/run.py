"""``audit_run``: audit one run directory's method and write ``audit.json``.

Design (stated in every audit.json under ``experiment`` and ``assumptions``):

* One pool: the clients' records and records of the shadow pool, the two parts of the private
  data the federation split at random (the test set stays out: non-members never come from
  another source). ``n_audit`` pool records are audited, drawn with the audit seed; every other
  pool record is in every audited run's training data.
* The audited target is a fresh run of the method's recipe (:class:`~privkit.audit.recipes.FederationRecipe`:
  the whole federation, same trainer config, client count and partition scheme) on the
  non-audited records plus each audited record included by an independent fair coin from the
  audit's own stream (:mod:`attacks.experiment`). ``shadows`` reference runs of the same recipe
  include every non-audited record and half of the audited ones (each audited record in exactly
  half of them), so they train on as many records as the target. The target run draws the release
  mechanism's randomness as the run's config says; the reference runs, the auditor's own models,
  never released, draw the same noise laws from seeded generators (``reference_noise``: the
  attacks only estimate score distributions from them; docs/auditing-methods.md).
* The pool holds n_audit/2 shadow-pool records, so the audited runs train on as many records as
  the released run did (pool - n_audit/2 = the clients' records); the default ``n_audit`` is the
  largest that allows it. When the shadow pool is too small for the ``n_audit`` asked, audit.json
  and the report warn with the numbers.
* Two claims are tested, each bound labelled with its claim in audit.json (``claims``):
  ``generic``, the bare (epsilon, delta) claim (Steinke et al.'s one-run bound), and, where the
  audited target run's ledger is known and has a finite epsilon, ``ledger``, "this run is as
  private as its ledger says" (the f-DP one-run bound against the ledger's own trade-off curve,
  :mod:`privkit.audit.claims`). The verdict tests the generic claim: the family-wise bound
  (:func:`attacks.audit_scores`, Bonferroni over the membership attacks) against the audited
  target run's own accounted epsilon at ``delta``. It stays there, although the ledger's curve is
  valid for the mechanism whenever the ledger describes what ran, so that its false-violation
  rate is the one measured by benchmarks/audit_validity.py and one verdict means the same for
  every method; the ledger claim's bound has its own status at the same confidence, not
  corrected for being a second test. ``tradeoff_curve`` stores the ledger curve's points (FPR ->
  smallest FNR) for the report's ROC figure.
* ``attribute``: dominant-class inference from each client's shared artifacts (adversary trained
  on the reference runs' clients, tested on the released run's clients).
"""

from __future__ import annotations

import hashlib
import json
import math
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from attacks.checkpoints import ModelCheckpoints
from attacks.entry import AttackScores, analyse
from attacks.experiment import Design, design_experiment, stream, train_models
from attacks.family import ATTACKS as FAMILY
from attacks.family import Options, Outputs, score
from attacks.recipe_audit import experiment_record
from privkit.audit.attribute import NotApplicable, dominant_class_entry
from privkit.audit.claims import curve_points, ledger_claim_bound, ledger_tradeoff
from privkit.audit.names import ATTACKS
from privkit.audit.recipes import FederationRecipe
from privkit.jsonutil import json_default

SCHEMA_VERSION = 1
#: the audited runs may train on this much less data than the release before audit.json warns
SIZE_TOLERANCE = 0.05


def _load_run(run_dir: Path):
    from privkit.data import Federation
    from privkit.files import read_json
    from privkit.trainers import TrainResult, get_trainer

    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"run directory {run_dir} has no config.json (run `privkit train` first)"
        )
    cfg = read_json(cfg_path, "run config")
    fed = Federation.load(run_dir / "federation.json")
    result = TrainResult.load(run_dir)
    spec = get_trainer(cfg["method"])
    return cfg, fed, result, spec


def resolve_delta(delta: float | None, trainer_cfg: dict, claims: dict, n_private: int) -> float:
    """The audit's delta: ``delta`` if given, else the run's own delta when it is meaningful, else
    ``min(1e-5, 1/n)``. A delta >= 1/n (a no-DP claim may say 1; FedMD-NFDP's theorem gives 0.098)
    permits publishing a record outright, so an audit at that delta would test nothing: it is skipped,
    as the pipeline's audit (run at the run config's delta) does."""
    if delta is None:
        for cand in (trainer_cfg.get("delta"), claims.get("delta")):
            if isinstance(cand, (int, float)) and 0 < cand < 1 / max(n_private, 1):
                delta = float(cand)
                break
        else:
            delta = min(1e-5, 1.0 / max(n_private, 1))
    if not 0 < float(delta) < 1:
        raise ValueError(f"delta must be in (0, 1); found {delta}")
    return float(delta)


def _parse_attacks(attacks) -> list[str]:
    if attacks is None:
        return list(ATTACKS)
    names = [
        a.strip()
        for a in (attacks.split(",") if isinstance(attacks, str) else attacks)
        if a.strip()
    ]
    bad = [a for a in names if a not in ATTACKS]
    if bad or not names:
        raise ValueError(
            f"attacks must be a subset of {', '.join(ATTACKS)}; found {', '.join(bad) or 'none'}"
        )
    return names


def _error_entry(exc: BaseException) -> dict:
    return {
        "auc": None,
        "balanced_accuracy": None,
        "advantage": None,
        "tpr_at_fpr": None,
        "epsilon_lower_bound": None,
        "ceiling": None,
        "confidence": None,
        "delta": None,
        "n_trials": None,
        "roc": None,
        "notes": "",
        "error": f"{type(exc).__name__}: {exc}",
    }


def _safe(
    results: dict, name: str, fn: Callable[[], object], on_error: Callable[[BaseException], dict]
):
    try:
        results[name] = fn()
    except NotApplicable as exc:
        results[name] = {"not_applicable": str(exc), "error": None}
    except Exception as exc:  # one failed attack must not lose the others' results
        entry = on_error(exc)
        entry["traceback"] = traceback.format_exc(limit=3)
        results[name] = entry


# ---------------------------------------------------------------------------- the pool
def audit_pool(fed, n_audit: int | None, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """The pool (indices into ``fed.private``), which of its records are audited, and the sizes.

    The pool is every client record plus s records of the shadow pool (drawn with the audit seed),
    s = min(shadow pool, ceil(n_audit / 2)): the audited runs then train on pool - n_audit/2 =
    the clients' records, as many as the release. Default ``n_audit``: 2 x min(shadow pool,
    client records), the most that keeps that balance.
    """
    members, shadow = fed.members, fed.shadow_pool
    matched = 2 * min(shadow.size, members.size)
    m = matched if n_audit is None else int(n_audit)
    s = min(shadow.size, (m + 1) // 2)
    if m < 10 or m > members.size + s:
        raise ValueError(
            f"n_audit must be between 10 and the pool size {members.size + shadow.size} "
            f"(client records {members.size} + shadow pool {shadow.size}); found {m}"
            + (
                " (the default is 2 x min(shadow pool, client records); set n_audit)"
                if n_audit is None
                else ""
            )
        )
    rng = stream(seed, "audit-records")
    pool = np.sort(np.concatenate([members, rng.choice(shadow, s, replace=False)]))
    audited = np.zeros(pool.size, bool)
    audited[rng.choice(pool.size, m, replace=False)] = True
    sizes = {
        "pool": int(pool.size),
        "pool_from_clients": int(members.size),
        "pool_from_shadow_pool": int(s),
        "release_train_size": int(members.size),
        "audit_train_size_expected": float(pool.size - m / 2),
        "n_audit_matched": int(matched),
    }
    return pool, audited, sizes


def audit_experiment(
    fed,
    method: str,
    trainer_cfg: dict,
    *,
    seed: int,
    shadows: int,
    n_audit: int | None = None,
    keep_artifacts: bool = False,
    engine: str = "inprocess",
) -> tuple[np.ndarray, np.ndarray, dict, Design, FederationRecipe]:
    """An audit's experiment on a run of ``method`` over ``fed``: its pool of records (with which
    are audited and the pool's sizes, :func:`audit_pool`), its fair-coin design and the recipe
    that trains the target run with the release mechanism and the reference runs with seeded
    noise. What :func:`audit_run` trains; ``benchmarks/audit_roofline.py`` trains its reference
    runs alone."""
    pool, audited, sizes = audit_pool(fed, n_audit, seed)
    design = design_experiment(pool.size, shadows=shadows, seed=seed, audited=audited)
    if design.target_seed in design.reference_seeds:
        raise ValueError(
            f"the audit seed {seed} gives the target run and a reference run the same seed "
            f"{design.target_seed}; use another audit seed"
        )
    recipe = FederationRecipe(
        fed,
        method,
        trainer_cfg,
        keep_artifacts=keep_artifacts,
        engine=engine,
        release_seeds=[design.target_seed],  # the reference runs draw seeded noise
    )
    return pool, audited, sizes, design, recipe


def size_warnings(sizes: dict, design: Design) -> list[dict]:
    """A warning with the numbers when the audited runs train on less data than the release
    (n_audit above 2 x the shadow pool or the client records)."""
    release, expected = sizes["release_train_size"], sizes["audit_train_size_expected"]
    if expected >= (1 - SIZE_TOLERANCE) * release:
        return []
    return [
        {
            "code": "audit_size_mismatch",
            "message": (
                f"the audited runs train on about {expected:.0f} records (target: {int(design.included.sum())}; "
                f"pool {sizes['pool']} = {sizes['pool_from_clients']} client records + "
                f"{sizes['pool_from_shadow_pool']} shadow-pool records, {int(design.audited.sum())} audited "
                f"by fair coin), the released model on {release} ({expected / release:.0%}): the pool is too "
                f"small to match at this n_audit (matching needs n_audit <= {sizes['n_audit_matched']}); "
                "bounds and accuracy refer to runs on less data than the release"
            ),
        }
    ]


# ---------------------------------------------------------------------------- the attacks
def _membership(
    names: list[str],
    design: Design,
    logits: np.ndarray | None,
    labels: np.ndarray,
    train_error: BaseException | None,
    *,
    seed: int,
    shadow_iterations: int,
) -> dict:
    """Each membership attack's :class:`AttackScores` (or its error entry)."""
    family = [n for n in FAMILY if n in names or n.removesuffix("-offline") in names]
    results: dict = {}
    for name in family:

        def run(name=name) -> AttackScores:
            if logits is None:
                raise RuntimeError(f"training the audited runs failed: {train_error}")
            out = Outputs(
                target=logits[0], references=logits[1:], labels=labels, keep=design.reference_keep
            )
            s, note = score(name, out, Options(seed=seed, shadow_iterations=shadow_iterations))
            return AttackScores(s, design.is_member, note, inclusion="random")

        _safe(results, name, run, _error_entry)
    return results


def _privacy_record(run_dir: Path) -> dict:
    """``privacy.json`` as the account stage wrote it; empty where the file is missing or fails
    its checksum (never trusted)."""
    from atomicfiles import CorruptFileError, read_verified

    try:
        record = json.loads(read_verified(run_dir / "privacy.json"))
    except (OSError, ValueError, CorruptFileError):
        return {}
    return record if isinstance(record, dict) else {}


def _headline_grid(run_dir: Path, record: dict | None = None) -> float | None:
    """The PLD grid of the run's headline epsilon (``privacy.json``, where the account stage
    wrote it; ``record``: that file already read): the audit accounts on the same grid, so its
    claim is the headline's accountant. None without one, or where the file is missing or fails
    its checksum (never trusted: the ledger's own, finer grid then answers)."""
    grid = (_privacy_record(run_dir) if record is None else record).get("pld_grid")
    return float(grid) if isinstance(grid, (int, float)) and grid > 0 else None


def _recorded_release_epsilon(record: dict, delta: float, grid: float | None) -> float | None:
    """The release's epsilon the account stage recorded (``privacy.json``: the worst client under
    the best of its accountants), where it accounted at ``delta`` on ``grid``; None otherwise.
    The audit then need not account the release's ledger a second time (a second or more for an
    adaptive method's ledger of many noise multipliers)."""
    if grid is None or record.get("delta") != delta or record.get("pld_grid") != grid:
        return None
    worst = (record.get("summary") or {}).get("worst")
    eps = worst.get("best") if isinstance(worst, dict) else None
    return float(eps) if isinstance(eps, (int, float)) else None


def _accounting(
    details: list[dict] | None,
    release_ledger,
    delta: float,
    grid: float | None = None,
    release_epsilon: float | None = None,
) -> tuple[dict, str | None]:
    """The audited target run's accounted epsilon (what the verdict checks) beside the release's,
    on the PLD ``grid`` of the run's headline epsilon where known (a coarser grid is still a
    pessimistic upper bound, and ten times cheaper than the default). The grid is set on the
    ledgers themselves, so the ledger claim computed later from the target's ledger
    (:func:`_claims`) is on the same grid. ``release_epsilon``: the release's, as the account
    stage recorded it (:func:`_recorded_release_epsilon`), taken instead of accounting the
    release's ledger again."""
    out: dict = {
        "release_accounted_epsilon": release_epsilon,
        "release_epsilon_source": "privacy.json" if release_epsilon is not None else "ledger",
        "audit_target_accounted_epsilon": None,
    }
    errors = []
    for key, ledger in (
        ("release_accounted_epsilon", release_ledger if release_epsilon is None else None),
        ("audit_target_accounted_epsilon", details[0]["ledger"] if details else None),
    ):
        if ledger is None:
            continue
        if grid is not None:
            ledger.value_discretization_interval = grid
        try:
            out[key] = float(ledger.epsilon(delta))
        except (
            Exception
        ) as exc:  # an accountant that cannot handle an event is reported, not hidden
            errors.append(f"{key}: {type(exc).__name__}: {exc}")
    return out, "; ".join(errors) or None


def _epsilon_warning(acc: dict) -> list[dict]:
    rel, tgt = acc["release_accounted_epsilon"], acc["audit_target_accounted_epsilon"]
    if rel is None or tgt is None or not (math.isfinite(rel) and math.isfinite(tgt)):
        return []
    if abs(tgt - rel) <= 0.05 * max(rel, 1e-12):
        return []
    return [
        {
            "code": "audit_size_mismatch",
            "message": (
                f"the audited target run's accounted epsilon is {tgt:.4g}, the release's {rel:.4g}: the verdict "
                "checks the audited run's own claim (its clients hold other amounts of data)"
            ),
        }
    ]


# ---------------------------------------------------------------------------- entry point
def audit_run(
    run_dir: str | Path,
    *,
    attacks=None,
    shadows: int = 8,
    executor: str = "serial",
    seed: int = 0,
    progress: bool = False,
    workers: int | None = None,
    n_audit: int | None = None,
    delta: float | None = None,
    alpha: float = 0.05,
    guess_fraction: float = 0.1,
    shadow_iterations: int = 200,
    write: bool = True,
    say: Callable[[str], None] | None = None,
) -> dict:
    """Audit a run directory written by ``privkit train`` and write ``audit.json`` into it.

    Parameters
    ----------
    run_dir : the run directory (config.json, federation.json, checkpoints, ledger.json, ...).
    attacks : comma-separated names or a list from ``threshold, shadow, lira, rmia, attribute``
        (default: all; ``lira`` and ``rmia`` run online and offline).
    shadows : reference runs of the recipe (even, >= 2).
    executor, workers : where the audited runs execute (``serial``, ``process``, ``ray``).
    seed : audit seed (audited records, coins, reference halves, run seeds, tie-break).
    progress : show progress bars.
    n_audit : pool records audited, each by a fair coin (default: 2 x min(shadow pool, client
        records), the most that keeps the audited runs' data size equal to the release's).
    delta : delta for the bounds and the accounted epsilon (default: :func:`resolve_delta`).
    alpha : 1 - confidence of the verdict's family-wise bound.
    guess_fraction : k+ = k- = this fraction of the audited records (fixed in advance).
    shadow_iterations : CatBoost iterations of the shadow-model attack (FLiP used 10 000).
    write : write ``audit.json`` (and ``shadows.npz``: design and outputs) into ``run_dir``,
        and each audited run's output, as soon as it is trained, into ``run_dir/audit-models/``
        (:data:`MODELS_DIR`): a killed audit, re-run, trains only the runs it had not finished.
    say : where a corrupted model checkpoint is named (default: :mod:`warnings`).

    Returns
    -------
    The audit.json content as a dict.
    """
    run = Path(run_dir)
    names = _parse_attacks(attacks)
    if shadows < 2 or shadows % 2:
        raise ValueError(f"shadows must be an even number >= 2; found {shadows}")
    if not 0 < guess_fraction <= 0.5:
        raise ValueError(f"guess_fraction must be in (0, 0.5]; found {guess_fraction}")
    cfg, fed, result, spec = _load_run(run)
    method, trainer_cfg = cfg["method"], cfg["trainer"]
    delta = resolve_delta(delta, trainer_cfg, result.claims, len(fed.members))
    pool, audited, sizes, design, recipe = audit_experiment(
        fed,
        method,
        trainer_cfg,
        seed=seed,
        shadows=shadows,
        n_audit=n_audit,
        keep_artifacts="attribute" in names,
        engine=cfg.get("engine", "inprocess"),
    )
    labels = fed.private.y[pool[audited]]
    logits, details, train_error = None, None, None
    try:
        logits, details = train_models(
            recipe,
            fed.private.x[pool],
            fed.private.y[pool],
            design.index_sets(),
            design.seeds(),
            query=np.flatnonzero(audited),
            n_classes=fed.num_classes,
            executor=executor,
            workers=workers,
            progress=progress,
            description=f"audited runs ({method})",
            checkpoints=model_checkpoints(run, recipe) if write else None,
            say=say,
        )
    except Exception as exc:  # recorded in audit.json; the attribute attack may still fail alone
        train_error = exc

    results = _membership(
        names, design, logits, labels, train_error, seed=seed, shadow_iterations=shadow_iterations
    )
    record = _privacy_record(run)
    grid = _headline_grid(run, record)
    acc, acc_error = _accounting(
        details, result.ledger, delta, grid, _recorded_release_epsilon(record, delta, grid)
    )
    claim = acc["audit_target_accounted_epsilon"] if spec.formal_dp else None
    scored = {n: r for n, r in results.items() if isinstance(r, AttackScores)}
    ver = analyse(
        results, accounted=claim, delta=delta, alpha=alpha, seed=seed, guess_fraction=guess_fraction
    )
    claims, curve_pts = _claims(
        ver,
        scored,
        details,
        claim,
        delta=delta,
        alpha=alpha,
        seed=seed,
        guess_fraction=guess_fraction,
    )
    if not spec.formal_dp:
        ver["message"] = "this method makes no formal DP claim; " + ver["message"]
    if acc_error:
        ver = {
            **ver,
            "status": "inconclusive" if spec.formal_dp else ver["status"],
            "message": ver["message"] + f"; accounting failed: {acc_error}",
        }

    attribute: dict = {}
    if "attribute" in names:

        def _attr() -> dict:
            if details is None:
                raise RuntimeError(f"training the audited runs failed: {train_error}")
            return dominant_class_entry(fed, result, details[1:], seed=seed, alpha=alpha)

        _safe(
            attribute,
            "dominant-class",
            _attr,
            lambda e: {
                "accuracy": None,
                "ci_low": None,
                "ci_high": None,
                "chance": None,
                "n_test": None,
                "error": f"{type(e).__name__}: {e}",
            },
        )

    experiment = {
        **sizes,
        **(experiment_record(design, logits, labels) if logits is not None else design.summary()),
        **acc,
        "recipe": recipe.name,
        "executor": executor,
        "reference_noise": recipe.reference_noise,
    }
    warnings = size_warnings(sizes, design) + _epsilon_warning(acc)
    out = {
        "schema_version": SCHEMA_VERSION,
        "method": method,
        "attacks": results,
        "attribute": attribute,
        "accounted_epsilon": claim if claim is not None else acc["release_accounted_epsilon"],
        "delta": delta,
        "shadows": shadows,
        "seed": seed,
        "formal_dp": spec.formal_dp,
        "n_audit": {
            "members": int(design.is_member.sum()),
            "nonmembers": int((~design.is_member).sum()),
        },
        "shadow_test_accuracy": [d["test_accuracy"] for d in details[1:]] if details else None,
        "audit_target_test_accuracy": details[0]["test_accuracy"] if details else None,
        "target_test_accuracy": float(result.test_accuracy),
        "verdict": ver,
        "claims": claims,
        "tradeoff_curve": curve_pts,
        "experiment": experiment,
        "warnings": warnings,
        "assumptions": _assumptions(alpha, guess_fraction),
    }
    if train_error is not None:
        out["shadow_error"] = f"{type(train_error).__name__}: {train_error}"
    out["request"] = audit_request(
        attacks=names,
        shadows=shadows,
        seed=seed,
        n_audit=n_audit,
        delta=delta,
        alpha=alpha,
        guess_fraction=guess_fraction,
        shadow_iterations=shadow_iterations,
    )
    if write:
        from privkit.files import write_json, write_with

        if logits is not None:  # before audit.json, whose presence means a finished audit
            arrays: dict[str, Any] = {
                "pool": pool,
                "audited": audited,
                "included": design.included,
                "keep": design.keep,
                "seeds": np.asarray(design.seeds(), dtype=np.int64),
                "logits": logits.astype(np.float32),
            }
            write_with(run / "shadows.npz", lambda buf: np.savez_compressed(buf, **arrays))
        write_json(run / "audit.json", out)
    return json.loads(json.dumps(out, default=json_default))


MODELS_DIR = "audit-models"
"""The folder of a run directory holding its audit's model checkpoints (one per audited run)."""


def model_checkpoints(run: Path, recipe: FederationRecipe) -> ModelCheckpoints:
    """The audit's model checkpoints in ``run``, keyed by what every audited run depends on
    besides its own task: the method, its trainer config, the engine, the reference runs' noise,
    the federation's layout and data, and whether the runs keep their clients' artifacts."""
    key = json.dumps(
        {
            "method": recipe.method,
            "trainer": recipe.trainer_config,
            "engine": recipe.engine,
            "reference_noise": recipe.reference_noise,
            "artifacts": recipe.keep_artifacts,
            "federation": hashlib.sha256(recipe.federation_json.encode()).hexdigest(),
        },
        sort_keys=True,
        default=json_default,
    )
    return ModelCheckpoints(run / MODELS_DIR, key)


def audit_request(
    *,
    attacks,
    shadows: int,
    seed: int,
    n_audit: int | None,
    delta: float,
    alpha: float,
    guess_fraction: float,
    shadow_iterations: int,
) -> dict:
    """What an audit's result depends on besides the run directory (``audit.json``'s ``request``):
    a re-run asking the same finds its result already there."""
    return {
        "attacks": sorted(_parse_attacks(attacks)),
        "shadows": int(shadows),
        "seed": int(seed),
        "n_audit": None if n_audit is None else int(n_audit),
        "delta": float(delta),
        "alpha": float(alpha),
        "guess_fraction": float(guess_fraction),
        "shadow_iterations": int(shadow_iterations),
    }


def finished_audit(
    run_dir: str | Path,
    *,
    attacks=None,
    shadows: int = 8,
    seed: int = 0,
    n_audit: int | None = None,
    delta: float | None = None,
    alpha: float = 0.05,
    guess_fraction: float = 0.1,
    shadow_iterations: int = 200,
    say=None,
) -> dict | None:
    """The ``audit.json`` of ``run_dir`` when it answers this very request with intact files
    (checksums verified), else None (a file failing its checksum is named in a warning)."""
    from privkit.files import intact, read_json

    run = Path(run_dir)
    if not intact(run / "audit.json", say):
        return None
    stored = read_json(run / "audit.json", "audit file")
    _, fed, result, _ = _load_run(run)
    delta = resolve_delta(
        delta,
        read_json(run / "config.json", "run config")["trainer"],
        result.claims,
        len(fed.members),
    )
    asked = audit_request(
        attacks=attacks,
        shadows=shadows,
        seed=seed,
        n_audit=n_audit,
        delta=delta,
        alpha=alpha,
        guess_fraction=guess_fraction,
        shadow_iterations=shadow_iterations,
    )
    if stored.get("request") != asked:
        return None
    if (run / "shadows.npz").is_file() and not intact(run / "shadows.npz", say):
        return None
    return stored


def _claims(
    ver: dict,
    scored: dict,
    details: list[dict] | None,
    accounted: float | None,
    *,
    delta: float,
    alpha: float,
    seed: int,
    guess_fraction: float,
) -> tuple[dict, dict | None]:
    """Each claim tested, with its bound (``generic``: the verdict's; ``ledger``: the audited target
    run's own trade-off curve, where its ledger is known and its epsilon finite) and the curve's points."""
    keys = (
        "status",
        "epsilon_lower_bound",
        "epsilon_ceiling",
        "detectable_epsilon",
        "confidence",
        "attack",
    )
    claims = {
        "generic": {
            "claim_tested": "(eps, delta)-DP at the accounted epsilon",
            "in_verdict": True,
            **{k: ver.get(k) for k in keys},
        }
    }
    if (
        accounted is None
        or not math.isfinite(accounted)
        or not details
        or details[0].get("ledger") is None
    ):
        return claims, None
    try:
        curve = ledger_tradeoff(details[0]["ledger"])
        pts = curve_points(curve, accounted, delta)
        if scored:
            bound = ledger_claim_bound(
                {n: s.scores for n, s in scored.items()},
                {n: s.membership for n, s in scored.items()},
                curve,
                accounted=accounted,
                delta=delta,
                alpha=alpha,
                seed=seed,
                guess_fraction=guess_fraction,
            )
            claims["ledger"] = {
                **bound,
                "claim_tested": "as private as its ledger says: " + curve.claim,
                "in_verdict": False,
            }
    except Exception as exc:  # the generic verdict stands; say why the stronger claim is missing
        claims["ledger"] = {"error": f"{type(exc).__name__}: {exc}", "in_verdict": False}
        return claims, None
    return claims, pts


def _assumptions(alpha: float, guess_fraction: float) -> dict:
    return {
        "neighbouring": "add/remove one record (the ledger's relation)",
        "accountant": "ledger 'best' accountant, worst client, of the audited target run",
        "confidence": 1 - alpha,
        "audit_points": (
            "drawn from one pool (the clients' records and the shadow pool); each included "
            "in a fresh run of the method's recipe by an independent fair coin from the "
            "audit's own stream, every other pool record always included"
        ),
        "shadows": (
            "the same recipe (whole federation, same client count and partition scheme) re-run "
            "with every non-audited pool record and half of the audited ones (each in exactly "
            "half of the reference runs): the target's data size; the target run draws the "
            "release mechanism's randomness, the reference runs (the auditor's own, never "
            "released) the same laws from seeded generators"
        ),
        "bound": (
            "one-run theorem (Steinke et al. 2023) with k+ = k- = "
            f"{guess_fraction:g} x audited records fixed in advance, ties broken at random; "
            f"the verdict's bound holds at {1 - alpha:g} for the family of attacks "
            "(Bonferroni); each attack's own bound at its own confidence"
        ),
        "claims": (
            "the verdict tests the generic (eps, delta) claim at the audited run's accounted "
            "epsilon; claims.ledger tests, with the same guesses and the f-DP one-run analysis "
            "(Mahloujifar et al. 2024), the stronger claim that the run is as private as its "
            "ledger's own trade-off curve, valid exactly when the ledger describes what ran; "
            "its status is shown beside the verdict, not folded into it"
        ),
    }
