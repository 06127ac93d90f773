"""The libraries (accountants, attacks, reports) never import the privkit application.

Two checks: a static scan of every module's syntax tree (every ``import`` / ``from ... import``,
wherever it sits: top level, inside functions, under ``TYPE_CHECKING``), and importing every
module of the three packages in a fresh interpreter in which ``privkit`` cannot be imported.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("atomicfiles", "accountants", "attacks", "reports")


def _privkit_imports(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names = [str(node.args[0].value)]
        found += [
            f"{path.relative_to(root)}:{node.lineno} imports {n}"
            for n in names
            if n == "privkit" or n.startswith("privkit.")
        ]
    return found


@pytest.mark.parametrize("package", LIBRARIES)
def test_no_module_of_a_library_imports_privkit(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"no modules found under {package}/"
    offending = [hit for m in modules for hit in _privkit_imports(m)]
    assert offending == []


def test_the_scan_sees_every_form_of_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import privkit\nfrom privkit.data import x\n"
        "def f():\n    import privkit.models as m\n"
        "import importlib\nimportlib.import_module('privkit.trainers')\n"
    )
    assert len(_privkit_imports(bad, tmp_path)) == 4
    (tmp_path / "good.py").write_text("import privkitten\nfrom .privkit import y\nimport attacks\n")
    assert _privkit_imports(tmp_path / "good.py", tmp_path) == []


BLOCK_AND_IMPORT = """
import importlib, pkgutil, sys

class NoPrivkit:
    def find_spec(self, name, path=None, target=None):
        if name == "privkit" or name.startswith("privkit."):
            raise ImportError(f"privkit is not importable in this test; {name} was asked for")
        return None

sys.meta_path.insert(0, NoPrivkit())
for lib in LIBRARIES:
    pkg = importlib.import_module(lib)
    for info in pkgutil.walk_packages(pkg.__path__, lib + "."):
        importlib.import_module(info.name)
loaded = sorted(m for m in sys.modules if m == "privkit" or m.startswith("privkit."))
assert not loaded, loaded
print("ok")
"""


def test_libraries_import_with_privkit_unimportable():
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_AND_IMPORT.replace("LIBRARIES", repr(LIBRARIES))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"
