"""Fixtures for the tests of privkit's run audits."""

import pytest
from audit_helpers import make_run, tiny_federation_config


@pytest.fixture(scope="session")
def central_run(tmp_path_factory):
    return make_run(
        tmp_path_factory.mktemp("runs"),
        "centralized",
        tiny_federation_config(),
        {"arch": "mlp", "epochs": 5},
    )
