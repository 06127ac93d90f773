"""Audits that resume model by model (issue 33, item 2): ``audit_recipe`` with ``checkpoints``,
SIGKILLed after k of its models, re-run: the k finished models are loaded, not trained again
(the recipe counts its trainings), and the result equals an uninterrupted audit's, number for
number; a corrupted checkpoint is named in one line and its model trained again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# a recipe (nearest centroid with seeded jitter: each seed its own model) that logs every
# training to a file and SIGKILLs its own process when it starts training number `kill_at`
SCRIPT = """
import json, os, signal, sys
import numpy as np
from attacks import audit_recipe

log, folder, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
x = rng.normal(size=(48, 4))
y = (x[:, 0] + 0.5 * rng.normal(size=48) > 0).astype(int)

def train(xs, ys, seed):
    with open(log, "a") as fh:
        fh.write(f"{seed}\\n")
    if sum(1 for _ in open(log)) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    jitter = np.random.default_rng(seed).normal(scale=0.1, size=(2, xs.shape[1]))
    centres = np.stack([xs[ys == c].mean(0) for c in (0, 1)]) + jitter

    def proba(q):
        d = -((np.asarray(q)[:, None, :] - centres[None]) ** 2).sum(-1)
        e = np.exp(d - d.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    return proba

res = audit_recipe(train, x, y, delta=1e-3, shadows=4, seed=3, attacks=["threshold", "lira"],
                   checkpoints=None if folder == "-" else folder)
print(json.dumps(res.to_dict()))
"""
MODELS = 5  # the target and 4 reference models


def audit(tmp_path: Path, log: str, folder: str, kill_at: int = 0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / log), folder, str(kill_at)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


def trainings(tmp_path: Path, log: str) -> list[int]:
    return [int(s) for s in (tmp_path / log).read_text().split()]


@pytest.mark.parametrize("k", [2])
def test_a_killed_audit_resumes_with_its_finished_models_and_ends_the_same(tmp_path, k):
    ref = audit(tmp_path, "ref.log", "-")
    assert ref.returncode == 0, ref.stderr
    order = trainings(tmp_path, "ref.log")  # the models' seeds, in training order
    assert len(order) == MODELS
    folder = str(tmp_path / "ckpt")
    killed = audit(tmp_path, "first.log", folder, kill_at=k + 1)  # dies starting model k + 1
    assert killed.returncode == -9, killed.stderr
    assert trainings(tmp_path, "first.log") == order[: k + 1]
    assert sorted(p.name for p in Path(folder).glob("model-*.pkl")) == [
        f"model-{j:03d}.pkl" for j in range(k)
    ]
    again = audit(tmp_path, "again.log", folder)
    assert again.returncode == 0, again.stderr
    assert trainings(tmp_path, "again.log") == order[k:]  # the finished k were not retrained
    assert json.loads(again.stdout) == json.loads(ref.stdout)
    # a third run trains nothing; a corrupted checkpoint is named, retrained, and changes nothing
    assert audit(tmp_path, "third.log", folder).returncode == 0
    assert not (tmp_path / "third.log").exists()
    damaged = Path(folder) / "model-001.pkl"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    fixed = audit(tmp_path, "fixed.log", folder)
    assert fixed.returncode == 0, fixed.stderr
    assert f"{damaged}: checksum mismatch; treated as absent and recomputed" in fixed.stderr
    assert trainings(tmp_path, "fixed.log") == [order[1]]
    assert json.loads(fixed.stdout) == json.loads(ref.stdout)


def test_a_checkpoint_of_another_task_is_not_used(tmp_path):
    import numpy as np

    from attacks.checkpoints import ModelCheckpoints, fingerprint

    store = ModelCheckpoints(tmp_path, key="a")
    fp = fingerprint("a", "r", 7, np.arange(5), np.arange(3), 2)
    store.save(0, fp, {"logits": np.zeros((3, 2)), "details": {}})
    assert store.load(0, fp)["logits"].shape == (3, 2)
    for other in (
        fingerprint("b", "r", 7, np.arange(5), np.arange(3), 2),  # another key
        fingerprint("a", "r", 8, np.arange(5), np.arange(3), 2),  # another seed
        fingerprint("a", "r", 7, np.arange(1, 6), np.arange(3), 2),  # other records
    ):
        assert other != fp and store.load(0, other) is None


def test_worker_processes_store_their_own_models_and_any_executor_reuses_them(tmp_path):
    """On the process pool each worker stores the model it trained; a serial re-run with one
    checkpoint missing trains that model alone (the others' files untouched) and returns the
    same logits."""
    import numpy as np
    from recipes_for_tests import digits, logreg

    from attacks.checkpoints import ModelCheckpoints
    from attacks.experiment import train_models

    x, y = digits()
    x, y = x[:300], y[:300]
    rng = np.random.default_rng(0)
    index_sets = [np.sort(rng.choice(300, 150, replace=False)) for _ in range(3)]
    store = ModelCheckpoints(tmp_path / "models", key="logreg on 300 digits")
    kw = dict(query=np.arange(40), n_classes=10, checkpoints=store)
    first, _ = train_models(
        logreg, x, y, index_sets, [1, 2, 3], executor="process", workers=2, **kw
    )
    files = [store.path(j) for j in range(3)]
    assert all(p.is_file() for p in files)
    stamps = [p.stat().st_mtime_ns for p in files]
    files[1].unlink()
    again, _ = train_models(logreg, x, y, index_sets, [1, 2, 3], **kw)
    assert np.array_equal(again, first)
    assert [files[0].stat().st_mtime_ns, files[2].stat().st_mtime_ns] == [stamps[0], stamps[2]]
    assert files[1].is_file()
