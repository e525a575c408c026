"""The architecture, checked from the source: which package may import which, and no cycles.

Read with ``ast`` from the files as they are (imports inside functions included), so a new
arrow that runs the wrong way fails here before a reviewer has to spot it:

    slack_agent  (the command line: every entry point)
        │
    bench        (measures the product; the product never imports it)
        │
    bot, terminal, web  (the surfaces: Slack, the terminal, the HTTP API and its page;
        │                 none imports another, except that ``serve`` (bot) mounts the web's
        │                 routes on its listener)
    core         (knows nothing of Slack or a terminal; SQL only in core/storage)

``standins`` (the stand-in servers for Slack, the model providers, MCP, OTLP and the network)
ships in the package for the tests, the demo and the benchmark, beside ``core`` and not in it:
the product itself (``core``, ``bot``, ``terminal``, ``web``) never imports it, and it imports
nothing of ours.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "bot", "terminal", "web", "bench", "slack_agent", "standins")
# What each package may import of ours.
ALLOWED = {
    "core": {"core"},
    "bot": {"core", "bot", "web"},
    "terminal": {"core", "terminal"},
    "web": {"core", "web"},
    "bench": {"core", "bot", "terminal", "web", "bench", "standins"},
    "slack_agent": {"core", "bot", "terminal", "web", "bench", "slack_agent", "standins"},
    "standins": {"standins"},
}
# ``python -m bot`` (the command's other name, fixed by the product's contract) is the one
# module that runs the entry point from inside a package below it: a ``__main__`` is an entry
# point itself, never imported.
ENTRY_POINTS = {"bot.__main__"}
SLACK_LIBRARIES = ("slack_sdk", "slack_bolt")
SQL_LIBRARIES = ("sqlalchemy", "alembic", "asyncpg", "aiosqlite", "sqlite3")


def _modules() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def _nodes(tree: ast.AST, *, typing: bool) -> Iterator[ast.AST]:
    """``ast.walk``, leaving out ``if TYPE_CHECKING:`` blocks unless ``typing``."""
    for node in ast.iter_child_nodes(tree):
        checking = isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        if checking and not typing:
            yield from (
                n for orelse in node.orelse for n in [orelse, *_nodes(orelse, typing=False)]
            )
            continue
        yield node
        yield from _nodes(node, typing=typing)


def _imports(name: str, path: Path, *, typing: bool = True) -> Iterator[str]:
    """Every module ``name`` imports (absolute names), anywhere in the file; ``typing=False``:
    only what runs (not the annotations' ``if TYPE_CHECKING:`` imports)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in _nodes(ast.parse(path.read_text(), str(path)), typing=typing):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module
            # ``from core import metrics`` imports the module core.metrics
            for alias in node.names:
                yield f"{module}.{alias.name}"


MODULES = dict(_modules())
GRAPH: dict[str, set[str]] = defaultdict(set)
for _name, _path in MODULES.items():
    for _imported in _imports(_name, _path):
        if _imported in MODULES and _imported != _name:
            GRAPH[_name].add(_imported)
EXTERNAL = {name: set(_imports(name, path)) for name, path in MODULES.items()}
# What runs when a module is imported (or later, from a function): the graph import cycles break.
RUNNING: dict[str, set[str]] = {
    name: {m for m in _imports(name, path, typing=False) if m in MODULES and m != name}
    for name, path in MODULES.items()
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layers__a_module_imports_only_the_packages_below_it(name: str) -> None:
    if name in ENTRY_POINTS:
        return
    top = name.split(".")[0]
    upward = sorted(m for m in GRAPH[name] if m.split(".")[0] not in ALLOWED[top])
    assert not upward, f"{name} imports {upward}, above or beside {top}"


def test_layers__core_knows_nothing_of_slack() -> None:
    found = {
        name: sorted(m for m in imported if m.split(".")[0] in SLACK_LIBRARIES)
        for name, imported in EXTERNAL.items()
        if name.split(".")[0] == "core"
    }
    assert not {name: m for name, m in found.items() if m}


PRODUCT = ("core", "bot", "terminal", "web")
STAND_INS = "standins"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] in PRODUCT))
def test_layers__the_product_never_imports_the_stand_ins(name: str) -> None:
    """A stand-in reached from product code would run in production (or hide a missing real
    part in a test): only the tests, the demo and the benchmark use ``standins``."""
    found = sorted(m for m in EXTERNAL[name] if m == STAND_INS or m.startswith(STAND_INS + "."))
    assert not found, f"{name} imports {found}"


