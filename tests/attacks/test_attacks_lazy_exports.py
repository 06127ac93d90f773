"""``attacks`` resolves its public names lazily: each is its submodule's object, and importing the
package, or a light submodule of it as a training does, loads neither scikit-learn nor torch."""

import json
import subprocess
import sys

import pytest

import attacks


def test_every_public_name_resolves_to_its_submodule():
    for name in attacks.__all__:
        value = getattr(attacks, name)
        module = __import__(f"attacks.{attacks._MODULE_OF[name]}", fromlist=["x"])
        assert getattr(module, attacks._RENAMED.get(name, name)) is value, name
    assert attacks.one_run_epsilon is attacks.one_run.epsilon_lower_bound


def test_a_submodule_is_an_attribute_and_unknown_names_are_attribute_errors():
    assert attacks.metrics.auc is attacks.auc
    with pytest.raises(AttributeError, match="no_such_name"):
        attacks.no_such_name  # noqa: B018


def test_package_and_light_submodules_load_no_heavy_library():
    """``audit_scores`` and ``one_run_fdp`` (functions that name a submodule too) stay the
    functions after their submodules are imported, in a fresh process."""
    code = (
        "import json, sys, attacks, attacks.conv_layout; "
        "heavy = sorted(m for m in ('sklearn', 'torch', 'catboost') if m in sys.modules); "
        "import attacks.audit_scores, attacks.one_run_fdp; from attacks import audit_scores; "
        "print(json.dumps([heavy, callable(audit_scores), callable(attacks.audit_scores), "
        "callable(attacks.one_run_fdp)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [[], True, True, True]
