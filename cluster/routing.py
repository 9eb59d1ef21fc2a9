"""Where a new session goes (the least loaded live replica, then the next one not yet tried when a replica
refuses it) and how many replicas the load calls for."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from cluster.config import ScalingConfig


class State(Enum):
    STARTING = "starting"  # launched, loading the target; not routable yet
    LIVE = "live"  # routable
    DRAINING = "draining"  # keeps its sessions, gets no new one; killed when they end
    DOWN = "down"  # its process died; Ray restarts it, then it is LIVE again at a new address


@dataclass
class Slot:
    """One replica as the front sees it: its address and the sessions it proxies there now."""

    name: str
    state: State = State.STARTING
    address: str | None = None  # host:port of the replica's verifier server while LIVE or DRAINING
    sessions: int = 0
    numerics: str = ""  # the replica's numerics identity (cluster/replica.py ReplicaInfo)
    last_pick: int = 0  # breaks ties between equally loaded replicas: the longest unpicked wins
    suspect: bool = False  # missed a health check or a deadline: LIVE, but no new session goes there


@dataclass
class RoutingTable:
    slots: dict[str, Slot] = field(default_factory=dict)
    _picks: itertools.count = field(default_factory=lambda: itertools.count(1))

    def add(self, name: str) -> Slot:
        slot = self.slots[name] = Slot(name)
        return slot

    def live(self, name: str, address: str) -> None:
        slot = self.slots[name]
        slot.state, slot.address, slot.suspect = State.LIVE, address, False

    def down(self, name: str) -> None:
        """The replica's process is gone: its sessions break, none is routed to it until `live`."""
        slot = self.slots[name]
        if slot.state is not State.DRAINING:
            slot.state = State.DOWN

    def drain(self, name: str) -> None:
        self.slots[name].state = State.DRAINING

    def remove(self, name: str) -> None:
        self.slots.pop(name, None)

    def pick(self, exclude: Collection[str] = (), numerics: str = "") -> Slot | None:
        """The least loaded live replica not suspect, not named in `exclude` and, when `numerics` names
        one, of that numerics identity (the longest unpicked among equals); None when there is none."""
        live = [
            s
            for s in self.slots.values()
            if s.state is State.LIVE
            and not s.suspect
            and s.name not in exclude
            and (not numerics or s.numerics == numerics)
        ]
        if not live:
            return None
        slot = min(live, key=lambda s: (s.sessions, s.last_pick))
        slot.last_pick = next(self._picks)
        return slot

    def acquire(self, exclude: Collection[str] = (), numerics: str = "") -> Slot | None:
        """`pick`, with a new session counted on the replica until `release`."""
        slot = self.pick(exclude, numerics)
        if slot is not None:
            slot.sessions += 1
        return slot

    def release(self, slot: Slot) -> None:
        slot.sessions -= 1

    def of(self, *states: State) -> list[Slot]:
        return [s for s in self.slots.values() if s.state in states]

    @property
    def sessions(self) -> int:
        return sum(s.sessions for s in self.slots.values())


def soonest(retry_hints_ms: Sequence[int | None]) -> int:
    """Which refusal an edge gets when every live replica refused its session (their `retry-after-ms`
    hints, None where a refusal gave none): the index of the smallest hint; a refusal without one
    comes after every refusal with one."""
    return min(range(len(retry_hints_ms)), key=lambda i: (retry_hints_ms[i] is None, retry_hints_ms[i] or 0))


@dataclass
class Autoscaler:
    """Replicas for the open sessions (streaming plus waiting): up at once, down only after the load
    stayed low for downscale_delay_s."""

    scaling: ScalingConfig
    _low_since: float | None = None

    def decide(self, open_sessions: int, current: int, now: float) -> int:
        s = self.scaling
        wanted = math.ceil(open_sessions / s.target_sessions_per_replica)
        wanted = max(s.min_replicas, min(s.max_replicas, wanted))
        if wanted >= current:
            self._low_since = None
            return wanted
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since >= s.downscale_delay_s:
            self._low_since = None
            return wanted
        return current
