"""`draftwire demo` on one machine: the verifier and the draft divide the process's CPUs (draftwire.cpus),
and the demo says once what speculation gains there against the target alone, measured."""

import os
import re
from pathlib import Path

import pytest

from draftwire import cpus
from tools.rig.serverproc import DRAFTWIRE, ChildProcess

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
