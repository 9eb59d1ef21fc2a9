"""What ships in the wheel (pyproject.toml): the product, its command and the kits the command runs
(models, bench, rig, the load test), never the test kit or the stress kit (fuzz, soak); the edge app's
page; and nothing shipped imports a module the wheel lacks."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("draftwire", "draftwire_cli", "edge_client", "verifier_service", "cluster", "tools")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    build = ["pip", "wheel", "-q", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(out)]
    subprocess.run([sys.executable, "-m", *build], check=True, cwd=out)
    (built,) = out.glob("draftwire-*.whl")
    return zipfile.ZipFile(built)


def modules(wheel: zipfile.ZipFile) -> set[str]:
    return {
        n.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for n in wheel.namelist()
        if n.endswith(".py")
    }


def test_the_wheel_holds_the_product_and_its_command_not_the_test_or_stress_kits(wheel):
    shipped = modules(wheel)
    assert {"draftwire_cli.main", "verifier_service.stream", "edge_client.app", "cluster.front"} <= shipped
    assert {"tools.models.chunks", "tools.bench.speed", "tools.rig.serverproc", "tools.loadtest"} <= shipped
    assert not {m for m in shipped if m.startswith(("tools.testkit", "tools.stress", "tests"))}
    assert {"edge_client/web/index.html", "edge_client/web/app.js"} <= set(wheel.namelist())


def test_nothing_shipped_imports_what_the_wheel_lacks(wheel):
    shipped = modules(wheel)
    missing = []
    for name in wheel.namelist():
        if not name.endswith(".py") or "/v1/" in name:
            continue
        for node in ast.walk(ast.parse(wheel.read(name))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                wanted = [node.module]
            elif isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            else:
                continue
            for module in wanted:
                if module.split(".")[0] in OURS and module not in shipped:
                    missing.append(f"{name}: {module}")
    assert missing == []
