"""The torch-free method registry (:mod:`privkit.methods`): validating configs loads no heavy
library, every registration points at its training function, and the old import paths still work."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from privkit.errors import PrivkitError
from privkit.methods import REGISTRY, TrainerConfig, declare, get_trainer, make_config

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "opacus", "catboost", "ray", "dp_accounting", "sklearn", "scipy", "matplotlib")
METHOD_MODULES = sorted(
    p.stem
    for p in (REPO / "privkit" / "methods").glob("*.py")
    if p.stem not in ("__init__", "base", "registry", "contract", "chance")
)

# Every shipped method, its defaults and quick settings validated, plus refused values, in a
# fresh interpreter: which heavy libraries did that import?
VALIDATE_EVERYTHING = """
import json, sys
from pydantic import ValidationError
from privkit.trainers import REGISTRY, get_trainer, make_config
refused = 0
for name in sorted(REGISTRY):
    spec = get_trainer(name)
    make_config(name, spec.quick_config())
    make_config(name, spec.defaults())
    try:
        make_config(name, {"eval_batch_size": 0})
    except ValidationError:
        refused += 1
print(json.dumps({"methods": len(REGISTRY), "refused": refused,
                  "heavy": sorted(m for m in sys.argv[1:] if m in sys.modules)}))
"""


def test_validating_every_method_imports_no_heavy_library():
    proc = subprocess.run(
        [sys.executable, "-c", VALIDATE_EVERYTHING, *HEAVY],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    # other tests may register toy trainers in this process: count the shipped methods only
    shipped = [
        n
        for n, spec in REGISTRY.items()
        if spec.config_cls.__module__.startswith("privkit.methods.")
    ]
    assert out["methods"] == len(shipped) >= 16
    assert out["refused"] == out["methods"]  # eval_batch_size >= 1 holds for every method
    assert out["heavy"] == []


# shipped methods only: test modules collected earlier may have registered toy trainers
@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n, spec in REGISTRY.items()
        if spec.config_cls.__module__.startswith("privkit.methods.")
    ),
)
def test_each_registration_names_its_training_function(name):
    """``target`` is ``privkit.trainers.<m>:<fn>`` for the methods module ``<m>`` declaring it, and
    resolves to a function taking (federation, config, seed, progress)."""
    spec = get_trainer(name)
    module, _, fn_name = spec.target.partition(":")
    declared_in = spec.config_cls.__module__.rsplit(".", 1)[-1]
    assert module.startswith("privkit.trainers.")
    fn = spec.fn
    assert (fn.__module__, fn.__name__) == (module, fn_name)
    assert list(inspect.signature(fn).parameters)[:4] == [
        "federation",
        "config",
        "seed",
        "progress",
    ]
    # the methods module of the same name holds the config (centralized reuses dpsgd's)
    assert declared_in in (module.rsplit(".", 1)[-1], "dpsgd")


@pytest.mark.parametrize("module", METHOD_MODULES)
def test_config_classes_keep_their_trainer_module_import_path(module):
    """``from privkit.trainers.<m> import <Config>`` still gives the class defined in
    ``privkit.methods.<m>`` (the same object, so isinstance checks agree)."""
    methods_mod = importlib.import_module(f"privkit.methods.{module}")
    trainers_mod = importlib.import_module(f"privkit.trainers.{module}")
    classes = [
        obj
        for _, obj in vars(methods_mod).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseModel)
        and obj.__module__ == methods_mod.__name__
    ]
    if module != "centralized":
        assert classes, f"privkit.methods.{module} defines no config class"
    for cls in classes:
        assert getattr(trainers_mod, cls.__name__) is cls


def test_old_import_paths_of_the_registry_still_work():
    from privkit import trainers
    from privkit.methods import contract as base

    assert trainers.REGISTRY is base.REGISTRY is REGISTRY
    assert trainers.TrainerConfig is base.TrainerConfig is TrainerConfig
    assert trainers.get_trainer("dpsgd") is get_trainer("dpsgd")


def test_make_config_refuses_bad_values_and_unknown_methods():
    with pytest.raises(ValidationError, match="epochs"):
        make_config("dpsgd", {"epochs": -1})
    with pytest.raises(ValidationError, match="bogus"):
        make_config("dpsgd", {"bogus": 1})
    with pytest.raises(PrivkitError, match=r"method must be one of .*found 'nosuch'"):
        get_trainer("nosuch")


def test_declaring_a_name_twice_is_refused():
    with pytest.raises(PrivkitError, match="'dpsgd' registered twice"):
        declare("dpsgd", TrainerConfig, "privkit.trainers.dpsgd:train_dpsgd", "again")
    assert get_trainer("dpsgd").config_cls.__name__ == "DpsgdConfig"
