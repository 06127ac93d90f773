"""Helpers for the audit tests: tiny federations and run directories written like `privkit train` does.

A module with a unique name (not conftest) so test files can import it whatever else is on sys.path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

SMALL = os.environ.get("PRIVKIT_SLOW") == "small"
#: a DP-FedAvg config that trains in a fraction of a second (release-mode noise)
TINY_DPFED = {
    "arch": "mlp",
    "feature_dim": 16,
    "rounds": 3,
    "local_steps": 3,
    "batch_size": 16,
    "client_fraction": 0.25,
    "noise_multiplier": 1.0,
    "target_epsilon": 1e6,
    "lr": 0.3,
    "device": "cpu",
}
#: a FedAvg config (Adam) that trains in a fraction of a second
TINY_FEDAVG = {
    "arch": "mlp",
    "feature_dim": 16,
    "rounds": 3,
    "participation": 0.25,
    "local_epochs": 2,
    "batch_size": 32,
    "device": "cpu",
}


#: a FedMD config (parties trained with Adam) that trains in a second or two
TINY_FEDMD = {
    "arch": "mlp",
    "feature_dim": 16,
    "rounds": 2,
    "init_epochs": 2,
    "pretrain_epochs": 1,
    "public_subset": 100,
    "digest_epochs": 1,
    "revisit_batch_size": 8,
    "device": "cpu",
}


def tiny_federation_config(**kw):
    from privkit.data import FederationConfig

    base = dict(
        dataset="digits",
        public_dataset=None,
        public_size=0.1,
        clients=2,
        partition="iid",
        test_size=0.25,
        shadow_size=0.25,
        seed=0,
    )
    base.update(kw)
    return FederationConfig(**base)


def make_run(
    root: Path, method: str, fed_cfg, overrides: dict | None = None, seed: int = 0
) -> Path:
    """Train ``method`` (quick config + overrides) and write a run directory."""
    from privkit.data import build_federation
    from privkit.trainers import get_trainer, train

    torch.set_num_threads(1)
    fed = build_federation(fed_cfg)
    cfg = {**get_trainer(method).quick_config(), **(overrides or {})}
    res = train(method, fed, cfg, seed=seed)
    out = root / method
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "method": method,
                "seed": seed,
                "federation": fed_cfg.model_dump(mode="json"),
                "trainer": res.config,
            }
        )
    )
    fed.save(out / "federation.json")
    res.save(out)
    return out


def subset_federations(fed, n: int, fraction: float = 0.8, seed: int = 0) -> list:
    """``n`` federations like ``fed`` over random subsets (``fraction`` of them) of its client
    records, as an audit's runs train on."""
    import numpy as np

    from privkit.audit.recipes import federation_over

    rng = np.random.default_rng(seed)
    x, y = fed.private.x[fed.members], fed.private.y[fed.members]
    out = []
    for j in range(n):
        ix = np.sort(rng.choice(len(y), int(fraction * len(y)), replace=False))
        out.append(federation_over(fed, x[ix], y[ix], seed=j))
    return out


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest absolute difference between two models' weights (same architecture)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)
