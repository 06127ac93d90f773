"""Findings on a Flower app: :func:`privkit.flower.check_flower_dp`'s warnings, one finding each.

``LocalDpMod`` instances are found as given, inside a :func:`privkit.flower.recorded` mod, or among a
``ClientApp``'s mods; strategies as given.  A strategy without a DP wrapper is a finding only when
no ``LocalDpMod`` is among the objects (the clients may add the noise themselves).  Epsilons are
one round's, for one client, without client-sampling amplification.
"""

from __future__ import annotations

from typing import Any

from privkit.check.findings import Finding, changes

__all__ = ["flower_findings", "local_dp_mods"]


def local_dp_mods(kind: str, obj: Any) -> list[Any]:
    """The ``LocalDpMod`` instances an object holds.

    Parameters
    ----------
    kind : {"local_dp", "client_app"}
        The object's kind (:func:`privkit.check.objects.classify`).
    obj : object
        A LocalDpMod, a recorded mod or a ClientApp.

    Returns
    -------
    list
    """
    if kind == "client_app":
        return [m for mod in getattr(obj, "_mods", []) for m in local_dp_mods("local_dp", mod)]
    mod = getattr(obj, "dp_mod", obj)
    return [mod] if type(mod).__name__ == "LocalDpMod" else []


def _findings(name: str, check: Any, skip: tuple[str, ...] = ()) -> list[Finding]:
    claimed = check.claimed_epsilon
    tail = (
        f"; one round, one client ({check.neighbouring}): epsilon {check.epsilon:.4g} at delta "
        f"{check.delta:g}" + ("" if claimed is None else f", claimed {claimed:.4g}")
    )
    prefix = "" if name == check.mechanism else f"{name}: "
    out = []
    for kind, warning in zip(check.kinds, check.warnings, strict=True):
        if kind in skip:
            continue
        changed = {"no_noise": True, "meaningless": False}.get(kind)
        if changed is None:
            changed = changes(claimed, check.epsilon)
        message = f"{prefix}{warning}{tail}"
        out.append(Finding(f"flower_{kind}", message, changed, claimed, check.epsilon))
    return out


def flower_findings(
    named: list[tuple[str, str, Any]], delta: float, neighbouring: str
) -> list[Finding]:
    """Every warning of :func:`privkit.flower.check_flower_dp` on the Flower objects, as findings.

    Parameters
    ----------
    named : list of (str, str, object)
        ``(name, kind, object)`` with kind ``"local_dp"``, ``"client_app"`` or ``"strategy"``.
    delta : float
        Delta of a strategy's epsilon (a LocalDpMod is stated at its own delta).
    neighbouring : {"replace_one", "add_remove"}
        Client-level relation (:mod:`privkit.flower.mechanisms`).

    Returns
    -------
    list of Finding
    """
    from privkit.flower.checks import check_flower_dp

    out: list[Finding] = []
    mods: dict[int, tuple[str, Any]] = {}
    for name, kind, obj in named:
        for mod in local_dp_mods(kind, obj) if kind != "strategy" else []:
            mods.setdefault(id(mod), (name, mod))
    for name, mod in mods.values():
        out += _findings(name, check_flower_dp(mod, neighbouring=neighbouring))
    skip = ("no_noise",) if mods else ()
    for name, kind, obj in named:
        if kind != "strategy":
            continue
        try:
            check = check_flower_dp(obj, delta=delta, neighbouring=neighbouring)
        except ValueError as exc:  # e.g. a DP wrapper around a server optimiser
            out.append(Finding("flower_strategy", f"{name}: {exc}", True))
            continue
        out += _findings(name, check, skip)
    return out
