"""The layers of docs/architecture.md, held: no import cycle among kvstore's
modules, and no module imports from a layer above its own.

The graph is built from the source with ``ast``, not by importing it: every
module-level import of a ``kvstore`` module is an edge. Imports inside a
function (a heavy or optional dependency loaded on use) and under
``if TYPE_CHECKING:`` (annotations only) are not: neither runs when the
module is imported. An import of ``a.b.c`` is an edge to ``a.b.c`` only,
not to the packages ``a`` and ``a.b`` whose ``__init__`` Python runs first
(kvstore's package modules hold docstrings and re-exports of their own
modules; an edge to each parent would make every module import
``kvstore/__init__.py``, which imports the core, a cycle in name only).
"""
from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvstore"

# Lowest first. A module may import from its own layer or any layer below,
# never from one above. A module's layer is that of the longest prefix
# below that names it (a package, or one module of it).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # identity and keys, the record format, outcomes, errors, units, the
    # environment's settings, the stats counters, the GPU and host-memory
    # helpers, and schema.py: the base of every config section (each
    # component declares its own section over it, so it is below them all)
    ("core", ("kvstore.__init__", "kvstore.errors", "kvstore.units", "kvstore.identity", "kvstore.keys",
              "kvstore.groups", "kvstore.record", "kvstore.outcomes", "kvstore.stats", "kvstore.settings",
              "kvstore.gpu", "kvstore.hostmem", "kvstore.schema", "kvstore.private_paths", "kvstore.progress")),
    # one module or package per tier; a tier's config section lives with it
    ("tiers", ("kvstore.tiers",)),
    # eviction orders and placements: they decide, they never touch bytes
    # nor import a tier
    ("policies", ("kvstore.policies",)),
    # the task ledger and its journal: pure bookkeeping, read by the planner
    # through a Protocol (store/planner.py SessionHints)
    ("sessions", ("kvstore.sessions",)),
    # the one configuration tree: it composes the sections the tiers
    # declare and holds the policy's and the daemon's, so it sits above
    # the tiers and below everything that reads it (the store's builder,
    # the daemon, the connectors, the CLI). kvstore.daemon.limits is the
    # daemon.limits section, a declaration over schema.py and nothing
    # else; it is placed here, by name, until it moves into
    # kvstore/config.py beside the daemon's other sections (its owner's
    # file: see docs/architecture.md, "Layers")
    ("config", ("kvstore.config", "kvstore.config_load", "kvstore.daemon.limits")),
    # planner (decides), executor (moves bytes), TieredStore, the sync
    # facade, the Store protocol, leases, and build.py: a local store from
    # the config tree
    ("store", ("kvstore.store",)),
    # the daemon: the store served over a socket, and its client
    # (RemoteStore answers the same Store protocol as the local KVStore)
    # KV events: the store's residency changes, published (above the store)
    ("events", ("kvstore.events",)),
    ("daemon", ("kvstore.daemon",)),
    # the ways in: the engine connectors, and open_store
    # (kvstore/store/factory.py), which opens a local store or the daemon's
    # client by configuration alone, so it is above both (it is the one
    # module of store/ that may name the daemon)
    ("frontends", ("kvstore.connectors", "kvstore.store.factory")),
    # replay, tier throughput, workload generators, TTFT in real engines:
    # they drive the store, the daemon and the connectors, nothing drives them
    # routing is driven by the replicas bench and drives its cost model;
    # the metrics reference documents the daemon's and the connectors' metrics
    ("bench", ("kvstore.bench", "kvstore.route", "kvstore.daemon.metrics_doc", "kvstore.sizing")),
    # the commands, over everything
    ("cli", ("kvstore.cli", "kvstore.__main__")),
]


# -- the graph ----------------------------------------------------------------------------------
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()          # kvstore/tiers/__init__.py is kvstore.tiers
    return ".".join(parts)   # kvstore/__init__.py stays kvstore.__init__ (the root package)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: Iterable[ast.stmt]) -> Iterable[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: at top level, or in a
    top-level ``if`` (but not ``if TYPE_CHECKING:``), ``try`` or ``with``;
    not in a function or class body."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def imports_of(name: str, source: str, modules: Mapping[str, object], is_package: bool) -> set[str]:
    """The kvstore modules ``name`` imports at module level."""
    found: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    if name == "kvstore.__init__":
        package = "kvstore"
    for node in _module_level(ast.parse(source).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:       # relative: from the package, one level up per extra dot
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from kvstore import settings`` names a module; ``from kvstore.keys import BlockKey`` does not
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            if target == "kvstore":
                target = "kvstore.__init__"
            if target in modules and target != name:
                found.add(target)
    return found


def build_graph(root: Path = ROOT) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    return {name: imports_of(name, path.read_text(), paths, path.name == "__init__.py")
            for name, path in paths.items()}


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}        # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None
    for rank, (layer, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), rank, layer)
    return None if best is None else (best[1], best[2])


def upward_imports(graph: Mapping[str, Iterable[str]],
                   layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module, layers)
        for target in sorted(targets):
            there = layer_of(target, layers)
            if here is not None and there is not None and there[0] > here[0]:
                bad.append(f"{module} ({here[1]}) imports {target} ({there[1]})")
    return bad


# -- the checks on kvstore ----------------------------------------------------------------------
GRAPH = build_graph()


def test_every_module_has_a_layer():
    assert GRAPH, f"no modules found under {ROOT}"
    assert [m for m in GRAPH if layer_of(m) is None] == []


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_from_a_higher_layer():
    assert upward_imports(GRAPH) == []


# -- the checker, on graphs made for it -----------------------------------------------------------
def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_checker_finds_an_upward_import():
    layers = [("low", ("p.low",)), ("high", ("p.high", "p.low.lifted"))]
    graph = {"p.low.x": {"p.high.y"}, "p.high.y": {"p.low.x"}, "p.low.lifted": {"p.high.y"}}
    assert upward_imports(graph, layers) == ["p.low.x (low) imports p.high.y (high)"]


def test_the_graph_reads_what_runs_at_import(tmp_path):
    """Module-level imports count, in any block that runs at import; ones in
    functions and under TYPE_CHECKING do not; relative imports resolve."""
    pkg = tmp_path / "kvstore"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "c.py", "d.py", "sub/__init__.py", "sub/e.py"):
        (pkg / name).touch()
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import kvstore.b\n"
        "if TYPE_CHECKING:\n    from kvstore import c\n"
        "try:\n    from kvstore.sub.e import thing\nexcept ImportError:\n    pass\n"
        "def f():\n    from kvstore import d\n")
    (pkg / "sub" / "e.py").write_text("from ..b import x\n")
    (pkg / "b.py").write_text("from kvstore import c, d\n")
    graph = build_graph(pkg)
    assert graph["kvstore.a"] == {"kvstore.b", "kvstore.sub.e"}
    assert graph["kvstore.sub.e"] == {"kvstore.b"}
    assert graph["kvstore.b"] == {"kvstore.c", "kvstore.d"}


if __name__ == "__main__":      # the graph, for a reader: python tests/test_layers.py
    for mod, deps in sorted(GRAPH.items()):
        print(f"{mod} [{(layer_of(mod) or (0, '?'))[1]}]: {', '.join(sorted(deps))}")
