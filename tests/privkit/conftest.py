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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (their timing and float order match the audits')."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def task():
    """A Flower task identity, so that messages can be made outside a run (as run_inprocess does)."""
    from flwr.supercore.task_identity import TaskIdentity

    previous = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = previous
