"""The three stages of one method: train, account, audit (each writes its files atomically); and
the steps beside them: the run's audit controls (:mod:`privkit.pipeline.controls`) and each
method's mechanism controls (:mod:`privkit.pipeline.mechanism_controls`)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from privkit.files import StorageError, atomic_write_json, staged_dir
from privkit.files import one_line as _one_line
from privkit.files import read_json as _read_json
from privkit.pipeline.config import ACCOUNTANTS, SCHEMA_VERSION, ResolvedMethod, ResolvedRun
from privkit.pipeline.federation import FEDERATIONS, run_federation  # noqa: F401  (FEDERATIONS re-exported)


def _train_stage(
    run: ResolvedRun, m: ResolvedMethod, federation, mdir: Path, progress: bool
) -> None:
    """Train into a staging folder, then rename it into place (old results kept until then)."""
    from privkit.flower_engine.engine import engine_entry, train

    with staged_dir(mdir) as staging:
        result = train(
            m.method, federation, m.trainer, seed=m.seed, progress=progress, engine=m.engine
        )
        atomic_write_json(
            staging / "config.json",
            {
                "schema_version": SCHEMA_VERSION,
                "method": m.method,
                "seed": m.seed,
                "federation": run.config.federation.model_dump(mode="json"),
                "trainer": m.trainer,
                **engine_entry(m.engine),
            },
        )
        federation.save(staging / "federation.json")
        result.save(staging)


def _claim_from(claims: dict) -> dict | None:
    """The paper's claim, keeping scalar entries only (the full record stays in train.json)."""
    if not claims:
        return None
    out = {k: v for k, v in claims.items() if v is None or isinstance(v, (int, float, str, bool))}
    if "epsilon" not in out and out.get("target_epsilon") is not None:
        out["epsilon"] = out["target_epsilon"]
    for k in ("epsilon", "delta"):  # only numbers are comparable with privkit's values
        v = out.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            out.pop(k, None)
    return out


def _at_claim_delta(ledger, summary: dict, cd: float, head: str, accountants: list[str]):
    """The headline accountant's worst-client epsilon at the paper's delta ``cd``: the summary's
    where ``cd`` is its delta; for the best of every accountant
    :meth:`accountants.Ledger.account`, the summary's same number at ``cd`` without its other
    clients and accountants (seconds of basic and advanced composition per client); otherwise a
    summary at ``cd``."""
    # the accountants Ledger.account's best minimises over
    from accountants.ledger import ACCOUNTANTS as EVERY

    if cd == summary["delta"]:
        return summary["worst"].get(head)
    if head == "best" and sorted(accountants) == sorted(EVERY):
        return ledger.account(cd).epsilon
    return ledger.summary(cd, accountants=accountants)["worst"].get(head)


def guarantee_facts(delta_split: dict) -> dict:
    """What the formal-DP rule (``reports.formal_dp_status``) needs from a ledger's per-client
    delta split (``Ledger.delta_split``, a summary's ``delta_split``): ``fixed_delta``, the delta
    already spent by (epsilon, delta)-only mechanisms (worst client; no finite epsilon below it),
    and ``non_private``, the labels of releases without noise."""
    split = delta_split.values()
    return {
        "fixed_delta": max((float(c.get("fixed_delta") or 0.0) for c in split), default=0.0),
        "non_private": sorted(
            {str(x).split(":", 1)[0] for c in split for x in c.get("non_private", [])}
        ),
    }


