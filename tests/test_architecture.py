"""The package's layers, read from its own imports with ``ast``.

Data flows one way (``docs/architecture.md``): base modules and records at the bottom,
then meters, then the event engine (``torchmem.events``), then collectors beside
renderers, then front ends. Nothing imports upward,
no two modules import each other (directly or round a circle), renderers read records
and sizes only, collectors reach a renderer only from inside a function (to print a
report), private names stay in the module that defines them, and PyTorch's and
CPython's private symbols are used in ``torchmem._compat`` alone.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "torchmem"

BASE = {"torchmem.errors", "torchmem.units", "torchmem.resolve", "torchmem._compat"}
BASE |= {"torchmem._version", "torchmem._objects"}
COLLECTORS = {
    "torchmem.trace",
    "torchmem.lines",
    "torchmem.tensors",
    "torchmem.oom",
    "torchmem.cells",
    "torchmem.devices",
    "torchmem.courtesy",
    "torchmem.recording",
    "torchmem.report",
    "torchmem.estimator",
    "torchmem.limits",
    "torchmem.ranks",
    "torchmem.snapshot",
}
FRONT_ENDS = {"torchmem", "torchmem.__main__", "torchmem.notebook", "torchmem.cli"}
FRONT_ENDS |= {"torchmem.restore", "torchmem.pytest_plugin"}
MAX_LINES = 500


def layer(module: str) -> str:
    """The layer of a module of the package, by its dotted name."""
    for name, members in (("base", BASE), ("collectors", COLLECTORS), ("front ends", FRONT_ENDS)):
        if any(module == m or module.startswith(f"{m}.") for m in members - {"torchmem"}):
            return name
    if module == "torchmem":
        return "front ends"
    for name in ("records", "meters", "events", "render"):
        if module == f"torchmem.{name}" or module.startswith(f"torchmem.{name}."):
            return name
    raise AssertionError(f"{module} belongs to no layer: add it to one in {__file__}")


MAY_IMPORT = {
    "base": {"base"},
    "records": {"base", "records"},
    "meters": {"base", "records", "meters"},
    "events": {"base", "records", "meters", "events"},
    "render": {"base", "records", "render"},
    "collectors": {"base", "records", "meters", "events", "collectors"},
    "front ends": {"base", "records", "meters", "events", "render", "collectors", "front ends"},
}
"""What each layer may import at module level. Collectors may also import renderers
inside a function, to print a report."""


@dataclass(frozen=True)
class Import:
    source: str
    """The importing module."""
    target: str
    """The module imported (a submodule where ``from package import submodule``)."""
    names: tuple[str, ...]
    """The names taken from it (empty for ``import x``)."""
    line: int
    deferred: bool
    """Inside a function (runs when called), or under ``if TYPE_CHECKING`` (never runs)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(target: str, names: tuple[str, ...]) -> list[str]:
    """The package modules an import loads: each name that is a submodule, else `target`."""
    submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
    return submodules or [target]


def imports(module: str) -> Iterator[Import]:
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    yield from _walk(module, tree, deferred=False)


def _walk(module: str, node: ast.AST, deferred: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield Import(module, alias.name, (), child.lineno, deferred)
        elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
            names = tuple(alias.name for alias in child.names)
            for target in resolve(child.module, names):
                yield Import(module, target, names, child.lineno, deferred)
        else:
            later = deferred or isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                later = True
            yield from _walk(module, child, later)


def ours(found: Import) -> bool:
    return found.target == "torchmem" or found.target.startswith("torchmem.")


ALL = [i for m in MODULES for i in imports(m)]


def test_every_module_has_a_layer() -> None:
    assert {m: layer(m) for m in MODULES}


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}
"""Underscored, but the public API of every named tuple."""


