"""What ships in the wheel (pyproject.toml): the product and its command (model fetching and checking,
the load test), never tools/ (benches, rigs, stress and test kits); the edge app's page; nothing shipped
imports a module the wheel lacks; and the wheel's own `draftwire models fetch smollm2` works."""

import ast
import os
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


def test_the_wheel_holds_the_product_and_its_command_and_no_tools(wheel):
    shipped = modules(wheel)
    assert {"draftwire_cli.main", "verifier_service.stream", "edge_client.app", "cluster.front"} <= shipped
    assert {"draftwire_cli.models.chunks", "draftwire_cli.models.check", "draftwire_cli.loadtest"} <= shipped
    assert not {m for m in shipped if m.split(".")[0] in ("tools", "tests")}
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


def test_the_wheels_own_command_fetches_smollm2_and_says_bench_needs_a_checkout(wheel, tmp_path):
    """The wheel unpacked on PYTHONPATH, run away from the checkout: its `draftwire` is the wheel's."""
    site = tmp_path / "site"
    wheel.extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}

    def draftwire(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "draftwire_cli", *args]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    where = subprocess.run(
        [sys.executable, "-c", "import draftwire_cli; print(draftwire_cli.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.strip().startswith(str(site)), where.stdout
    fetched = draftwire("models", "fetch", "smollm2", "--out", str(tmp_path / "smollm2"))
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "smollm2" / "target" / "config.json").is_file(), sorted(
        p.name for p in (tmp_path / "smollm2").rglob("*")
    )
    assert list((tmp_path / "smollm2").glob("draft-*.gguf")), fetched.stderr
    bench = draftwire("bench", "--help")
    assert bench.returncode == 2, bench
    assert "bench needs a checkout" in bench.stderr