def account_method(
    mdir: Path,
    delta: float,
    accountant: str = "best",
    accountants: Sequence[str] | None = None,
    pld_grid: float | None = None,
    curve_accountant: str = "rdp",
) -> dict:
    """Ledger summary of a trained run directory at ``delta`` (what ``privacy.json`` holds).

    Parameters
    ----------
    mdir : pathlib.Path
        The method's run directory (its ``ledger.json``).
    delta : float
        Delta of every epsilon.
    accountant : str
        Headline accountant (``best`` = the minimum over ``accountants``).
    accountants : sequence of str, optional
        Accountants computed per client (default: basic, advanced, rdp, pld).
    pld_grid : float, optional
        PLD value discretisation interval (coarser is faster and still an upper bound).
    curve_accountant : str
        Accountant of the epsilon-over-rounds curve (worst client at the end).
    """
    from accountants import Ledger

    accountants = list(accountants or ACCOUNTANTS)
    ledger = Ledger.load(mdir / "ledger.json")
    if pld_grid is not None:
        ledger.value_discretization_interval = pld_grid
    meta = _read_json(mdir / "train.json")
    summary = ledger.summary(delta, accountants=accountants)
    clients, worst, who = summary["clients"], summary["worst"], summary["worst_client"]
    errors = dict(summary["not_applicable"])
    head = accountant if accountant in worst else "best"
    over_rounds: list[tuple[float, float]] = []
    curve_kind = curve_accountant if curve_accountant in worst else head
    try:
        over_rounds = [
            (float(r), float(e))
            for r, e in ledger.epsilon_over_rounds(delta, curve_kind, client=who.get(head))
        ]
    except ValueError as exc:
        errors["epsilon_over_rounds"] = str(exc)
    claim = _claim_from(meta.get("claims") or {})
    at_claim = None
    cd = claim.get("delta") if claim else None
    if isinstance(cd, (int, float)) and 0 < cd < 1:
        try:
            at_claim = _at_claim_delta(ledger, summary, cd, head, accountants)
        except ValueError as exc:
            errors["claim_delta"] = str(exc)
    neighbouring = sorted({r for r in summary["neighbouring"].values() if r})
    try:  # certified [lower, upper] around the tight (PLD) epsilon; the others have none
        # the report shows the worst client's bracket: the other clients' lower ends (seconds
        # each) are not computed
        brackets = ledger.brackets(
            delta, accountants=[a for a in accountants if a in worst], worst_only=True
        )
    except ValueError as exc:
        brackets = {}
        errors["epsilon_bracket"] = str(exc)
    return {
        "schema_version": SCHEMA_VERSION,
        "delta": delta,
        "accountant": head,
        **brackets,
        **guarantee_facts(summary["delta_split"]),
        "accountants": accountants + ["best"],
        "pld_grid": ledger.value_discretization_interval,
        "curve_accountant": curve_kind,
        "summary": {"clients": clients, "worst": worst, "worst_client": who},
        "neighbouring": neighbouring,
        "labels": ledger.labels(),
        "epsilon_over_rounds": over_rounds,
        "claim": claim,
        "epsilon_at_claim_delta": at_claim,
        "errors": errors,
        **ledger.noise_stamp(),
    }  # "reproducible noise: not for release"; the Renyi filter's guarantee


def _account_stage(run: ResolvedRun, m: ResolvedMethod, mdir: Path) -> None:
    cfg = run.config
    privacy = account_method(
        mdir,
        cfg.delta,
        cfg.accountant,
        accountants=cfg.accountants,
        pld_grid=cfg.pld_grid,
        curve_accountant=cfg.curve_accountant,
    )
    atomic_write_json(mdir / "privacy.json", privacy)


def _audit_stage(run: ResolvedRun, m: ResolvedMethod, mdir: Path, progress: bool) -> None:
    cfg = run.config
    seed = cfg.seed if cfg.audit.seed is None else cfg.audit.seed
    # bounds and verdict at the report's delta, so they compare with the headline epsilon
    run_audit(
        mdir,
        attacks=cfg.audit.attacks,
        shadows=cfg.audit.shadows,
        executor=cfg.audit.executor,
        seed=seed,
        progress=progress,
        delta=cfg.delta,
        **cfg.audit.options(),
    )


def run_audit(
    run_dir: Path,
    *,
    attacks: list[str] | None,
    shadows: int,
    executor: str,
    seed: int,
    progress: bool,
    **options: Any,
) -> dict:
    """Audit one method's run directory (:func:`privkit.audit.audit_run`), which writes ``audit.json``.

    Parameters
    ----------
    run_dir : pathlib.Path
        The method's run directory.
    attacks : list of str or None
        The attacks to run (None: the default set of :func:`privkit.audit.audit_run`).
    shadows : int
        Reference runs of the method's recipe (even, >= 2).
    executor : str
        Where the audited runs execute: ``serial``, ``process`` or ``ray``.
    seed : int
        The audit seed.
    progress : bool
        Show progress bars.
    **options : Any
        Further keyword arguments of :func:`privkit.audit.audit_run`.

    Returns
    -------
    dict
        The audit record (what ``audit.json`` holds).
    """
    from privkit.audit import audit_run

    return audit_run(
        run_dir,
        attacks=attacks,
        shadows=shadows,
        executor=executor,
        seed=seed,
        progress=progress,
        **options,
    )


def execute(
    run: ResolvedRun, m: ResolvedMethod, stage: str, root: str, progress: bool
) -> tuple[str | None, str, float]:
    """Run one stage; returns (error or None, traceback, seconds). KeyboardInterrupt propagates."""
    t0 = time.perf_counter()
    mdir = Path(root) / m.key
    try:
        if stage == "train":
            _train_stage(run, m, run_federation(root), mdir, progress)
        elif stage == "account":
            _account_stage(run, m, mdir)
        elif stage == "controls":
            from privkit.pipeline.controls import controls_stage

            controls_stage(run, m, Path(root), progress)
        elif stage == "mechanism-controls":
            from privkit.pipeline.mechanism_controls import mechanism_controls_stage

            mechanism_controls_stage(run, m, Path(root), progress)
        else:
            _audit_stage(run, m, mdir, progress)
    except StorageError:  # a full or read-only disk stops the run: no later stage could write
        raise
    except Exception as exc:  # recorded; the other methods go on
        return (
            f"{type(exc).__name__}: {_one_line(exc)}",
            traceback.format_exc(),
            time.perf_counter() - t0,
        )
    return None, "", time.perf_counter() - t0
