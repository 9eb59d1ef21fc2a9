"""The CPUs this process may use, and how its compute threads share them: thread counts from the process's
affinity (what taskset or a container's cpuset leave it), OpenMP threads that sleep while they wait, and a
split of those CPUs between a verifier and a draft that run on one machine (docs/sharing.md, "Sharing
a machine").
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

# OpenMP's threads (torch's, oneDNN's and MKL's runtime, and llama.cpp's ggml, which loads its own) spin
# after each parallel region, waiting for the next one. On a quiet machine that saves a wake-up; beside
# other work, the spinning burns this process's share of the CPU while the thread it waits for is
# descheduled. Passive: a waiting thread sleeps. Read once, when each runtime loads, so it is set before
# torch or llama_cpp is imported (draftwire_cli.main); a value the user set is kept.
WAIT_POLICY = {"OMP_WAIT_POLICY": "PASSIVE"}


def sleep_while_waiting(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets OpenMP's passive wait policy in `environ` where the user has not chosen one."""
    for name, value in WAIT_POLICY.items():
        environ.setdefault(name, value)


def usable() -> tuple[int, ...]:
    """The CPUs this thread may run on (Linux: its affinity), else every CPU of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


@functools.cache
def threads() -> int:
    """How many compute threads to run: one per usable CPU that other work leaves free, at least one,
    measured once a process (busy_elsewhere). llama-cpp-python's default counts every core of the
    machine, which oversubscribes a process pinned to fewer; and a team of threads that works in lockstep
    waits, at every step, for whichever of them another process has taken the CPU from."""
    return threads_for(len(usable()), busy_elsewhere(usable()))


def threads_for(cpus: int, busy: float) -> int:
    """`cpus` less the CPUs' worth that other work keeps busy (rounded), at least one."""
    return max(1, cpus - int(busy + 0.5))


def busy_elsewhere(cpus: Sequence[int], seconds: float = 0.2) -> float:
    """CPUs' worth of work that other processes keep running on `cpus`, sampled over `seconds` while this
    process sleeps (Linux's /proc/stat, less this process's own CPU time); 0 where it cannot be read."""
    try:
        before, own = _busy_total(cpus), _own_seconds()
        time.sleep(seconds)
        after, own_after = _busy_total(cpus), _own_seconds()
    except (OSError, ValueError):
        return 0.0
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    per_cpu_s = total / len(cpus) / os.sysconf("SC_CLK_TCK")  # the interval, as /proc/stat counted it
    return max(0.0, busy / os.sysconf("SC_CLK_TCK") - (own_after - own)) / per_cpu_s


def _busy_total(cpus: Sequence[int]) -> tuple[int, int]:
    """(busy, total) clock ticks of `cpus` since boot: busy is all but idle and iowait."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name in wanted:
                ticks = [int(x) for x in fields[:8]]
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
    if total == 0:
        raise ValueError("no such CPUs in /proc/stat")
    return busy, total


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass(frozen=True)
class Split:
    """The usable CPUs divided between the verifier (the target's forwards, the event loop, gRPC) and the
    draft (llama.cpp's threads): disjoint, as on two devices. `shared`: too few CPUs to divide, both
    run on all of them."""

    verifier: tuple[int, ...]
    draft: tuple[int, ...]

    @property
    def shared(self) -> bool:
        return self.verifier == self.draft

    def describe(self) -> str:
        if self.shared:
            return f"verifier and draft share CPU {ranges(self.verifier)}"
        return f"verifier on CPU {ranges(self.verifier)}, draft on CPU {ranges(self.draft)}"


def split(cpus: Sequence[int]) -> Split:
    """Divides `cpus` between the verifier and the draft: the draft, a model a tenth of the target's size
    or less, gets a third (at least one), the verifier the rest. One CPU: shared."""
    cpus = tuple(sorted(cpus))
    if len(cpus) < 2:
        return Split(cpus, cpus)
    draft = max(1, len(cpus) // 3)
    return Split(cpus[: len(cpus) - draft], cpus[len(cpus) - draft :])


def pin(cpus: Sequence[int]) -> None:
    """Pins the calling thread to `cpus`; threads it starts later (an executor's, an OpenMP team's) inherit
    them. No-op where the platform cannot."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def ranges(cpus: Sequence[int]) -> str:
    """`0-3,6` for (0, 1, 2, 3, 6)."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and c == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)
