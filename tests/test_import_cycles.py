"""No two files of the project import each other, directly or through others (issue 25, item 4).

A *file-level import cycle* is a cycle in the graph whose nodes are the project's Python files
(``privkit``, ``accountants``, ``attacks``, ``reports``) and whose edges are imports, found by a
static scan of each file's syntax tree, as in ``tests/test_library_imports.py``: every ``import`` /
``from ... import`` (absolute or relative) and ``importlib.import_module("...")`` /
``__import__("...")`` with a literal name, wherever it sits (top level or inside a function), except
under ``if TYPE_CHECKING:``, which never runs. ``from pkg import name`` is an edge to ``pkg/name.py``
when that file exists, else to ``pkg/__init__.py``; importing ``a.b.c`` is an edge to ``a/b/c.py``
only (not to the parents' ``__init__.py`` files Python also runs: a package re-exporting its
submodules is not a cycle by itself).
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("privkit", "accountants", "attacks", "reports", "atomicfiles")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the packages under ``root``."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every import that can run."""
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:  # the else branch does run
                    visit_node(stmt)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            found.extend((target, a.name, node.lineno) for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.append((str(node.args[0].value), None, node.lineno))
        visit(node)

    visit(tree)
    return found


def import_graph(root: Path = ROOT) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """The project's files and, for each, the project files it imports (-> line of the first import)."""
    files = _modules(root)
    edges: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, name, line in _imports(tree, module, path.name == "__init__.py"):
            for candidate in ([f"{target}.{name}"] if name else []) + [target]:
                if candidate in files:
                    if candidate != module:
                        edges.setdefault(module, {}).setdefault(candidate, line)
                    break
    return files, edges


def _components(nodes: list[str], edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _cycle_in(comp: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """One shortest cycle through the component's first file (breadth-first)."""
    start, members = comp[0], set(comp)
    parent: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, {})):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in members and w not in parent:
                parent[w] = v
                queue.append(w)
    return comp


def import_cycles(root: Path = ROOT) -> list[str]:
    """One line per cycle: ``a.py:12 -> b.py:30 -> a.py`` (each file with the line of its import)."""
    files, edges = import_graph(root)
    lines = []
    for comp in _components(sorted(files), edges):
        cyc = _cycle_in(comp, edges)
        hops = [f"{files[a].relative_to(root)}:{edges[a][b]}" for a, b in pairwise(cyc)]
        lines.append(
            " -> ".join([*hops, str(files[cyc[0]].relative_to(root))])
            + (
                f"  (files in this knot: {', '.join(str(files[m].relative_to(root)) for m in comp)})"
                if len(comp) > len(cyc) - 1
                else ""
            )
        )
    return lines


def test_no_file_level_import_cycle():
    files, _ = import_graph()
    assert len(files) > 50, f"the scan found only {len(files)} files"
    cycles = import_cycles()
    assert not cycles, (
        "file-level import cycles (file:line of the import -> next file):\n" + "\n".join(cycles)
    )


def _project(root: Path, files: dict[str, str]) -> Path:
    """A fake project under ``root``: the four packages (empty) plus ``files`` (path -> text)."""
    for rel, text in {**{f"{pkg}/__init__.py": "" for pkg in PACKAGES}, **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_scan_sees_lazy_relative_and_dynamic_imports_but_not_type_checking(tmp_path):
    _project(
        tmp_path,
        {
            "privkit/a.py": "def f():\n    from privkit import b\n",
            "privkit/b.py": "from .a import f\n",
            "reports/x.py": "import importlib\nimportlib.import_module('reports.y')\n",
            "reports/y.py": "import reports.z\n",
            "reports/z.py": "from reports.x import *\n",
            "attacks/p.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from attacks.q import Q\n",
            "attacks/q.py": "from attacks.p import P\n",
        },
    )
    assert import_cycles(tmp_path) == [
        "privkit/a.py:2 -> privkit/b.py:1 -> privkit/a.py",
        "reports/x.py:2 -> reports/y.py:1 -> reports/z.py:1 -> reports/x.py",
    ]


def test_a_package_reexporting_its_submodules_is_no_cycle_unless_one_imports_it_back(tmp_path):
    files = {
        "accountants/sub/__init__.py": "from accountants.sub.m import g\n",
        "accountants/sub/m.py": "import accountants.sub.n\ndef g():\n    pass\n",
        "accountants/sub/n.py": "x = 1\n",
    }
    assert import_cycles(_project(tmp_path / "one", files)) == []
    files["accountants/sub/n.py"] = "def h():\n    import accountants.sub\n"
    assert import_cycles(_project(tmp_path / "two", files)) == [
        (
            "accountants/sub/__init__.py:1 -> accountants/sub/m.py:1 -> accountants/sub/n.py:2 -> "
            "accountants/sub/__init__.py"
        )
    ]


# ----------------------------------------------------------------------------- packages and layers
#: The project's packages from the bottom up (issue 31, item 4). A package imports only packages of
#: lower layers (and itself); packages of one layer never import each other. ``privkit``'s own
#: subpackages and top-level modules are packages here; docs/architecture.md draws the same stack.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("atomicfiles",),
    ("accountants",),
    ("attacks", "reports"),
    ("privkit.errors",),
    (
        "privkit",
        "privkit.config",
        "privkit.jsonutil",
        "privkit.memory",
        "privkit.progress",
        "privkit.models",
    ),
    ("privkit.files",),
    ("privkit.mechanisms",),
    ("privkit.seeding",),
    ("privkit.data", "privkit.methods"),
    ("privkit.trainers",),
    ("privkit.batched", "privkit.precompile"),
    ("privkit.flower_engine",),  # its in-process engine trains through privkit.batched on a GPU
    ("privkit.audit",),
    ("privkit.pipeline",),
    ("privkit.flower",),
    ("privkit.check",),
    ("privkit.cli",),
)


def package_of(module: str) -> str:
    """The package a module belongs to: a library, ``privkit`` itself, or ``privkit.<first part>``."""
    parts = module.split(".")
    return parts[0] if parts[0] != "privkit" or len(parts) == 1 else f"privkit.{parts[1]}"


def layer_violations(root: Path = ROOT, layers=LAYERS) -> list[str]:
    """One line per import that runs up or sideways between packages, or per unlisted package."""
    files, edges = import_graph(root)
    rank = {pkg: i for i, layer in enumerate(layers) for pkg in layer}
    lines = [
        f"package {pkg} is in no layer (add it to LAYERS)"
        for pkg in sorted({package_of(m) for m in files} - set(rank))
    ]
    for a in sorted(edges):
        for b, line in sorted(edges[a].items()):
            pa, pb = package_of(a), package_of(b)
            if pa != pb and pa in rank and pb in rank and rank[pb] >= rank[pa]:
                lines.append(f"{files[a].relative_to(root)}:{line} ({pa}) imports {b} ({pb})")
    return lines


def package_cycles(root: Path = ROOT) -> list[list[str]]:
    """Package-level import cycles: strongly connected components of the package graph."""
    files, edges = import_graph(root)
    graph: dict[str, dict[str, int]] = {}
    for a, targets in edges.items():
        for b in targets:
            if package_of(a) != package_of(b):
                graph.setdefault(package_of(a), {})[package_of(b)] = 0
    return _components(sorted({package_of(m) for m in files}), graph)


def test_no_package_level_import_cycle():
    assert package_cycles() == []


def test_every_import_runs_down_the_layers():
    lines = layer_violations()
    assert not lines, "imports up or across the layers of LAYERS:\n" + "\n".join(lines)


def test_the_layer_check_sees_an_import_up_and_a_package_cycle(tmp_path):
    root = _project(
        tmp_path,
        {
            "privkit/mechanisms/__init__.py": "",
            "privkit/mechanisms/noise.py": "def f():\n    from privkit.audit import report\n",
            "privkit/audit/__init__.py": "",
            "privkit/audit/report.py": "x = 1\n",
            "privkit/audit/run.py": "from privkit.mechanisms.noise import f\n",
            "privkit/newpkg/__init__.py": "",
        },
    )
    assert package_cycles(root) == [["privkit.audit", "privkit.mechanisms"]]
    assert import_cycles(root) == []  # no file-level cycle: only the packages import each other
    assert layer_violations(root) == [
        "package privkit.newpkg is in no layer (add it to LAYERS)",
        "privkit/mechanisms/noise.py:2 (privkit.mechanisms) imports privkit.audit.report (privkit.audit)",
    ]
