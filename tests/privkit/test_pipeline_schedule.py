"""Order in which parallel workers take the methods' stages (privkit.pipeline.workers)."""

from types import SimpleNamespace

from privkit.pipeline.workers import _priority


class _Status:
    def __init__(self, seconds: dict):
        self.seconds = seconds

    def stage(self, key: str, stage: str) -> dict:
        return {"seconds": self.seconds[key]} if key in self.seconds and stage == "train" else {}


def _plan(key: str, todo: list, status: _Status):
    return SimpleNamespace(m=SimpleNamespace(key=key), todo=todo, status=status)


def test_trains_first_in_config_order_then_longest_trainer_first():
    status = _Status({"a": 1.0, "b": 30.0, "c": 5.0})
    plans = [
        _plan("a", ["account", "audit"], status),
        _plan("b", ["audit"], status),
        _plan("c", ["account", "audit"], status),
        _plan("d", ["train", "account", "audit"], status),
        _plan("e", ["train", "account", "audit"], status),
    ]
    controls = SimpleNamespace(m=SimpleNamespace(key="controls"))  # one step, no todo list
    plans.insert(0, controls)
    order = [p.m.key for p in sorted(plans, key=_priority)]  # sorted is stable, as min() is
    assert order == ["controls", "d", "e", "b", "c", "a"]
    assert min(plans, key=_priority) is controls
