"""``audit_run``: audit one run directory and write ``audit.json``.

Design (stated in every audit.json under ``assumptions``):

* Audit points: ``n_audit`` target members (drawn from the clients' data) and ``n_audit``
  non-members (drawn from the federation's test set), drawn with the audit seed.
* Shadow models: the SAME recipe (method + trainer config + federation layout) re-run on
  shadow federations whose private data is half of the universe ``shadow_pool + audit points``
  (LiRA's mask: each universe example IN for exactly half of the shadows), re-partitioned among
  the same number of clients with the target's partition scheme.
* Attacks on the released model: ``threshold`` (loss), ``shadow`` (Shokri, CatBoost depth 1,
  trained on the shadows' outputs over the shadow pool), ``lira`` / ``lira-offline``.
* Epsilon lower bounds and the verdict come from :func:`attacks.audit_scores`: the one-run theorem
  (Steinke et al. 2023) with k+ = k- = ``guess_fraction`` of the audited records fixed in advance,
  ties broken at random, Bonferroni over the attacks for the verdict. The theorem assumes random
  inclusion, which the audit points (members from the clients' data, non-members from the test
  set) do not have: their bounds carry that note. The ``one-run`` attack has it: it re-runs the
  recipe once with shadow-pool canaries each inserted by a fair coin.
* ``attribute``: dominant-class inference from each client's shared artifacts (generic protocol:
  adversary trained on shadow runs' clients, tested on the target run's clients).
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attacks import signals
from attacks.attribute import AttributeInferenceAttack
from attacks.entry import AttackScores, analyse
from attacks.mia import LiRA, ShadowModelAttack, ThresholdAttack
from attacks.recipe import torch_logits
from privkit.audit.instantiations import client_artifact_features, dominant_classes, soft_label_artifacts
from privkit.audit.shadows import ShadowSet, canary_task, run_shadow_task, train_shadows
from privkit.jsonutil import json_default
from privkit.seeding import make_rng

SCHEMA_VERSION = 1
ATTACKS = ("threshold", "shadow", "lira", "one-run", "attribute")
MEMBERSHIP_ATTACKS = ("threshold", "shadow", "lira")


def _load_run(run_dir: Path):
    from privkit.data import Federation
    from privkit.trainers import TrainResult, get_trainer

    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"run directory {run_dir} has no config.json (run `privkit train` first)")
    cfg = json.loads(cfg_path.read_text())
    fed = Federation.load(run_dir / "federation.json")
    result = TrainResult.load(run_dir)
    spec = get_trainer(cfg["method"])
    return cfg, fed, result, spec


def _resolve_delta(delta: float | None, trainer_cfg: dict, claims: dict, n_private: int) -> float:
    if delta is None:
        # the run's own delta when it has a meaningful one (a no-DP claim may say delta = 1)
        for cand in (trainer_cfg.get("delta"), claims.get("delta")):
            if isinstance(cand, (int, float)) and 0 < cand < 1:
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
    names = [a.strip() for a in (attacks.split(",") if isinstance(attacks, str) else attacks) if a.strip()]
    bad = [a for a in names if a not in ATTACKS]
    if bad or not names:
        raise ValueError(f"attacks must be a subset of {', '.join(ATTACKS)}; found {', '.join(bad) or 'none'}")
    return names


def _error_entry(exc: BaseException) -> dict:
    return {"auc": None, "balanced_accuracy": None, "advantage": None, "tpr_at_fpr": None,
            "epsilon_lower_bound": None, "ceiling": None, "confidence": None, "delta": None,
            "n_trials": None, "roc": None, "notes": "", "error": f"{type(exc).__name__}: {exc}"}


def _safe(results: dict, name: str, fn: Callable[[], dict], on_error: Callable[[BaseException], dict]):
    try:
        results[name] = fn()
    except Exception as exc:  # one failed attack must not lose the others' results
        entry = on_error(exc)
        entry["traceback"] = traceback.format_exc(limit=3)
        results[name] = entry


def audit_run(run_dir: str | Path, *, attacks=None, shadows: int = 8, executor: str = "serial",
              seed: int = 0, progress: bool = False, workers: int | None = None, n_audit: int = 500,
              delta: float | None = None, alpha: float = 0.05, guess_fraction: float = 0.1,
              shadow_iterations: int = 200, canaries: int = 500, write: bool = True) -> dict:
    """Audit a run directory written by ``privkit train`` and write ``audit.json`` into it.

    Parameters
    ----------
    run_dir : the run directory (config.json, federation.json, checkpoints, ledger.json, ...).
    attacks : comma-separated names or a list from ``threshold, shadow, lira, one-run, attribute``
        (default: all).
    shadows : number of shadow runs of the recipe (even, >= 2; LiRA online wants >= 4).
    executor, workers : where shadow runs execute (``serial``, ``process``, ``ray``).
    seed : audit seed (audit points, mask, shadow seeds, canaries).
    progress : show progress bars.
    n_audit : members and non-members audited (each).
    delta : delta for the bounds and the accounted epsilon (default: the run's delta, else 1e-5).
    alpha : 1 - confidence of every bound and interval.
    guess_fraction : k+ = k- = this fraction of the audited points (fixed in advance).
    shadow_iterations : CatBoost iterations of the shadow-model attack (FLiP used 10 000).
    canaries : number of shadow-pool canaries in the one-run audit.
    write : write ``audit.json`` (and ``shadows.npz``) into ``run_dir``.

    Returns
    -------
    The audit.json content as a dict.
    """
    run = Path(run_dir)
    names = _parse_attacks(attacks)
    if shadows < 2 or shadows % 2:
        raise ValueError(f"shadows must be an even number >= 2; found {shadows}")
    if n_audit < 10:
        raise ValueError(f"n_audit must be >= 10; found {n_audit}")
    if not 0 < guess_fraction <= 0.5:
        raise ValueError(f"guess_fraction must be in (0, 0.5]; found {guess_fraction}")
    cfg, fed, result, spec = _load_run(run)
    method, trainer_cfg = cfg["method"], cfg["trainer"]
    delta = _resolve_delta(delta, trainer_cfg, result.claims, len(fed.members))
    try:
        accounted = float(result.ledger.epsilon(delta))
        acc_error = None
    except Exception as exc:  # an accountant that cannot handle an event is reported, not hidden
        accounted, acc_error = None, f"{type(exc).__name__}: {exc}"

    rng = make_rng(seed, "audit-points")
    members, nonmembers = fed.members, fed.test
    n_m = min(n_audit, members.size, nonmembers.size)
    audit_idx = np.r_[rng.choice(members, n_m, replace=False), rng.choice(nonmembers, n_m, replace=False)]
    t_labels, t_member = fed.private.y[audit_idx], np.isin(audit_idx, fed.members)
    t_logits = torch_logits(result.model, fed.private.x[audit_idx])
    # shadows should train on as many records as the target: universe = 2 x |members| when the
    # shadow pool allows (each universe record is IN for half of the shadows)
    n_pool = int(min(fed.shadow_pool.size, max(0, 2 * members.size - audit_idx.size)))
    pool_part = rng.choice(fed.shadow_pool, n_pool, replace=False) if n_pool else np.zeros(0, np.int64)
    universe = np.unique(np.r_[pool_part, audit_idx])
    pos = np.searchsorted(universe, audit_idx)

    need_shadows = any(a in names for a in ("threshold", "shadow", "lira", "attribute")) or \
        ("one-run" in names)
    shadow_set: ShadowSet | None = None
    shadow_error = None
    if need_shadows:
        try:
            shadow_set = train_shadows(fed, method, trainer_cfg, universe, n_models=shadows, seed=seed,
                                       executor=executor, workers=workers, progress=progress,
                                       keep_artifacts="attribute" in names)
        except Exception as exc:
            shadow_error = exc

    results: dict[str, dict] = {}
    attribute: dict[str, dict] = {}

    def need() -> ShadowSet:
        if shadow_set is None:
            raise RuntimeError(f"shadow training failed: {shadow_error}")
        return shadow_set

    if "threshold" in names:
        def _threshold() -> AttackScores:
            scores = ThresholdAttack("loss").score_samples(t_logits, t_labels)
            return AttackScores(scores, t_member, "loss threshold (Yeom et al. 2018); score = -loss")
        _safe(results, "threshold", _threshold, _error_entry)

    if "shadow" in names:
        def _shadow() -> AttackScores:
            s = need()
            pool = ~np.isin(s.universe, audit_idx)  # train the attack on shadow-pool points only
            y_pool = fed.private.y[s.universe[pool]]
            x = s.logits[:, pool].reshape(-1, s.logits.shape[-1])
            att = ShadowModelAttack(iterations=shadow_iterations, depth=1, random_state=seed)
            att.fit(x, np.tile(y_pool, s.logits.shape[0]), s.mask[:, pool].ravel())
            return AttackScores(att.score_samples(t_logits, t_labels), t_member,
                                (f"Shokri et al. 2017 shadow-model attack, CatBoost depth 1, "
                                 f"{shadow_iterations} iterations, {s.mask.shape[0]} shadow runs"))
        _safe(results, "shadow", _shadow, _error_entry)

    if "lira" in names:
        fixed = shadows < 64  # the paper's advice: few reference models -> global variance

        def _lira(online: bool) -> Callable[[], AttackScores]:
            def run_() -> AttackScores:
                s = need()
                att = LiRA(online=online, fix_variance=fixed).fit(s.logits[:, pos], t_labels, s.mask[:, pos])
                mode = "online" if online else "offline (one-sided)"
                return AttackScores(att.score_samples(t_logits, t_labels), t_member,
                                    (f"LiRA {mode}, {'fixed' if fixed else 'per-example'} variance, "
                                     f"{s.mask.shape[0]} reference runs of the recipe"))
            return run_
        _safe(results, "lira", _lira(True), _error_entry)
        _safe(results, "lira-offline", _lira(False), _error_entry)

    if "one-run" in names:
        def _one_run() -> AttackScores:
            return _one_run_scores(fed, method, trainer_cfg, shadow_set, seed=seed, canaries=canaries)
        _safe(results, "one-run", _one_run, _error_entry)

    if "attribute" in names:
        def _attr() -> dict:
            return _dominant_class_entry(fed, result, need(), seed=seed, alpha=alpha)
        _safe(attribute, "dominant-class", _attr,
              lambda e: {"accuracy": None, "ci_low": None, "ci_high": None, "chance": None,
                         "n_test": None, "error": f"{type(e).__name__}: {e}"})

    ver = analyse(results, accounted=accounted if spec.formal_dp else None, delta=delta, alpha=alpha,
                  seed=seed, guess_fraction=guess_fraction)
    if not spec.formal_dp:
        ver["message"] = "this method makes no formal DP claim; " + ver["message"]
    if acc_error:
        ver = {**ver, "status": "inconclusive" if spec.formal_dp else ver["status"],
               "message": ver["message"] + f"; accounting failed: {acc_error}"}
    out = {
        "schema_version": SCHEMA_VERSION, "method": method, "attacks": results, "attribute": attribute,
        "accounted_epsilon": accounted, "delta": delta, "shadows": shadows, "seed": seed,
        "formal_dp": spec.formal_dp, "n_audit": {"members": int(n_m), "nonmembers": int(n_m)},
        "shadow_test_accuracy": shadow_set.test_accuracy if shadow_set is not None else None,
        "target_test_accuracy": float(result.test_accuracy),
        "verdict": ver,
        "assumptions": {
            "neighbouring": "add/remove one record (the ledger's relation)",
            "accountant": "ledger 'best' accountant, worst client",
            "confidence": 1 - alpha,
            "audit_points": ("members drawn from the clients' data, non-members from the test set "
                             "(not random inclusion: the one-run bound's premise is not verified)"),
            "shadows": ("same recipe re-run on shadow federations: half of (audit points + shadow-pool "
                        "records) per shadow (LiRA mask), same client count and partition scheme"),
            "shadow_train_size": int(universe.size // 2), "target_train_size": int(members.size),
            "bound": ("one-run theorem (Steinke et al. 2023) with k+ = k- = "
                      f"{guess_fraction:g} x audited records fixed in advance, ties broken at random; "
                      f"the verdict's bound holds at {1 - alpha:g} for the family of attacks "
                      "(Bonferroni); each attack's own bound at its own confidence"),
        },
    }
    if shadow_error is not None:
        out["shadow_error"] = f"{type(shadow_error).__name__}: {shadow_error}"
    if write:
        (run / "audit.json").write_text(json.dumps(out, indent=2, default=json_default))
        if shadow_set is not None:
            shadow_set.save(run / "shadows.npz")
    return json.loads(json.dumps(out, default=json_default))


def _one_run_scores(fed, method: str, trainer_cfg: dict, shadow_set: ShadowSet | None, *, seed: int,
                    canaries: int) -> AttackScores:
    """Re-run the recipe once with shadow-pool canaries inserted w.p. 1/2 (Steinke et al. 2023)."""
    rng = make_rng(seed, "canaries")
    pool = fed.shadow_pool
    m = min(canaries, pool.size)
    if m < 10:
        raise ValueError(f"one-run audit needs >= 10 canaries in the shadow pool; found {pool.size}")
    can = np.sort(rng.choice(pool, m, replace=False))
    included = rng.random(m) < 0.5
    out = run_shadow_task(canary_task(fed, method, trainer_cfg, can, included, seed=seed))
    logits, labels = out["logits"].astype(np.float64), fed.private.y[can]
    note = "score = -loss"
    scores = -signals.loss(logits, labels)
    if shadow_set is not None and np.isin(can, shadow_set.universe).all():
        # reference statistics from the shadow runs: independent of which canaries were inserted
        p = np.searchsorted(shadow_set.universe, can)
        att = LiRA(online=False, fix_variance=shadow_set.mask.shape[0] < 64)
        scores = att.fit(shadow_set.logits[:, p], labels, shadow_set.mask[:, p]).score_samples(logits, labels)
        note = "score = offline LiRA against the shadow runs"
    return AttackScores(scores, included,
                        (f"one-run audit: {m} shadow-pool canaries each inserted with probability 1/2 "
                         f"into a fresh run of the recipe ({note}); bounds that run's mechanism, not "
                         "the released model's weights"),
                        inclusion="random", extra={"canaries": int(m), "inserted": int(included.sum())})


def _dominant_class_entry(fed, result, shadow_set: ShadowSet, *, seed: int, alpha: float) -> dict:
    """Generic dominant-class inference from per-client artifacts (train: shadows; test: target)."""
    xs, ys = [], []
    for arts, counts in zip(shadow_set.artifacts, shadow_set.class_counts):
        feats = client_artifact_features(arts, fed)
        if feats is None:
            raise ValueError(f"method {result.method} shares no per-client artifacts to attack")
        xs.append(feats)
        ys.append(dominant_classes(counts))
    x_train, y_train = np.concatenate(xs), np.concatenate(ys)
    x_test = client_artifact_features({**result.artifacts,
                                       **soft_label_artifacts(result.client_models, fed)}, fed)
    y_test = dominant_classes(fed.client_class_counts())
    att = AttributeInferenceAttack(random_state=seed).fit(x_train, y_train)
    res = att.evaluate(x_test, y_test, alpha=alpha,
                       notes=("dominant class of each client's private data inferred from the "
                              "artifacts it shares; adversary (logistic regression) trained on "
                              f"{len(y_train)} shadow clients, tested on the {len(y_test)} target clients"))
    return {**res.to_dict(), "error": None}
