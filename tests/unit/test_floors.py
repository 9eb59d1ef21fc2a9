"""The house's floors, read from the source: imports run one way only, and the core stays pure.

tools/                      benches, rigs, fuzz, soak, test kits: run from a checkout, never shipped
draftwire_cli/              the `draftwire` command (its commands, demo, doctor, top, the load test,
                            model fetching, checking and building)
cluster/                    the Ray pool, above the verifier
edge_client/  verifier_service/   side by side, never importing each other
draftwire/                  the shared core (contract, rules, vocab) and the wire

Inside a package the same holds: the verifier reads gRPC kit (grpc_kit) → translating servicer →
stream → session, batcher, admission, lifecycle, and below the servicer nothing speaks grpc; the edge
reads transport (session) → policy (planner, adaptive), the policy grpc-free. No product function is
longer than a screen (MAX_FUNCTION_LINES), and no product module longer than MAX_MODULE_LINES.
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("draftwire", "edge_client", "verifier_service", "cluster", "tools", "draftwire_cli")
# What each floor may import of ours (besides itself).
ALLOWED = {
    "draftwire": set(),
    "edge_client": {"draftwire"},
    "verifier_service": {"draftwire"},
    "cluster": {"draftwire", "verifier_service"},
    "tools": {"draftwire", "edge_client", "verifier_service", "cluster", "draftwire_cli"},
    # The product never imports tools/: `draftwire bench` runs the checkout's bench as a child process.
    "draftwire_cli": {"draftwire", "edge_client", "verifier_service", "cluster"},
}
# Third-party packages a module must not import, even lazily.
FORBIDDEN = {
    "draftwire/contract.py": {"grpc", "torch", "ray", "transformers", "llama_cpp"},
    "draftwire/rules.py": {"grpc", "torch", "ray", "transformers", "llama_cpp"},
    "draftwire/speculation.py": {"grpc", "torch", "ray", "transformers", "llama_cpp"},
    "verifier_service/gamma_cap.py": {"grpc", "torch", "ray", "transformers", "llama_cpp"},
    # vocabulary_from_llama imports the binding its argument came from; only the edge calls it.
    "draftwire/vocab.py": {"grpc", "torch", "ray", "transformers"},
    "edge_client": {"torch", "transformers", "ray", "verifier_service", "cluster"},
    "draftwire": {"torch", "transformers", "ray"},
    # Below the servicer, the verifier knows nothing of the wire: its endings are its own exceptions.
    **{
        f"verifier_service/{m}.py": {"grpc", "google", "grpc_health", "grpc_reflection", "ray"}
        for m in ("stream", "session", "lifecycle", "admission", "batcher", "engine", "kv", "gamma_cap")
    },
    **{
        f"edge_client/{m}.py": {"grpc", "google", "llama_cpp"}
        for m in ("planner", "adaptive", "policy", "speed_model")
    },
}
# Modules of our own a module must not import: the upper layers inside a package.
NOT_BELOW = {
    "verifier_service/stream.py": {
        "verifier_service.servicer",
        "verifier_service.grpc_kit",
        "verifier_service.auth",
    },
    "verifier_service/grpc_kit.py": {"verifier_service.servicer"},
    # The pool's front relays bytes: it needs the kit, never the servicer or the sessions.
    "cluster/front.py": {"verifier_service.servicer", "verifier_service.stream", "verifier_service.session"},
    "edge_client/planner.py": {"edge_client.session", "edge_client.app"},
}
# Inside tools/: what each kit may import of the others. The rig is the ground floor, the benches and
# the test kit stand on it, the stress kit on all three.
TOOLS_ALLOWED = {
    "rig": set(),
    "bench": {"rig"},
    "testkit": {"rig"},
    "stress": {"rig", "bench", "testkit"},
}
PRODUCT = ("draftwire", "edge_client", "verifier_service", "cluster", "draftwire_cli")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


@functools.cache
def modules() -> dict[str, set[str]]:
    """Each source file (relative path) -> the top-level names of every module it imports."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.parts:
                continue
            names = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    # `from tools.bench import speed` imports tools.bench and tools.bench.speed.
                    names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            found[str(path.relative_to(ROOT))] = names
    return found


def private_imports() -> list[str]:
    """`from our.module import _name`: a module reaching into another's private parts."""
    found = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                    found += [
                        f"{path.relative_to(ROOT)}: {node.module}.{a.name}"
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    ]
    return found


def dotted(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


@pytest.mark.parametrize("path, imports", sorted(modules().items()))
def test_imports_run_down_the_floors(path, imports):
    floor = path.split("/")[0]
    ours = {name.split(".")[0] for name in imports} & set(PACKAGES)
    assert ours <= ALLOWED[floor] | {floor}, (
        f"{path} imports up or sideways: {ours - ALLOWED[floor] - {floor}}"
    )
    for scope, banned in FORBIDDEN.items():
        if path == scope or path.startswith(scope + "/"):
            bad = {name for name in imports if name.split(".")[0] in banned}
            assert not bad, f"{path} must not import {bad}"


def test_no_circle_of_imports():
    graph = {dotted(p): {n for n in names if n.split(".")[0] in PACKAGES} for p, names in modules().items()}
    graph = {m: {n for n in deps if n in graph} for m, deps in graph.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        path.append(m)
        for n in graph[m]:
            visit(n)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)


def test_no_module_imports_anothers_private_names():
    assert private_imports() == []


@pytest.mark.parametrize("path, banned", sorted(NOT_BELOW.items()))
def test_layers_inside_a_package_run_one_way(path, banned):
    imports = modules()[path]
    assert not imports & banned, f"{path} imports a layer above it: {sorted(imports & banned)}"


def test_no_product_function_is_longer_than_a_screen():
    long = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_no_product_module_is_longer_than_max_module_lines():
    """A module past a few screens holds more than one idea: split it where the ideas part."""
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if "v1" not in path.parts and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []


def test_no_product_code_waits_with_asyncio_wait_for():
    """Python 3.11's wait_for loses a cancellation that arrives with the result (draftwire/aio.py): the
    product waits with a limit through `draftwire.aio.within`."""
    calls = []
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "wait_for":
                    if isinstance(node.value, ast.Name) and node.value.id == "asyncio":
                        calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []


@pytest.mark.parametrize(
    "path", sorted(p for p in modules() if p.startswith("tools/") and p != "tools/__init__.py")
)
def test_the_kits_inside_tools_stand_on_the_ones_below(path):
    kit = path.split("/")[1].removesuffix(".py")
    used = {n.split(".")[1] for n in modules()[path] if n.startswith("tools.") and n.count(".") >= 1}
    assert used - {kit} <= TOOLS_ALLOWED[kit], (
        f"{path} imports the kits {sorted(used - {kit} - TOOLS_ALLOWED[kit])}"
    )
