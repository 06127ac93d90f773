"""The training objects a user's script builds, for ``privkit check SCRIPT.py``.

The script runs with ``runpy.run_path(path, run_name="__privkit_check__")``, so its
``if __name__ == "__main__":`` block (the training itself) does not run; its output goes to stderr.
The objects are those of recognised kinds among its globals, or what a zero-argument function of
it returns (``--call``: one object, or a tuple, list or dict of them).

Among globals, a script usually holds more loaders than the one it trains from; two kinds are left
out (and said so): a loader that ``make_private`` replaced by a ``DPDataLoader`` over the same
dataset, and, when a ``PrivacyEngine`` is present, loaders over datasets it does not train on (test
loaders).  ``--call`` names exactly the objects to check.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from pathlib import Path
from typing import Any

from privkit.check.objects import classify

__all__ = ["RUN_NAME", "objects_from_script"]

RUN_NAME = "__privkit_check__"
_POISSON = ("UniformWithReplacementSampler", "DistributedUniformWithReplacementSampler")


def _run(what: str, fn: Any, *args: Any) -> Any:
    """Call ``fn``; any exception (or exit) of the user's code is one ValueError naming ``what``."""
    try:
        return fn(*args)
    except SystemExit as exc:
        raise ValueError(
            f"{what} exited (SystemExit {exc.code!r}) before privkit could read it"
        ) from None
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300]
        raise ValueError(f"{what} raised {type(exc).__name__}: {detail}") from exc


def _from_globals(scope: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    found = {}
    for name, obj in scope.items():
        if name.startswith("_"):
            continue
        kind = classify(obj)
        if kind is not None and kind not in ("sampler", "plain_optimizer"):
            found[name] = (kind, obj)
    engines = [o for k, o in found.values() if k == "engine"]
    trained = {id(e.dataset) for e in engines if getattr(e, "dataset", None) is not None}
    loaders = {n: o for n, (k, o) in found.items() if k == "loader"}
    poisson = {
        id(o.dataset) for o in loaders.values() if type(o.batch_sampler).__name__ in _POISSON
    }
    skipped = []
    for name, loader in loaders.items():
        if type(loader.batch_sampler).__name__ in _POISSON:
            continue
        if id(loader.dataset) in poisson:
            skipped.append(f"{name} (make_private replaced it by a DPDataLoader)")
        elif trained and id(loader.dataset) not in trained:
            skipped.append(f"{name} (its dataset is not the one the PrivacyEngine trains on)")
    dropped = {s.split(" ")[0] for s in skipped}
    return {n: o for n, (_, o) in found.items() if n not in dropped}, skipped


def objects_from_script(
    path: str | Path, call: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Run a script and return the training objects it builds.

    Parameters
    ----------
    path : str or Path
        The Python file (``SCRIPT``).
    call : str, optional
        A zero-argument function of the script that returns the objects to check (``--call``).

    Returns
    -------
    dict
        Name -> object (a ``--call`` result keeps its container: :func:`privkit.check.check_training`
        opens it).
    list of str
        Loaders of the script's globals left out, each with the reason.

    Raises
    ------
    ValueError
        When the file is missing, the script fails, ``call`` names no function, or nothing of a
        recognised kind is found.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"SCRIPT must be a Python file; found {str(path)!r}")
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            scope = _run(f"SCRIPT {path}", runpy.run_path, str(path), None, RUN_NAME)
            if call is None:
                objects, skipped = _from_globals(scope)
            else:
                fn = scope.get(call)
                if not callable(fn):
                    raise ValueError(f"--call must name a function of {path}; found {call!r}")
                objects, skipped = {f"{call}()": _run(f"{call}() of {path}", fn)}, []
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    if call is None and not objects:
        raise ValueError(
            f"SCRIPT must define opacus, torch or Flower training objects at module level (or "
            f"name a function returning them with --call); found none in {path}"
        )
    return objects, skipped
