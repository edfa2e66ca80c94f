"""The import graph of kvcache_exporter: no circle, and no import up the layers (data flows one way:
sources -> adapters -> derive -> exposition; the process machinery apart; consumers and commands on top).

Every import statement counts, read from the source (ast), wherever it is: at the top, in a
function, under `if TYPE_CHECKING`. Each check is a function of a plain module graph, so the same
functions are shown to fail on made-up graphs.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOT = "kvcache_exporter"

# The layers, lowest first: a module imports from its own layer and the layers below, never above.
# Module names are relative to kvcache_exporter; a name covers its submodules ("" is the package's
# own __init__ only).
LAYERS = (
    # The words every step shares: family names, thresholds, units, an engine's values, KV arithmetic.
    ("vocabulary", ("", "contract", "thresholds", "units", "snapshot", "kvmath")),
    # The wire: fetching a page, reading exposition text, decoding KV events; knows no engine.
    ("sources", ("sources",)),
    # One engine's page as a snapshot, each engine in the one registry.
    ("adapters", ("adapters",)),
    # What snapshots and events mean: rates, pressure state, what more KV would buy.
    ("derive", ("derive", "blocks", "tiers", "fleet")),
    # The kvcache_* text.
    ("exposition", ("exposition",)),
    # Settings validated against the registry's engines and the arithmetic: what the process runs.
    ("config", ("config",)),
    # The process: polls on a cadence, the endpoint, probes, event streams, reloads.
    ("runtime", ("runtime",)),
    # Read the contract from outside the core; of the runtime, only what RUNTIME_FOR_CONSUMERS names.
    ("consumers", ("dashboards", "alerts", "top")),
    # The command line: wires all of the above.
    ("commands", ("commands", "__main__")),
)
CONSUMERS = ("dashboards", "alerts", "top")
# The one runtime module a consumer may use (top polls engines itself); the rest is the process's own.
RUNTIME_FOR_CONSUMERS = ("runtime.direct",)
# The simulator imitates engines: it stands apart from the exporter, and only the demo starts it.
SIMULATOR = "simulator"
SIMULATOR_USERS = ("commands.demo",)


def _covers(name: str, prefix: str) -> bool:
    return name == prefix or (prefix != "" and name.startswith(prefix + "."))


def _relative(module: str) -> str:
    return "" if module == ROOT else module.removeprefix(ROOT + ".")


def layer_of(module: str) -> int | None:
    """The index in LAYERS of a module (a full name), by its longest matching prefix."""
    name = _relative(module)
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS)
               for prefix in prefixes if _covers(name, prefix)]
    return max(matches)[1] if matches else None


def _area(module: str) -> str:
    """The consumer or the simulator a module belongs to, else ""."""
    name = _relative(module)
    return next((area for area in (*CONSUMERS, SIMULATOR) if _covers(name, area)), "")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layer order or the consumers' or the simulator's rule, one line each."""
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            name, target_name = _relative(module), _relative(target)
            area, target_area = _area(module), _area(target)
            if target_area == SIMULATOR or area == SIMULATOR:
                if area != target_area and not any(_covers(name, user) for user in SIMULATOR_USERS):
                    found.append(f"{module} -> {target}: the simulator stands apart; only the demo imports it")
                continue
            if area in CONSUMERS and _covers(target_name, "runtime") and not any(
                    _covers(target_name, allowed) for allowed in RUNTIME_FOR_CONSUMERS):
                found.append(f"{module} -> {target}: consumers use only {', '.join(RUNTIME_FOR_CONSUMERS)} "
                             "of the runtime")
            elif None in (layer_of(module), layer_of(target)):
                found.append(f"{module} -> {target}: one of them is in no layer (place every module in LAYERS)")
            elif layer_of(target) > layer_of(module):
                found.append(f"{module} -> {target}: {LAYERS[layer_of(module)][0]} imports from "
                             f"{LAYERS[layer_of(target)][0]}, a higher layer")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each strongly connected set of modules (Tarjan), and any module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1 or module in graph.get(module, ()):
                found.append(sorted(members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


# ---------------------------------------------------------------- the package as it is

def package_modules() -> dict[str, Path]:
    """Module name -> file, for every package pyproject.toml lists, laid out by its package-dir."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    modules = {}
    for package in setuptools["packages"]:
        mapped = max((name for name in folders if _covers(package, name)), key=len)
        folder = REPO / folders[mapped] / package.removeprefix(mapped).lstrip(".").replace(".", "/")
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `module` imports, relative imports resolved; `from P import name`
    counts P.name where that is a module, else P."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                found.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin)
    return found & known


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {module: imports_of(module, path, set(modules)) for module, path in modules.items()}


def test_every_folder_with_an_init_is_a_listed_package_and_every_module_has_a_layer(graph):
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {REPO / folder for folder in setuptools["package-dir"].values()}
    on_disk = {init.parent for top in listed for init in top.rglob("__init__.py")}
    assert on_disk == {package_modules()[package].parent for package in setuptools["packages"]}
    assert [m for m in graph if layer_of(m) is None and _area(m) != SIMULATOR] == []


def test_the_walk_sees_relative_absolute_and_function_level_imports(graph):
    assert "kvcache_exporter.runtime.direct" in graph["kvcache_exporter.top.source"]  # from ..runtime.direct
    assert "kvcache_exporter.config" in graph["kvcache_exporter.commands.serve"]  # from .. import config
    assert "kvcache_exporter.thresholds" in graph["kvcache_exporter.alerts.generate"]  # absolute
    assert {"kvcache_exporter.commands.serve", "kvcache_exporter.commands.top"} <= graph["kvcache_exporter.commands"]
    assert "kvcache_exporter.commands.demo" in graph["kvcache_exporter.commands.serve"]  # in a function
    assert "kvcache_exporter.kvmath.layout" in graph["kvcache_exporter.kvmath"]  # a package's __init__


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_no_import_goes_up_the_layers(graph):
    assert upward_imports(graph) == []


def test_only_the_demo_imports_the_simulator(graph):
    users = {module for module, imported in graph.items() if _area(module) != SIMULATOR
             and any(_area(target) == SIMULATOR for target in imported)}
    assert users == {"kvcache_exporter.commands.demo"}


# ---------------------------------------------------------------- the checks, shown to fail

def test_the_checks_find_a_circle_and_each_kind_of_forbidden_import():
    k = ROOT + "."
    made_up = {
        k + "config": {k + "commands.serve"},  # the circle the `top` command used to close, through cli.py
        k + "commands.serve": {k + "config"},
        k + "derive": {k + "derive"},
        k + "top.source": {k + "runtime.app", k + "runtime.direct", k + "dashboards.promql"},
        k + "sources.fetch": {k + "contract"},
        k + "runtime.app": {k + "simulator.server"},
        k + "simulator.server": {k + "contract"},
    }
    assert circles(made_up) == [[k + "commands.serve", k + "config"], [k + "derive"]]
    assert upward_imports(made_up) == [
        f"{k}config -> {k}commands.serve: config imports from commands, a higher layer",
        f"{k}runtime.app -> {k}simulator.server: the simulator stands apart; only the demo imports it",
        f"{k}simulator.server -> {k}contract: the simulator stands apart; only the demo imports it",
        f"{k}top.source -> {k}runtime.app: consumers use only runtime.direct of the runtime",
    ]
