"""`serve --ray` on a private Ray cluster (no --address): it listens on loopback alone, as `serve` does
(Ray's own ports: GCS, raylet, workers, agents; and the replicas' verifier servers), and a replica's
death is said in the pool's own lines, not in Ray's coloured `(raylet)` ones."""

import ipaddress
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tools.rig.serverproc import ServerProcess


def descendants(pid: int) -> set[int]:
    """`pid` and every process under it (from /proc's parent ids)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grown = {pid}, True
    while grown:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    return tree


def listening(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of `pid` and its descendants (ss)."""
    pids = descendants(pid)
    found = []
    table = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    for line in table.splitlines():
        local = line.split()[3]
        for name, owner in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(owner) in pids:
                address, _, port = local.rpartition(":")
                found.append((address.strip("[]"), int(port), name))
    return found


def loopback(address: str) -> bool:
    if address == "*":
        return False
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.fixture(scope="module")
def pool(test_pair):
    pool = ServerProcess(test_pair.target_dir, "--ray", "--replicas", "1", "--replica-cpus", "1", timeout=300)
    yield pool
    pool.stop()


def test_a_private_pool_binds_loopback_alone(pool):
    sockets = listening(pool.proc.pid)
    assert any(name.startswith("gcs_server") for _, _, name in sockets)  # Ray's ports are seen
    assert len({port for _, port, _ in sockets}) >= 4
    assert [s for s in sockets if not loopback(s[0])] == []


def replica_pids(pool) -> set[int]:
    return {
        pid
        for pid in descendants(pool.proc.pid)
        if "VerifierReplica" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    }


def test_a_replicas_death_is_said_in_the_pools_lines_not_rays(pool):
    (first,) = replica_pids(pool)
    os.kill(first, signal.SIGKILL)
    lines = []
    while not any("serving at" in line for line in lines):  # restarted (ends within the test timeout)
        lines.append(pool.proc.stdout.readline())
    time.sleep(2)  # what Ray publishes about the death reaches the driver meanwhile
    pool.stop()
    lines += pool.proc.stdout.readlines()
    said = "".join(lines)
    assert "process died" in said
    assert "(raylet)" not in said and "\x1b[" not in said, said
