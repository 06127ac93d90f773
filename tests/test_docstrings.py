"""Docstrings a maintainer can rely on.

- Every public function and method of ``privkit`` (a name in a public module's ``__all__``, which
  ``docs/api/privkit.md`` documents, and the public methods of its classes) that takes three or more
  parameters documents each of them in a numpy-style ``Parameters`` section (a class documents its
  constructor in its own docstring: ``merge_init_into_class``).
- Every Sphinx role in a docstring of the four packages (``:func:`x```, ``:class:`x```, ``:mod:`x```,
  ``:meth:`x```, ``:attr:`x```, ``:data:`x```) names an object that exists: the target is resolved by
  import, as Sphinx would resolve it (fully qualified, else relative to the docstring's module and
  class). mkdocstrings renders these roles as text and checks none of them, so this test is what
  makes a dangling reference fail CI.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import sys
from pathlib import Path

import griffe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_public_api import PAGES, _defining_path, _loader

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("accountants", "attacks", "privkit", "reports")

# files exempted (paths relative to the repository root); none now
PENDING: tuple[str, ...] = ()
# single functions exempted (dotted paths); none now
LEFT: tuple[str, ...] = ()


# ---------------------------------------------------------------- Parameters sections

PARAMETERS = (griffe.DocstringSectionKind.parameters, griffe.DocstringSectionKind.other_parameters)
ATTRIBUTES = griffe.DocstringSectionKind.attributes


def _public_functions(loader: griffe.GriffeLoader) -> dict[str, griffe.Function]:
    """Public functions of privkit's API pages, and the public methods and constructors of its classes."""
    found: dict[str, griffe.Function] = {}
    for module in PAGES["privkit"]:
        for name in importlib.import_module(module).__all__:
            path = _defining_path(module, name, loader)
            try:
                obj = loader.modules_collection[path]
            except KeyError:  # a constant exported lazily
                continue
            if obj.is_function:
                found[obj.path] = obj
            elif obj.is_class:
                for member_name, member in obj.members.items():
                    target = member.final_target if member.is_alias else member
                    public = member_name == "__init__" or not member_name.startswith("_")
                    if public and target.is_function:
                        found[f"{obj.path}.{member_name}"] = target
    return found


def _documented(
    docstring: griffe.Docstring | None, *kinds: griffe.DocstringSectionKind
) -> set[str]:
    """Names that the ``kinds`` sections of a numpy-style docstring document."""
    names: set[str] = set()
    if docstring is None:
        return names
    for section in docstring.parse(griffe.Parser.numpy, warnings=False):
        if section.kind in kinds:
            names |= {parameter.name.lstrip("*") for parameter in section.value}
    return names


def undocumented_parameters() -> list[str]:
    """``file:line path: missing names`` of each public privkit function with 3+ parameters."""
    loader = _loader()
    out = []
    for path, function in sorted(_public_functions(loader).items()):
        names = [p.name for p in function.parameters if p.name not in ("self", "cls")]
        if len(names) < 3:
            continue
        documented = _documented(function.docstring, *PARAMETERS)
        if function.name == "__init__":  # the class documents its constructor (a dataclass its
            # fields, which are its constructor's parameters, as Parameters or Attributes)
            documented |= _documented(function.parent.docstring, *PARAMETERS, ATTRIBUTES)  # type: ignore[union-attr]
        missing = [name for name in names if name not in documented]
        where = str(function.relative_filepath)
        if missing and not where.startswith(PENDING) and path not in LEFT:
            out.append(f"{where}:{function.lineno} {path}: {', '.join(missing)}")
    return out


def test_public_functions_document_their_parameters():
    missing = undocumented_parameters()
    assert not missing, (
        "public functions with three or more parameters must document each in a numpy-style "
        "'Parameters' section; missing:\n" + "\n".join(missing)
    )


# ---------------------------------------------------------------- Sphinx roles

ROLE = re.compile(r":(?:py:)?(func|class|mod|meth|attr|data|obj|exc|const):`([^`]+)`")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _docstrings(tree: ast.Module) -> list[tuple[int, str, list[ast.ClassDef]]]:
    """(line, text, enclosing classes) of each bare string statement: docstrings of modules,
    classes and functions, and the attribute docstrings that follow an assignment."""
    out: list[tuple[int, str, list[ast.ClassDef]]] = []

    def visit(node: ast.AST, classes: list[ast.ClassDef]) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.Expr)
                and isinstance(child.value, ast.Constant)
                and isinstance(child.value.value, str)
            ):
                out.append((child.lineno, child.value.value, classes))
            inner = classes + [child] if isinstance(child, ast.ClassDef) else classes
            visit(child, inner)

    visit(tree, [])
    return out


def _instance_attributes(klass: ast.ClassDef) -> set[str]:
    """Names a class's methods assign on ``self`` (``self.x = ...``, ``self.x, self.y = ...``)."""
    return {
        node.attr
        for node in ast.walk(klass)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def _resolve_dotted(target: str) -> bool:
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not _has(obj, attribute):
                return False
            obj = getattr(obj, attribute, None) if hasattr(obj, attribute) else None
        return True
    return False


def _has(obj: object, name: str) -> bool:
    """Whether ``obj.name`` exists, counting annotated (dataclass, pydantic) and slot fields."""
    if hasattr(obj, name):
        return True
    for klass in getattr(obj, "__mro__", ()):
        if name in getattr(klass, "__annotations__", {}) or name in getattr(
            klass, "model_fields", {}
        ):
            return True
    return False


def resolves(target: str, module: str, classes: list[ast.ClassDef]) -> bool:
    """Whether a role's target names an object: fully qualified, else looked up as Sphinx does
    from the docstring's classes (innermost first, instance attributes included), its module's
    namespace (its imports included), the builtins and its sibling modules."""
    target = re.sub(r"\s+", "", target).lstrip("~!")  # a role may wrap over two lines
    if "<" in target:  # ":func:`title <target>`"
        target = target.split("<", 1)[1].rstrip(">")
    target = target.removesuffix("()").lstrip(".")
    if _resolve_dotted(target):
        return True
    namespace = importlib.import_module(module)
    head, *rest = target.split(".")
    scopes: list[object] = []
    obj: object = namespace
    for klass in classes:
        if not rest and head in _instance_attributes(klass):
            return True
        obj = getattr(obj, klass.name, None)
        if obj is None:
            break
        scopes.insert(0, obj)  # innermost class first
    scopes += [namespace, builtins]
    for scope in scopes:
        if _has(scope, head):
            value = getattr(scope, head, None)
            for attribute in rest:
                if value is None or not _has(value, attribute):
                    break
                value = getattr(value, attribute, None)
            else:
                return True
    return _resolve_dotted(f"{module.rpartition('.')[0]}.{target}")  # a sibling submodule


def dangling_references() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, text, classes in _docstrings(tree):
                for match in ROLE.finditer(text):
                    if not resolves(match.group(2), module, classes):
                        offset = text[: match.start()].count("\n")
                        where = path.relative_to(ROOT)
                        out.append(f"{where}:{line + offset} {match.group(0)}")
    return out


def test_sphinx_roles_in_docstrings_resolve():
    dangling = dangling_references()
    assert not dangling, "docstring references to objects that do not exist:\n" + "\n".join(
        dangling
    )


if __name__ == "__main__":
    sys.path[0] = str(ROOT)
    print("\n".join(undocumented_parameters()))
    print("\n".join(dangling_references()))
