"""Canary records inside one client of a federated method: placement, and the audit's verdict on a
non-private method (caught) and on DP-FedAvg (not), on scikit-learn's 8x8 digits for speed."""

import numpy as np
import pytest

from privkit.audit.federated_canaries import audit_client_canaries, federation_with_canaries
from privkit.data import FederationConfig, build_federation
from privkit.errors import PrivkitError
from privkit.trainers import get_trainer

DELTA = 1e-5


@pytest.fixture(scope="module")
def fed():
    return build_federation(
        FederationConfig(
            dataset="digits",
            public_dataset=None,
            public_size=0.1,
            clients=4,
            partition="iid",
            shadow_size=0.25,
        )
    )


def test_canaries_go_into_one_client_only(fed):
    rng = np.random.default_rng(0)
    cx = rng.random((10,) + fed.input_shape).astype(np.float32)
    cy = rng.integers(0, 10, 10)
    inc = np.array([True, False] * 5)
    new = federation_with_canaries(fed, 2, cx, cy, inc)
    for k in (0, 1, 3):
        np.testing.assert_array_equal(new.clients[k], fed.clients[k])
    added = np.setdiff1d(new.clients[2], fed.clients[2])
    assert len(added) == 5
    np.testing.assert_array_equal(new.private.x[added], cx[inc])
    np.testing.assert_array_equal(new.private.y[added], cy[inc])
    np.testing.assert_array_equal(new.test, fed.test)
    np.testing.assert_array_equal(new.private.x[: len(fed.private.y)], fed.private.x)


def test_non_private_method_is_caught_through_one_client(fed):
    cfg = {**get_trainer("centralized").quick_config(), "epochs": 30, "lr": 0.1, "batch_size": 64}
    out = audit_client_canaries(
        fed, "centralized", cfg, delta=DELTA, n=400, kind="ood", seed=0, accounted_epsilon=0.5
    )
    assert out["status"] == "violation", out["message"]
    assert out["inclusion"] == "random" and out["canaries"]["n"] == 400


def test_dp_fedavg_client_claim_holds(fed):
    cfg = get_trainer("dp-fedavg").quick_config()
    out = audit_client_canaries(fed, "dp-fedavg", cfg, delta=DELTA, n=300, kind="mislabel", seed=1)
    assert out["accounted_epsilon"] is not None and np.isfinite(out["accounted_epsilon"])
    assert out["status"] != "violation", out["message"]


def test_bad_client_and_pool(fed):
    cfg = get_trainer("centralized").quick_config()
    with pytest.raises(PrivkitError, match="client must be in"):
        audit_client_canaries(fed, "centralized", cfg, delta=DELTA, client=9)
    with pytest.raises(PrivkitError, match="shadow pool size"):
        audit_client_canaries(fed, "centralized", cfg, delta=DELTA, n=10_000)
