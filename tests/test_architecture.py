"""The floors of the package (docs/architecture.md): imports point one way and form no cycle.

Every ``import`` of a slimkv module counts, at module level or inside a function, so a
function-level import cannot hide an arrow back up. A module may import modules of its own
package (without cycles) and of packages on LOWER floors only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import slimkv

PACKAGE = Path(slimkv.__file__).parent

# package (first name under slimkv) -> floor; the root package and __main__ sit on top
FLOORS = {
    "common": 0,
    "ops": 1,
    "data": 1,
    "pretrained": 1,
    "scoring": 1,
    "attention": 2,
    "compress": 2,
    "model": 3,
    "train": 4,
    "eval": 5,
    "convert": 5,
    "bench": 6,
    "retrieval": 6,
    "recall": 7,
    "demo": 8,
    "cli": 9,
    "__main__": 10,
    "": 10,
}


def module_name(path: Path) -> str:
    parts = ("slimkv", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The slimkv modules ``path`` imports (a ``from pkg import sub`` of a submodule counts as sub)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "slimkv")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "slimkv" and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, set(known)) for name, path in known.items()}


def test_every_package_has_a_floor():
    assert {package_of(m) for m in modules()} <= set(FLOORS), "a new package needs a floor in FLOORS (and in docs/architecture.md)"


def test_imports_only_point_down():
    wrong = []
    for module, targets in graph().items():
        for target in targets:
            source_pkg, target_pkg = package_of(module), package_of(target)
            if source_pkg != target_pkg and FLOORS[target_pkg] >= FLOORS[source_pkg]:
                wrong.append(f"{module} (floor {FLOORS[source_pkg]}) imports {target} (floor {FLOORS[target_pkg]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt in edges and state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(edges):
        if state.get(start) is None:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


MAX_MODULE_LINES = 450  # a module a newcomer reads in one sitting (docs/architecture.md)


def test_every_module_is_short_enough_to_read_in_one_sitting():
    long = {str(path.relative_to(PACKAGE)): n for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
