"""The two-device rig: one machine standing for a device and a server. This process (the edge: the
draft's llama.cpp threads, the edge session) keeps to `edge_cpus`; the verifier runs in a child process
on `verifier_cpus`, one torch thread a core. With no cores named, both share the machine."""

from __future__ import annotations

import os
from pathlib import Path

from tools.rig.serverproc import ServerProcess


def verifier(
    target_dir: Path,
    *flags: str,
    edge_cpus: tuple[int, ...] = (),
    verifier_cpus: tuple[int, ...] = (),
    threads: int = 1,
) -> ServerProcess:
    """Pins this process to `edge_cpus` (before llama.cpp starts its threads, which inherit it) and
    starts `serve` with `flags` on `verifier_cpus` (`threads` torch threads when no cores are named).
    The wait is long: a 1.5B target read from disk and set up on one core took 150 s on the rig."""
    if edge_cpus:
        os.sched_setaffinity(0, edge_cpus)
    threads = len(verifier_cpus) or threads
    return ServerProcess(target_dir, "--threads", str(threads), *flags, cpus=verifier_cpus, timeout=600)
