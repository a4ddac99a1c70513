"""The project's import graph: no cycles among its modules, and imports run one way between its layers
(docs/architecture.md#where-the-math-lives lists the modules; the layering is the README's "Layout").

Every ``import`` and ``from ... import`` of a project module counts, at module level or inside a function:
a function-local import is still a dependency, deferred. Imports in an ``if __name__ == "__main__":`` block do
not: they run only when the file is the program's entry point, as a module of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mega_suite", "kernels", "datamodules")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every importable module; a package's ``__main__.py`` is an entry point that no module imports (it runs
    as ``__main__``, like an ``if __name__ == "__main__":`` block) and is left out."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__main__.py":
                found[module_name(path)] = path
    return found


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports: ``from a.b import c`` names a.b.c where that is a module."""
    is_package = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):  # the entry-point block runs as a separate module "__main__", never on import
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"':
            node.body, node.orelse = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles among the project's modules:\n" + "\n".join(
        " <-> ".join(c) for c in found
    )


# Lower layers first: a module may import its own layer and the layers before it, never a later one.
LAYERS = (
    "kernels",
    "datamodules",
    "mega_suite.errors",
    "mega_suite.models",
    "mega_suite.storage",
    "mega_suite.config",
    "mega_suite.tools",
    "mega_suite.distributed",
    "mega_suite.evaluation",
    "mega_suite.training",
    "mega_suite.cli",
)


def layer_of(module: str) -> int | None:
    return next((i for i, p in enumerate(LAYERS) if module == p or module.startswith(p + ".")), None)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        for target in sorted(targets):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{module} imports {target} (layer {LAYERS[theirs]} is above {LAYERS[mine]})")
    return bad


def test_imports_run_one_way_between_layers():
    bad = upward_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_an_upward_import_is_found():
    assert upward_imports({"mega_suite.models.lm": {"mega_suite.training.runner"}}) != []
    assert upward_imports({"mega_suite.training.runner": {"mega_suite.models.lm"}}) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_an_entry_point_block_is_not_a_dependency(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('import os\nif __name__ == "__main__":\n    from kernels import dispatch\n')
    assert imports_of(source, "m", {"kernels.dispatch": source}) == set()


def test_the_graph_sees_function_local_and_from_imports():
    graph = import_graph()
    assert "mega_suite.models.megalodon.lm" in graph["mega_suite.models.megalodon"]  # from pkg.mod import X
    assert "kernels.timestep_norm.triton" in graph["kernels.timestep_norm"]  # inside a function
