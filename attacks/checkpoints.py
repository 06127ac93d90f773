"""One checkpoint per trained model of an audit, so that a killed audit resumes model by model.

:class:`ModelCheckpoints` stores what each model of :func:`attacks.experiment.train_models`
returned (its logits on the query records and the recipe's details) in ``folder/model-NNN.pkl``,
written by :mod:`atomicfiles` (atomic, with its checksum sidecar) as soon as that model finishes,
in whichever process trained it. A re-run loads the models whose checkpoint verifies and was made
for the very same task (its fingerprint: the caller's key, the recipe's name, the seed, the
training indices, the query records, the class count) and trains only the others. A checkpoint
whose checksum fails is never trusted: one warning line names it, and the model is trained again.

Checkpoints are Python pickles: load only folders your own audits wrote.
"""

from __future__ import annotations

import hashlib
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import atomicfiles


def fingerprint(
    key: str, recipe_name: str, seed: int, index: Any, query: Any, n_classes: int
) -> str:
    """The identity of one model's training task (sha256 hex)."""
    h = hashlib.sha256()
    for part in (key, recipe_name, str(int(seed)), str(int(n_classes))):
        h.update(part.encode() + b"\0")
    for arr in (index, query):
        a = np.ascontiguousarray(np.asarray(arr, dtype=np.int64))
        h.update(str(a.shape).encode() + a.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ModelCheckpoints:
    """The checkpoints of one audit's models, in ``folder`` (picklable: workers save their own).

    Parameters
    ----------
    folder : where ``model-NNN.pkl`` (and their ``.sha256`` sidecars) go.
    key : what the models depend on besides their task (a recipe's configuration, the data's
        digest): a checkpoint made under another key is not used.
    """

    folder: Path
    key: str = ""

    def path(self, j: int) -> Path:
        """Model ``j``'s checkpoint (0 is the target, then the reference models)."""
        return Path(self.folder) / f"model-{j:03d}.pkl"

    def load(self, j: int, fp: str, say: Callable[[str], None] | None = None) -> dict | None:
        """Model ``j``'s stored output when its checkpoint verifies and matches ``fp``, else None
        (a corrupted one is named in one line, through ``say`` or :mod:`warnings`)."""
        path = self.path(j)
        problem = atomicfiles.verify(path, required=True)
        if problem == "missing":
            return None
        if problem is None:
            try:
                record = pickle.loads(path.read_bytes())
            except Exception as exc:  # verified yet unreadable: written by another version
                problem = f"unreadable ({type(exc).__name__})"
            else:
                ok = isinstance(record, dict) and record.get("fingerprint") == fp
                return record["output"] if ok else None
        msg = f"{path}: {problem}; treated as absent and recomputed"
        (say or (lambda m: warnings.warn(m, stacklevel=3)))(msg)
        return None

    def save(self, j: int, fp: str, output: dict) -> Path:
        """Store model ``j``'s output under fingerprint ``fp`` (atomic, checksummed)."""
        data = pickle.dumps({"fingerprint": fp, "output": output}, protocol=pickle.HIGHEST_PROTOCOL)
        return atomicfiles.write_bytes(self.path(j), data)