def defined_names(source: str) -> set[str]:
    """The underscored names `source` defines: functions, classes, and names and
    attributes it assigns."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return {name for name in found if name.startswith("_")}


def foreign_private_attributes(source: str, ours: set[str]) -> Iterator[str]:
    """Attributes such as ``module._parameters`` or ``op._schema`` in `source`: an
    underscored attribute of an object other than ``self`` or ``cls`` that no module of
    the package defines (so another library's private part). PyTorch's operators
    (``torch.ops.aten._to_copy``) and named tuples' API are public."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in ours | NAMEDTUPLE_API:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if ast.unparse(node).startswith(("torch.ops.", "aten.")):
            continue
        yield f"line {node.lineno}: {ast.unparse(node)}"


def test_other_libraries_private_attributes_go_through_compat() -> None:
    ours = set().union(*(defined_names(p.read_text()) for p in MODULES.values()))
    wrong = {
        m: list(foreign_private_attributes(p.read_text(), ours))
        for m, p in MODULES.items()
        if not m.startswith("torchmem._compat")
    }
    assert {m: uses for m, uses in wrong.items() if uses} == {}


def test_the_private_attribute_finder_finds_them() -> None:
    source = """
params = module._parameters
mutable = op._schema.is_mutable
mine = window._fold(3)
point = point._replace(x=1)
copy = torch.ops.aten._to_copy
kept = self._private
"""
    found = [use.split(": ")[1] for use in foreign_private_attributes(source, {"_fold"})]
    assert found == ["module._parameters", "op._schema"]


CPP = PACKAGE / "meters" / "cpu_allocator.cpp"


def test_the_cpp_library_exports_exactly_what_python_calls() -> None:
    """No C function of the counting allocator's library is dead, and none Python calls
    is missing (``ctypes`` would find out only at the call)."""
    import re

    exported = set(re.findall(r"^[\w*]+\*? (torchmem_\w+)\(", CPP.read_text(), re.M))
    called = {  # where the library is loaded and used
        name
        for folder in ("meters", "events")
        for path in (PACKAGE / folder).glob("*.py")
        for name in re.findall(r"\.(torchmem_\w+)\b", path.read_text())
    }
    assert exported and exported == called


def test_the_cpp_reads_cpythons_internals_only_where_a_version_is_checked() -> None:
    """CPython's internal headers (the frames' layout) are included only under a check of
    the version they were written for, as the load-time check of the walk expects."""
    lines = CPP.read_text().splitlines()
    internal = [i for i, line in enumerate(lines) if "#include <internal/" in line]
    assert internal
    for i in internal:
        opened = [line for line in lines[:i] if line.startswith("#if") and "PY_VERSION_HEX" in line]
        assert opened, f"cpu_allocator.cpp:{i + 1} includes CPython internals unguarded"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_upward(module: str) -> None:
    mine = layer(module)
    wrong = [
        f"line {i.line}: {i.target} ({layer(i.target)})"
        for i in ALL
        if i.source == module
        and ours(i)
        and layer(i.target) not in MAY_IMPORT[mine]
        and not (i.deferred and mine == "collectors" and layer(i.target) == "render")
    ]
    assert not wrong, f"{module} ({mine}) imports upward: {wrong}"


def test_renderers_read_records_and_sizes_only() -> None:
    allowed = ("torchmem.units", "torchmem.errors", "torchmem.records", "torchmem.render")
    wrong = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in ALL
        if layer(i.source) == "render" and ours(i) and not i.target.startswith(allowed)
    ]
    assert not wrong


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("when", ["at import", "ever"])
def test_no_import_cycles(when: str) -> None:
    """No circle of imports among the package's modules: of those that run at import,
    nor of any that can run at all (inside functions too; ``TYPE_CHECKING`` ones never
    run). The package's own ``__init__``, which re-exports everything lazily, is left
    out."""
    edges: dict[str, set[str]] = {}
    for i in ALL:
        wanted = when == "ever" or not i.deferred
        if wanted and ours(i) and i.source != "torchmem" and i.target != "torchmem":
            edges.setdefault(i.source, set()).add(i.target)
    assert cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_imports_a_front_end() -> None:
    wrong = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in ALL
        if ours(i)
        and layer(i.target) == "front ends"
        and layer(i.source) != "front ends"
        # `import torchmem.x` loads the package first, which imports nothing eagerly
        and i.target != "torchmem"
    ]
    assert not wrong


