"""The house rules, read from the source: the service never imports the lab (bench/), no package
imports itself round in a loop, files and served functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "gateway", "cache_service", "cli", "worker", "bench")
SERVICE = ("protocol", "gateway", "cache_service", "cli", "worker")
LAB_DOORS = {"cli/main.py"}  # `verity bench` and `verity distill` hand their command line to bench.cli
MAX_FILE_LINES, MAX_TEST_FILE_LINES, MAX_FUNCTION_LINES = 500, 700, 60


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """The project modules `path` imports (at its top level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if not top_level_only else _top_level(tree.body)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] in PACKAGES}


def _top_level(body: list[ast.stmt]):
    """Import statements that run when the module is imported (also under if/try, TYPE_CHECKING too)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_the_service_never_imports_the_lab():
    modules = _modules()
    offenders = []
    for module, path in modules.items():
        rel = str(path.relative_to(ROOT))
        if module.split(".")[0] not in SERVICE or rel in LAB_DOORS:
            continue
        offenders += [f"{rel} imports {n}" for n in _imports(path, module, top_level_only=False) if n.split(".")[0] == "bench"]
    assert not offenders, offenders


def test_the_lab_doors_import_the_lab_only_when_called():
    for rel in LAB_DOORS:
        module = rel.removesuffix(".py").replace("/", ".")
        assert not [n for n in _imports(ROOT / rel, module, top_level_only=True) if n.startswith("bench")]


def test_no_import_loops():
    modules = _modules()
    graph = {m: {r for n in _imports(p, m, top_level_only=True) if (r := _resolve(n, modules)) and r != m}
             for m, p in modules.items()}
    for m in list(graph):  # a package's __init__ runs before any of its modules
        for parent in _parents(m):
            if parent in graph and parent != m:
                graph[m].add(parent)
    loop = _find_loop(graph)
    assert loop is None, " -> ".join(loop)


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports that are not a package's own __init__ pulling its submodules in."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if m.startswith(n + ".") or n.startswith(m + "."):
                continue  # a module and its own package (re-exports in __init__)
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (loop := visit(n)):
                return loop
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (loop := visit(m)):
            return loop
    return None


def test_the_loop_finder_finds_a_loop():
    assert _find_loop({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) == ["a.x", "a.y", "a.z", "a.x"]
    assert _find_loop({"a.x": {"a.y"}, "a.y": set()}) is None


def test_files_stay_small():
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    big += [f"{p.relative_to(ROOT)} ({n} lines)" for p in (ROOT / "tests").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_TEST_FILE_LINES]
    assert not big, big


def test_served_functions_stay_short():
    long = []
    for pkg in SERVICE:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists each package by name: one left out installs without its files."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert found == listed


# the standard library's: os._exit is documented
STDLIB_PRIVATE = {"os._exit"}


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """`x._name` where x is not self or cls (a private name read or written from outside its owner)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue  # an inherited method of its own
            if ast.unparse(node) in STDLIB_PRIVATE:
                continue
            out.append((node.lineno, ast.unparse(node)))
    return out


def _swaps(tree: ast.AST) -> list[tuple[int, str]]:
    """Assignments that swap a class (`x.__class__ = ...`) or a name inside an imported module."""
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("mlx")
               for a in n.names} | {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                                    for a in n.names if a.name.startswith("mlx")}
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and (t.attr == "__class__" or
                                                 isinstance(t.value, ast.Name) and t.value.id in modules):
                out.append((node.lineno, ast.unparse(t)))
    return out


def test_the_service_reads_no_private_name_and_swaps_nothing():
    """No private attribute of another object (mlx-lm's, MLX's, aiohttp's) is read or written,
    and no class or module function is swapped: a library's new version cannot silently break
    the service through them."""
    found = []
    for pkg in SERVICE:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            found += [f"{path.relative_to(ROOT)}:{n} {what}" for n, what in _private_reads(tree) + _swaps(tree)]
    assert not found, found


def test_the_private_name_check_finds_them():
    tree = ast.parse("a._b = 1\nx = gen._generation_batch\nself._ok = 2\nm.__class__ = Y\n"
                     "from mlx_lm.models import qwen3_5\nqwen3_5.gated_delta_update = f\n")
    assert [w for _, w in _private_reads(tree)] == ["a._b", "gen._generation_batch"]
    assert [w for _, w in _swaps(tree)] == ["m.__class__", "qwen3_5.gated_delta_update"]
