"""The package's layering, read from its source: no import cycles between modules nor between folders,
grpc only at the edges, no torch in the client library or kvtierctl unless a pool is mapped, and
none of the connectors in `kvtierd serve`."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO

# The folders that talk gRPC: the server, the client library and the CLI built on it, the generated stubs.
GRPC_PACKAGES = ("kvtierd.server", "kvtierd.client", "kvtierd.cli", "kvtierd.v1")
# The floors, bottom up, as docs/architecture.md ("Where things are") lists them: a folder imports only
# folders on the floors below its own. `kvtierd` is the modules at the top of kvtierd/ (keys, units, errors).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("kvtierd", "kvtierd.v1"),
    ("kvtierd.movers", "kvtierd.retention", "kvtierd.sealing", "kvtierd.t0"),
    ("kvtierd.index", "kvtierd.wire"),
    ("kvtierd.t2", "kvtierd.t3", "kvtierd.client"),
    ("kvtierd.t1", "kvtierd.launch", "kvtierd.connectors.reference"),
    ("kvtierd.tiering", "kvtierd.connectors.demo"),
    ("kvtierd.planning",),
    ("kvtierd.node", "kvtierd.connectors.vllm", "kvtierd.connectors.sglang"),
    ("kvtierd.events", "kvtierd.metrics"),
    ("kvtierd.server",),
    ("kvtierd.cli",),
)


def module_name(path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "connectors":
        parts.insert(0, "kvtierd")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, set[str]]:
    """Each module of kvtierd/ and connectors/ and every name it imports, function-level imports included."""
    paths = [*(REPO / "kvtierd").rglob("*.py"), *(REPO / "connectors").rglob("*.py")]
    modules = {}
    for path in paths:
        if path.relative_to(REPO).parts[:2] == ("kvtierd", "connectors"):
            continue  # the symlink to connectors/, walked once under its own name
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        modules[module_name(path)] = imported
    return modules


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_through_others():
    """No cycle among kvtierd's modules, counting imports inside functions (a factory in a base module)."""
    modules = source_modules()
    assert len(modules) > 100, sorted(modules)  # the walk found the tree
    graph = {name: {other for other in imported if other in modules and other != name}
             for name, imported in modules.items()}
    assert import_cycles(graph) == []


def folders_of(modules: dict[str, set[str]]) -> set[str]:
    """kvtierd's folders (`kvtierd.index`), and those of connectors/ (`kvtierd.connectors.demo`): reached
    through the `kvtierd/connectors` link, connectors/ is a folder of folders, each a layer of its own."""
    folders = set()
    for name in modules:
        parts = name.split(".")
        depth = 3 if parts[:2] == ["kvtierd", "connectors"] else 2
        folders |= {".".join(parts[:size]) for size in range(2, min(depth, len(parts) - 1) + 1)}
    return folders


def folder_of(module: str, folders: set[str]) -> str:
    """The folder a module is in (`kvtierd.index`, `kvtierd.connectors.vllm`); a module at the top of
    connectors/ (`kvtierd.connectors.prefill_cost`) stands alone, and one at the top of kvtierd/ (block
    keys, units, errors) is in `kvtierd`."""
    parts = module.split(".")
    folder = next((f for f in (".".join(parts[:3]), ".".join(parts[:2])) if f in folders), "kvtierd")
    return module if folder == "kvtierd.connectors" else folder


def folder_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which folders each folder imports, itself left out."""
    folders = folders_of(modules)
    graph: dict[str, set[str]] = {}
    for name, imported in modules.items():
        folder = folder_of(name, folders)
        graph.setdefault(folder, set()).update(
            folder_of(other, folders) for other in imported if other in modules)
        graph[folder].discard(folder)
    return graph


def test_the_folders_form_a_stack():
    """No cycle among kvtierd's folders either, connectors/' folders among them: each imports only
    folders below it (events/ between node/ and server/; the CLI loads the demo, and the demo does
    not import the CLI; the demo runs the reference runner, and the reference runner knows no demo)."""
    graph = folder_graph(source_modules())
    assert {"kvtierd.index", "kvtierd.events", "kvtierd.server", "kvtierd.connectors.reference",
            "kvtierd.connectors.demo", "kvtierd.connectors.vllm"} <= set(graph)
    assert import_cycles(graph) == []


def test_each_folder_imports_only_the_floors_below_it():
    """FLOORS holds every folder, and no folder imports one on its own floor or above (the docs' order is true)."""
    graph = folder_graph(source_modules())
    floor_of = {folder: floor for floor, folders in enumerate(FLOORS) for folder in folders}
    loose = {name for name in graph if name not in floor_of and name.startswith("kvtierd.connectors")}
    assert set(graph) - loose <= set(floor_of)  # a module at connectors/' top stands alone, on no floor
    assert set(floor_of) - set(graph) <= {"kvtierd.v1"}  # no floor names a folder that is gone (v1: built at install)
    upward = sorted((folder, other) for folder, imported in graph.items() if folder in floor_of
                    for other in imported if other in floor_of and floor_of[other] >= floor_of[folder])
    assert upward == []


def test_a_cycle_between_the_connectors_folders_is_found():
    """The demo/reference cycle as it stood (the reference runner's model files importing the demo's
    tokenizer, the demo importing the reference runner) is a folder cycle."""
    modules = {"kvtierd.connectors.demo.demo": {"kvtierd.connectors.reference.model_files"},
               "kvtierd.connectors.reference.model_files": {"kvtierd.connectors.demo.chat_tokenizer"},
               "kvtierd.connectors.demo.chat_tokenizer": set()}
    assert import_cycles(folder_graph(modules)) == [["kvtierd.connectors.demo", "kvtierd.connectors.reference"]]


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_only_the_edges_import_grpc():
    """Nothing below the server imports grpc: the core is driven by the servicer, not the reverse."""
    offenders = sorted(name for name, imported in source_modules().items()
                       if any(n == "grpc" or n.startswith("grpc.") for n in imported)
                       and not name.startswith(GRPC_PACKAGES))
    assert offenders == []


def test_client_and_kvtierctl_run_without_torch(tmp_path):
    """Importing the client and running kvtierctl against an absent daemon loads no torch module."""
    code = (
        "import sys\n"
        "import kvtierd.client\n"
        "from kvtierd.cli.kvtierctl import main\n"
        f"sys.argv = ['kvtierctl', '--address', 'unix://{tmp_path}/absent.sock', '--timeout', '1', 'stats']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as stop:\n"
        "    print('exit', stop.code)\n"
        "print('torch modules:', sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "torch modules: []" in done.stdout, done.stdout + done.stderr
    assert "exit 0" not in done.stdout  # the daemon is absent: kvtierctl said so with a failing code


def test_serve_imports_nothing_of_the_connectors():
    code = ("import sys\nfrom kvtierd.cli.kvtierd_main import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvtierd.connectors')))")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
