"""The engine's packages import only downwards (docs/design/architecture.md).

Every import counts: module level, inside functions, and under
``TYPE_CHECKING``. A package may import its own modules and those of a lower
layer, and modules of one layer may import each other, never in a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pagedlm

ROOT = Path(pagedlm.__file__).parent

# Bottom first. Each name is a top-level module or package of pagedlm.
LAYERS = [
    {"options", "tokenizer"},
    {"kernels", "structured"},
    {"params"},
    {"sampling"},
    {"cache"},
    {"attention"},
    {"models"},
    {"loading"},
    {"parallel"},
    {"speculative"},
    {"batch"},
    {"llm", "generate", "server", "bench", "cli", "__init__"},
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The pagedlm modules ``path`` imports (a ``from package import module`` names the module)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pagedlm"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "pagedlm":
                continue
            submodules = {f"{source}.{a.name}" for a in node.names if _exists(f"{source}.{a.name}")}
            found |= submodules or {source}
    return found


def _exists(module: str) -> bool:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = {_module(p): _imports(p) for p in ROOT.rglob("*.py")}


def test_every_package_has_a_layer():
    tops = {_top(m) for m in GRAPH}
    assert tops <= set(LEVEL), f"add {sorted(tops - set(LEVEL))} to LAYERS"


def test_no_import_runs_back_up():
    upward = sorted(f"{m} -> {o}" for m, out in GRAPH.items() for o in out
                    if LEVEL[_top(o)] > LEVEL[_top(m)])
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_no_import_cycle():
    """Between packages (a package's modules may lean on each other, in one
    direction each) and between modules."""
    packages: dict[str, set[str]] = {}
    for m, out in GRAPH.items():
        packages.setdefault(_top(m), set()).update(_top(o) for o in out if _top(o) != _top(m))
    for graph, what in ((packages, "packages"), (GRAPH, "modules")):
        cycle = _cycle(graph)
        assert cycle is None, f"an import cycle between {what}: " + " -> ".join(cycle)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_check_sees_an_upward_import_and_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    # a function-level import and a TYPE_CHECKING one are seen
    assert "pagedlm.tokenizer" in GRAPH["pagedlm.options"]
    assert "pagedlm.structured" in GRAPH["pagedlm.sampling"]
