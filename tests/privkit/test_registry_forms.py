"""Every registry entry's forms resolve: one entry per method names its single run, its batched
form and its Flower port (issue 31, item 4), and each named object exists and has the right kind."""

from __future__ import annotations

import pytest

from privkit.methods import REGISTRY, flower_methods


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_form_a_method_names_resolves(name):
    spec = REGISTRY[name]
    assert callable(spec.fn)
    if spec.batched is not None:
        assert callable(spec.batched_fn)
    if spec.flower is not None:
        pytest.importorskip("flwr")
        from privkit.flower_engine.apps import Port

        assert issubclass(spec.flower_port, Port)


def test_forms_a_method_lacks_are_refused_by_name():
    from privkit.errors import PrivkitError
    from privkit.methods import TrainerConfig, TrainerSpec

    spec = TrainerSpec("toy", TrainerConfig, lambda *args: None, "a toy without other forms")
    assert spec.batched is None and spec.flower is None
    with pytest.raises(PrivkitError, match="toy has no batched form"):
        _ = spec.batched_fn
    with pytest.raises(PrivkitError, match="toy does not run on Flower"):
        _ = spec.flower_port


def test_the_flower_methods_are_those_with_a_port():
    assert flower_methods() == tuple(sorted(n for n, s in REGISTRY.items() if s.flower))
    assert "dp-fedavg" in flower_methods() and "dpsgd" not in flower_methods()
