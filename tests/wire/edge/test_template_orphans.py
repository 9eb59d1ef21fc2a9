"""The edge's children die with it: SIGKILL of a process that renders chat templates (as `draftwire
edge` does) leaves neither its template worker nor multiprocessing's resource tracker behind (the probe
found both alive 27 minutes later)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import asyncio, multiprocessing.resource_tracker as rt, sys, time
from edge_client.template import TemplateRenderer

async def main():
    renderer = TemplateRenderer()
    await renderer.render("{{ messages[0]['content'] }}", [{"role": "user", "content": "hi"}], "", "")
    print(*renderer._pool._processes, rt._resource_tracker._pid, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_of_the_edge_takes_its_template_worker_and_resource_tracker_along():
    edge = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in edge.stdout.readline().split()]
        assert len(children) == 2 and all(alive(pid) for pid in children)
        os.kill(edge.pid, signal.SIGKILL)
        edge.wait(10)
        deadline = time.monotonic() + 30  # generous for a busy machine; they lived on for good before
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)]
    finally:
        edge.kill()
