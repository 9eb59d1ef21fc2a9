"""A verifier and a draft on one machine divide its CPUs (draftwire.cpus): `draftwire demo` in one process,
saying once what speculation gains there against the target alone, measured; `serve` and `edge` told
so with --share-cpus."""

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest

from draftwire import cpus
from tools.rig.serverproc import DRAFTWIRE, ChildProcess, EdgeProcess

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def _allowed(pid: int) -> dict[int, str]:
    """Each thread of `pid`: the CPUs it may run on, as Linux lists them ("0", "1", "0-1")."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        out[int(task.name)] = re.search(r"Cpus_allowed_list:\s*(\S+)", status).group(1)
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc: thread affinities unreadable")
def test_the_demo_divides_the_cpus_and_prints_its_measured_ratio(tmp_path):
    usable = cpus.usable()
    if len(usable) < 2:
        pytest.skip("one CPU: nothing to divide")
    split = cpus.split(usable)
    argv = [DRAFTWIRE, "demo", "--web", "--models", str(DEMO), "--port", "0"]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    with ChildProcess(argv, r"draftwire demo: (verifier on .*)", timeout=300, env=env) as demo:
        line = demo.found
        allowed = _allowed(demo.proc.pid)
    assert line.startswith(split.describe() + "; "), line
    m = re.search(r"speculation ([\d.]+) tokens/s, ([\d.]+)x the target alone \(([\d.]+) tokens/s", line)
    assert m, line
    speculation, ratio, alone = map(float, m.groups())
    assert speculation > 0 and alone > 0 and abs(ratio - speculation / alone) < 0.01 + 0.01 * ratio
    verifier, draft = cpus.ranges(split.verifier), cpus.ranges(split.draft)  # as Linux writes them
    assert allowed[demo.proc.pid] == verifier  # the event loop, and the verifier's threads it starts
    assert draft in allowed.values()  # the draft's thread and its llama.cpp team


def test_serve_and_edge_told_they_share_the_machine_divide_the_cpus(tmp_path):
    usable = cpus.usable()
    if len(usable) < 2:
        pytest.skip("one CPU: nothing to divide")
    split = cpus.split(usable)
    serve = [DRAFTWIRE, "serve", "--target", str(DEMO / "target"), "--port", "0", "--share-cpus"]
    with ChildProcess(serve, r"serving \S+ on (\S+)", timeout=300) as verifier:
        assert _allowed(verifier.proc.pid)[verifier.proc.pid] == cpus.ranges(split.verifier)
        draft = DEMO / "draft-q8_0.gguf"
        with EdgeProcess(verifier.found, draft, "--share-cpus", db=tmp_path / "edge.sqlite3") as edge:
            model = json.loads(urllib.request.urlopen(edge.url + "v1/models", timeout=60).read())["data"][0]
            body = json.dumps({"model": model["id"], "prompt": "def total(xs):", "max_tokens": 8}).encode()
            request = urllib.request.Request(
                edge.url + "v1/completions", body, {"Content-Type": "application/json"}
            )
            assert json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["text"]
            assert cpus.ranges(split.draft) in _allowed(edge.proc.pid).values()  # the draft's thread
        assert cpus.ranges(split.draft) not in _allowed(verifier.proc.pid).values()
