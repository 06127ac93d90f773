"""``accountants`` resolves its public names lazily: all of them resolve, and importing the package
(or its light modules, as the CLI does to validate input) loads neither dp-accounting nor scipy."""

import json
import subprocess
import sys

import accountants


def test_every_public_name_resolves_to_its_submodule():
    for name in accountants.__all__:
        value = getattr(accountants, name)
        module = accountants._MODULE_OF[name]
        assert getattr(__import__(f"accountants.{module}", fromlist=[name]), name) is value


def test_unknown_name_is_an_attribute_error():
    try:
        accountants.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("accountants.no_such_name resolved")


def test_package_and_light_modules_load_no_heavy_library():
    code = (
        "import json, sys, accountants, accountants._validate, accountants.choices; "
        "print(json.dumps(sorted(m for m in ('dp_accounting', 'scipy', 'torch') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
