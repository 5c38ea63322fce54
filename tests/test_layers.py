"""Core's packages import only from their own layer and the layers below (docs/DESIGN's layer order).

Lower layers never import higher ones: errors and descriptors, then the plugin contract and registry,
then config, then the collective helpers, then data, then the engine contract and the algorithms,
then the engine toolkit (built on the contract), then rollout and reward, then workers, then the trainer and the command line. The conformance kits
(``testing``) check engines and rollouts, so they sit above both (and reward) and may use
everything below them, but not the workers or the trainer. Every import counts, those inside
functions and ``TYPE_CHECKING`` blocks included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import verl_core

CORE = Path(verl_core.__file__).parent

#: Each top-level module or package of verl_core, by layer (lowest first).
LAYERS: list[tuple[str, ...]] = [
    ("errors", "deprecation", "descriptors", "lazy", "seeds"),
    ("hookspecs", "__init__"),  # the package re-exports the descriptors and ``hookimpl``
    ("plugins",),
    ("config",),
    ("distributed",),
    ("data",),
    ("engine", "algos"),
    ("toolkit",),
    ("rollout", "reward", "agents"),
    ("testing",),
    ("workers", "service"),
    ("trainer", "cli", "__main__", "_builtin"),
]
LAYER = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """``verl_core.toolkit.model`` -> ``toolkit``; ``verl_core`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every ``verl_core`` module ``path`` imports, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("verl_core")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_core"):
            if node.module == "verl_core":  # ``from verl_core import hookspecs`` names a submodule
                for alias in node.names:
                    submodule = CORE / f"{alias.name}.py"
                    package = CORE / alias.name / "__init__.py"
                    name = (
                        f"verl_core.{alias.name}" if submodule.exists() or package.exists() else "verl_core"
                    )
                    found.append((node.lineno, name))
            else:
                found.append((node.lineno, node.module))
    return found


SOURCES = sorted(CORE.rglob("*.py"))


def test_every_unit_of_core_has_a_layer() -> None:
    units = {unit_of("verl_core." + ".".join(p.relative_to(CORE).with_suffix("").parts)) for p in SOURCES}
    assert units - set(LAYER) == set(), "add the new module or package to LAYERS (and to docs/DESIGN.md)"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CORE)))
def test_imports_go_down_the_layers_only(path: Path) -> None:
    module = "verl_core." + ".".join(path.relative_to(CORE).with_suffix("").parts)
    own = unit_of(module.removesuffix(".__init__"))
    upward = [
        f"line {line}: {imported} (layer {LAYER[unit_of(imported)]}: {unit_of(imported)})"
        for line, imported in imported_modules(path)
        if LAYER[unit_of(imported)] > LAYER[own]
    ]
    assert not upward, f"{module} (layer {LAYER[own]}: {own}) imports from higher layers: {upward}"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from verl_core.toolkit.model import load_hf_model\n")
    assert imported_modules(source) == [(2, "verl_core.toolkit.model")]
    assert LAYER[unit_of("verl_core.toolkit.model")] > LAYER["data"]


def import_graph() -> dict[str, set[str]]:
    """Each core module -> the core modules it imports (inside functions too; ``from package import
    submodule`` counts as the submodule; a lazily exported name counts as its defining module)."""
    modules = {
        "verl_core." + ".".join(p.relative_to(CORE).with_suffix("").parts).removesuffix(".__init__"): p
        for p in SOURCES
    }
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for _, imported in imported_modules(path):
            targets.add(imported)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in modules:  # a submodule, not the package's own name
                        targets.add(f"{node.module}.{alias.name}")
                        targets.discard(node.module)
        graph[module] = {target for target in targets if target in modules and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_core_imports_itself_through_others() -> None:
    """An import cycle makes what imports first decide what works (a name defined later is missing),
    and a module whose old home re-exports it is the usual cause: old homes serve moved names lazily,
    through ``verl_core.deprecation.moved_names``."""
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
