"""Imports point one way: every ``kvpage`` import in ``src/kvpage`` (module level, inside
functions and under ``TYPE_CHECKING`` alike, read with ``ast``) goes from a package to
one of a lower layer or within its own package, and the module graph has no cycle.

Layers, bottom up (docs/architecture.md, "Layers"):

0. ``errors``, ``stats``, ``data``, ``report`` — no kvpage imports but errors;
1. ``specs`` — the spec types, config readers, presets;
2. ``cache``, ``attention``, ``workload`` — allocator, attention contract, traces;
3. ``models``, ``backends``, ``testing``, ``capacity``, ``routing`` (KV events, prefix
   index, router policies: imports only errors, stats, specs, cache);
4. ``engine`` — scheduler, runner, engine, LLM;
5. ``sim``, ``server`` — simulator and OpenAI server over the engine;
6. ``apps``, ``cluster`` (Ray Serve scale-out) and the top-level facade ``kvpage/__init__.py``;
7. ``cli`` — the ``kvpage`` command; 8. ``__main__`` (``python -m kvpage``).

The plugin backends in ``backends/`` (one top-level package each) import ``kvpage`` at
layer 3 and below only (``PLUGIN_MAX_RANK``: the attention contract, the checks, the
built-in backends), never another plugin: code two plugins share moves into
``kvpage``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvpage

SRC = Path(kvpage.__file__).parent
#: the plugin backends' folder (each subfolder with an ``__init__.py`` is one plugin)
PLUGINS = SRC.parents[1] / "backends"
#: the highest kvpage layer a plugin may import (``backends``: the registry, the torch
#: backend); the engine and everything above it are off limits
PLUGIN_MAX_RANK = 3
RANK = {
    "errors": 0,
    "version": 0,
    "slots": 1,
    "jsonout": 0,
    "report": 0,
    "stats": 0,
    "data": 0,
    "specs": 1,
    "cache": 2,
    "attention": 2,
    "workload": 2,
    "models": 3,
    "backends": 3,
    "testing": 3,
    "capacity": 3,
    "routing": 3,
    "engine": 4,
    "sim": 5,
    "server": 5,
    "apps": 6,
    "cluster": 6,
    "": 6,  # kvpage/__init__.py
    "cli": 7,
    "__main__": 8,
}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the kvpage modules it imports (``from X import name`` counts as
    ``X.name`` when that is a module)."""
    files = {_module_name(p, src): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "kvpage")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "kvpage":
                    continue
                subs = {f"{node.module}.{a.name}" for a in node.names}
                found = subs & files.keys()
                deps.update(found or {node.module})
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        a = _package(mod)
        for d in deps:
            b = _package(d)
            if a != b and RANK[b] >= RANK[a]:
                bad.append(f"{mod} -> {d} (layer {RANK[a]} -> {RANK[b]})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def plugin_violations(plugins: Path = PLUGINS) -> list[str]:
    """``"file: import"`` for every import (module level, in functions and under
    ``TYPE_CHECKING`` alike) of a plugin package under ``plugins`` that names another
    plugin package there, or a kvpage package above :data:`PLUGIN_MAX_RANK`."""
    names = {p.name for p in plugins.iterdir() if (p / "__init__.py").is_file()}
    bad = []
    for name in sorted(names):
        for path in sorted((plugins / name).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    rel = path.relative_to(plugins)
                    if top in names and top != name:
                        bad.append(f"{rel}: {mod} (another plugin)")
                    elif top == "kvpage" and RANK.get(_package(mod), 99) > PLUGIN_MAX_RANK:
                        bad.append(f"{rel}: {mod} (kvpage layer {RANK.get(_package(mod))})")
    return bad


def test_plugins_import_kvpage_only() -> None:
    assert PLUGINS.is_dir()
    assert plugin_violations() == []


@pytest.mark.parametrize(
    ("files", "expect"),
    [
        (
            {
                "p_a/__init__.py": "",
                "p_a/x.py": "from p_b.plan import Plan\n",
                "p_b/__init__.py": "",
            },
            1,
        ),  # fmt: skip
        ({"p_a/__init__.py": "def f():\n    import p_b\n", "p_b/__init__.py": ""}, 1),
        ({"p_a/__init__.py": "from kvpage.engine import LLM\n"}, 1),
        (
            {
                "p_a/__init__.py": "from kvpage.attention.checks import check_forward\nimport numpy\n"
            },
            0,
        ),  # fmt: skip
        ({"p_a/__init__.py": "from p_a.x import y\n", "p_a/x.py": ""}, 0),  # its own modules
    ],
)
def test_the_plugin_check_catches_violations(
    tmp_path: Path, files: dict[str, str], expect: int
) -> None:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    assert len(plugin_violations(tmp_path)) == expect


def test_every_package_has_a_layer() -> None:
    packages = {_package(m) for m in import_graph()}
    assert packages <= RANK.keys(), f"add {packages - RANK.keys()} to RANK"


def test_imports_point_down() -> None:
    assert upward_imports(import_graph()) == []


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


@pytest.mark.parametrize(
    ("files", "expect_up", "expect_cycle"),
    [
        ({"cache/a.py": "from kvpage.engine import b\n", "engine/b.py": ""}, 1, 0),
        ({"engine/a.py": "import kvpage.cache.b\n", "cache/b.py": ""}, 0, 0),
        (
            {
                "engine/a.py": "def f():\n    from kvpage.engine import b\n",
                "engine/b.py": "from kvpage.engine.a import f\n",
            },
            0,
            1,
        ),
    ],
)
def test_the_checks_catch_violations(
    tmp_path: Path, files: dict[str, str], expect_up: int, expect_cycle: int
) -> None:
    root = tmp_path / "kvpage"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    g = import_graph(root)
    assert len(upward_imports(g)) == expect_up
    assert len(cycles(g)) == expect_cycle