def test_no_private_names_cross_modules() -> None:
    wrong = [
        f"{i.source}:{i.line} takes {name} from {i.target}"
        for i in ALL
        if ours(i) and i.source != i.target
        for name in i.names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not wrong


PRIVATE_ROOTS = ("torch", "sys", "threading", "_thread")


def private_uses(source: str) -> Iterator[str]:
    """Uses of private symbols of PyTorch or CPython in `source`: imports from a private
    module or of a private name, and attributes such as ``torch._C`` or ``sys._getframe``."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            names = [a.name for a in node.names]
            if root in PRIVATE_ROOTS and (
                any(p.startswith("_") for p in node.module.split("."))
                or any(n.startswith("_") and not n.startswith("__") for n in names)
            ):
                yield f"line {node.lineno}: from {node.module} import {', '.join(names)}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in PRIVATE_ROOTS and any(p.startswith("_") for p in parts):
                    yield f"line {node.lineno}: import {alias.name}"
        elif isinstance(node, ast.Attribute):
            chain = ast.unparse(node).split(".")
            if chain[0] in PRIVATE_ROOTS and any(
                p.startswith("_") and not p.startswith("__") for p in chain[1:]
            ):
                yield f"line {node.lineno}: {ast.unparse(node)}"


def test_private_pytorch_and_cpython_symbols_go_through_compat() -> None:
    wrong = {
        m: list(private_uses(p.read_text()))
        for m, p in MODULES.items()
        if not m.startswith("torchmem._compat")
    }
    assert {m: uses for m, uses in wrong.items() if uses} == {}


def test_the_private_use_finder_finds_them() -> None:
    source = """
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree
import torch._dynamo
frame = sys._getframe(1)
compiled = torch._C._dynamo
fine = torch.cuda.memory_allocated
"""
    lines = sorted({int(use.split(":")[0].removeprefix("line ")) for use in private_uses(source)})
    assert lines == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_500_lines(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines"


MAX_FUNCTION_LINES = 60


def long_functions(source: str) -> Iterator[tuple[int, str, int]]:
    """``(line, name, lines)`` of each function or method in `source` longer than
    MAX_FUNCTION_LINES, counted from its ``def`` to its last line: its decorators are left
    out, and a nested function counts on its own and inside its parent."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield node.lineno, node.name, lines


def test_no_function_is_over_60_lines() -> None:
    wrong = [
        f"{path.relative_to(SRC.parent)}:{line} {name} ({lines} lines)"
        for path in MODULES.values()
        for line, name, lines in long_functions(path.read_text())
    ]
    assert not wrong, f"functions over {MAX_FUNCTION_LINES} lines, to split: {wrong}"


def test_the_long_function_finder_counts_as_said() -> None:
    body = "x = 1\n" * (MAX_FUNCTION_LINES - 2) + "return x\n"
    source = (
        "@decorator\n@decorator\ndef fits():\n"  # 60 lines from its def, 62 from its decorator
        + textwrap.indent(body, " " * 4)
        + "class C:\n    def over(self):\n        def inner():\n"  # inner: 60; over: 62
        + textwrap.indent(body, " " * 12)
        + "        return inner\n"
    )
    line = source.splitlines().index("    def over(self):") + 1
    assert list(long_functions(source)) == [(line, "over", MAX_FUNCTION_LINES + 2)]


def exception_classes(source: str) -> Iterator[str]:
    """The public classes defined in `source` whose bases name an exception or warning."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            bases = [ast.unparse(base) for base in node.bases]
            if any(b.endswith(("Error", "Exception", "Warning", "OutOfMemory")) for b in bases):
                yield node.name


def test_every_error_lives_in_errors_under_one_base() -> None:
    import torchmem.errors as errors

    elsewhere = {
        module: found
        for module, path in MODULES.items()
        if module != "torchmem.errors" and (found := list(exception_classes(path.read_text())))
    }
    assert not elsewhere, "torchmem's exceptions belong in torchmem.errors"
    mine = list(exception_classes(MODULES["torchmem.errors"].read_text()))
    assert {"BuildError", "EstimateError", "OutOfMemory", "UsageError"} <= set(mine)
    for name in mine:
        kind = getattr(errors, name)
        assert issubclass(kind, (errors.TorchmemError, errors.TorchmemWarning)), name


def test_the_tests_mirror_the_package() -> None:
    """A folder of tests is named after the subpackage it tests."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders and folders <= {p.name for p in PACKAGE.iterdir() if p.is_dir()}