def test_layers__sql_only_in_the_storage_layer() -> None:
    """SQLAlchemy (and the drivers) in ``core/storage`` alone: the agent, the conversation API
    and the surfaces reach the database through its stores."""
    found = {
        name: sorted(m for m in imported if m.split(".")[0] in SQL_LIBRARIES)
        for name, imported in EXTERNAL.items()
        if not name.startswith("core.storage") and name.split(".")[0] != "bench"
    }
    assert not {name: m for name, m in found.items() if m}


def test_layers__storage_is_the_bottom_of_core() -> None:
    """The storage layer may use plain values (records, messages, errors, settings, metrics,
    the sandbox's state objects, a provider's description) but never what runs on top of it."""
    above = ("core.agent", "core.conversation", "core.runtime", "core.sandbox.shell", "core.tools")
    found = {
        name: sorted(m for m in GRAPH[name] if m.startswith(above))
        for name in MODULES
        if name.startswith("core.storage")
    }
    assert not {name: m for name, m in found.items() if m}


# The folders of ``core``, bottom first: a module imports only from folders on lower levels (and
# its own), so no two folders can form a loop, however the modules inside them move. Plain values
# at the bottom; the providers know nothing of configuration; storage under everything that runs
# turns; the conversation API under what assembles a process.
CORE_LEVELS: tuple[tuple[str, ...], ...] = (
    ("core",),  # the package itself (imports nothing)
    ("core.errors", "core.messages"),
    ("core.redaction", "core.leases"),
    ("core.records", "core.sandbox", "core.logs", "core.trace_links"),
    ("core.checkpoint",),
    ("core.providers",),
    ("core.metrics", "core.usage"),
    ("core.settings",),
    ("core.tracing",),
    ("core.storage",),
    ("core.tools",),
    ("core.agent",),
    ("core.conversation",),
    ("core.sweeping", "core.operator"),
    ("core.runtime",),
)
LEVEL = {folder: level for level, folders in enumerate(CORE_LEVELS) for folder in folders}


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_layers__every_folder_of_core_has_a_level() -> None:
    folders = {_folder(name) for name in MODULES if name.split(".")[0] == "core"}
    assert folders <= set(LEVEL), f"folders without a level: {sorted(folders - set(LEVEL))}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] == "core"))
def test_layers__core_imports_only_downward(name: str) -> None:
    """0 upward imports inside core: a folder's modules use the folders below it, never a
    peer's or one above (which is how folder-level loops start)."""
    own = _folder(name)
    upward = sorted(
        m
        for m in GRAPH[name]
        if m.split(".")[0] == "core" and _folder(m) != own and LEVEL[_folder(m)] >= LEVEL[own]
    )
    assert not upward, f"{name} imports {upward}, beside or above {own}"


# All a surface imports of the core: the conversation API (its door and the values it hands
# out), the errors, and the runtime that assembles a process. Everything else (storage, the
# agent, usage) is reached through them, so a surface cannot grow a path around the door.
SURFACES = ("bot", "terminal", "web")
SURFACE_MAY_IMPORT = ("core.conversation", "core.errors", "core.runtime")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.split(".")[0] in SURFACES))
def test_layers__a_surface_reaches_the_core_through_its_door(name: str) -> None:
    reached = sorted(
        m
        for m in GRAPH[name]
        if m.split(".")[0] == "core"
        and m != "core"
        and not any(m == d or m.startswith(d + ".") for d in SURFACE_MAY_IMPORT)
    )
    assert not reached, f"{name} imports {reached}: a surface uses {SURFACE_MAY_IMPORT} only"


def test_layers__no_import_cycles() -> None:
    """No loop between modules, counting that an import from a package runs its ``__init__``
    (which re-exports its modules): a loop through one works or fails by import order."""

    def packages(module: str) -> set[str]:
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)

    def edges(name: str) -> set[str]:
        # Importing ``a.b.c`` runs ``a`` and ``a.b`` first: a package's ``__init__`` is part of
        # every import from it (except from inside that package, which it is already running).
        # A module's own packages have started running before it does: importing from them
        # (``from core.storage import queries``) adds no loop.
        direct = RUNNING[name] - packages(name)
        return direct | ({p for m in direct for p in packages(m)} - packages(name) - {name})

    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(edges(name)):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[name] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_layers__no_two_public_classes_share_a_name() -> None:
    """One name per thing: two classes of one name get renamed on import somewhere, and a
    reader meets the same word meaning two things (docs/design.md, *Words*)."""
    where: dict[str, list[str]] = defaultdict(list)
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(name)
    shared = {cls: modules for cls, modules in where.items() if len(modules) > 1}
    assert not shared, f"classes sharing a name: {shared}"
