"""Who may open a session now: caps on sessions (global, per client), a per-client rate of new ones,
and a budget of KV memory. Pure: no gRPC, no torch; the clock is passed in.

The servicer asks `admit` before any work for an open, and `release`s the session when its stream
ends, however it ends. A refusal says when trying again may succeed (`Refused.retry_after_s`).

Fair shares: by default no client holds more than a quarter of the sessions or of the KV budget, so one
client cannot take every slot. An anonymous client counts by its peer's address (`party_of`), not its
connection, so many connections from one host are one client. When the verifier is full anyway (several
clients at their share), a newcomer below its fair share (the room over the clients holding any, itself
included) is let in by ending idle sessions of the clients most over theirs (`victims`).
"""

from __future__ import annotations

import collections
import math
import urllib.parse
from dataclasses import dataclass

ANONYMOUS = "#connection "  # no listed client is named so: '#' starts a comment in a token file
ADDRESS = "#address "  # the party of the anonymous connections from one peer address


def party_of(client: str) -> str:
    """Whom the caps and shares count a session of `client` against: the client itself, but for an
    anonymous one (its connection, `#connection ipv4:10.0.0.1:51234`) its peer's address without the
    port (`#address ipv4:10.0.0.1`), so that a host opening many connections is one client."""
    if not client.startswith(ANONYMOUS):
        return client
    peer = urllib.parse.unquote(client[len(ANONYMOUS) :])  # gRPC writes ipv6:%5B::1%5D:51234
    if peer.startswith(("ipv4:", "ipv6:")) and peer.count(":") >= 2:
        peer = peer.rsplit(":", 1)[0]
    return ADDRESS + peer


@dataclass(frozen=True)
class AdmissionConfig:
    """On by default: at most 256 sessions, and a KV budget the server sizes from the memory it has
    (None: half the memory available when it starts); one client may hold at most a quarter of either.
    A client is its token's or certificate's name, else its peer's address (party_of)."""

    max_sessions: int = 256  # sessions open at once on this verifier; 0: no cap
    # Sessions one client holds open at once; None: a quarter of max_sessions (64 of 256); 0: no cap.
    max_sessions_per_client: int | None = None
    sessions_per_minute: int = 0  # new sessions one client may open in any 60 s; 0: no cap
    # KV memory the open sessions may reserve, kept caches included; 0: no budget, None: sized at start
    kv_budget_bytes: int | None = None
    client_kv_share: float = 0.25  # of the KV budget, the most one client may reserve; 1: no cap
    # A full verifier ends sessions idle this long (waiting on their edge) of the clients most over their
    # fair share, to let in a client below its own (Admission.victims); 0: never.
    preempt_idle_s: float = 2.0
    retry_after_s: float = 1.0  # the hint when nothing better is known (a cap: someone must leave)
    # Stale proposals (answered without the target): a pipelined edge makes at most its depth stale per
    # rejection, a flood many more. More in a row than this ends the session; 0: no limit.
    max_stale_in_a_row: int = 64
    max_stale_per_s: int = 0  # stale proposals one session may send in any second; 0: no limit
    # Opens of one client refused (bad input, no room) in any second; past it, its next opens are refused
    # before a byte of them is parsed, until the second has passed (a flood of bad opens costs the
    # server their parsing otherwise); 0: no limit.
    max_refused_opens_per_s: int = 20

    @property
    def sessions_per_client(self) -> int:
        """The per-client cap in force (0: none)."""
        if self.max_sessions_per_client is not None:
            return self.max_sessions_per_client
        return max(1, self.max_sessions // 4) if self.max_sessions else 0


class Refused(Exception):
    """An open this verifier cannot take now (gRPC RESOURCE_EXHAUSTED, with the retry hint)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoRoom(Refused):
    """The verifier as a whole is full (its session cap or its KV budget), not the client's share."""


class RefusedUnread(Refused):
    """An open refused before it was read: its client's opens were refused too often just before."""


class Window:
    """Counts events in a sliding window of `period_s`; `allow` says whether one more fits `limit`."""

    def __init__(self, limit: int, period_s: float):
        self.limit, self.period_s = limit, period_s
        self._times: collections.deque[float] = collections.deque()

    def _expire(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.period_s:
            self._times.popleft()

    def allow(self, now: float) -> bool:
        """Counts one event at `now` if the window has room for it; returns whether it had."""
        self._expire(now)
        if self.limit and len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True

    def empty(self, now: float) -> bool:
        """No event in the window at `now`."""
        self._expire(now)
        return not self._times

    def wait_s(self, now: float) -> float:
        """Seconds until the window has room again."""
        self._expire(now)
        return 0.0 if len(self._times) < self.limit else self._times[0] + self.period_s - now


@dataclass(frozen=True)
class _Held:
    client: str
    kv_bytes: int


def _mib(n: int) -> str:
    return f"{math.ceil(n / (1 << 20))} MiB"


class Admission:
    """The open sessions, by client, and the KV memory they reserved. The config's KV budget must be
    resolved (an int) by the server."""

    def __init__(self, config: AdmissionConfig):
        if config.kv_budget_bytes is None:
            raise ValueError("the KV budget is sized by the server: give Admission a number of bytes")
        self.config = config
        self._held: dict[str, _Held] = {}  # session key -> what it holds (its client: party_of)
        self._idle_since: dict[str, float] = {}  # session key -> since when it waits on its edge
        self._per_client: collections.Counter[str] = collections.Counter()
        self._client_kv: collections.Counter[str] = collections.Counter()
        self._rates: dict[str, Window] = {}  # client -> its recent opens; emptied windows are dropped
        self._refused: dict[str, Window] = {}  # client -> its opens refused in the last second
        self._next_sweep = 0.0
        self.kv_reserved = 0

    @property
    def active(self) -> int:
        return len(self._held)

    def holds(self, key: str) -> bool:
        """Whether session `key` is admitted and not released."""
        return key in self._held

    def admit(self, key: str, client: str, kv_bytes: int, now: float) -> None:
        """Admits session `key` of `client`, which may need `kv_bytes` of KV cache, at time `now`.

        Raises Refused, changing nothing, when a cap, the rate or the KV budget says no (NoRoom: the
        verifier is full, not the client's share)."""
        c, party = self.config, party_of(client)
        if c.max_sessions and self.active >= c.max_sessions:
            raise NoRoom(f"the verifier holds its maximum of {c.max_sessions} sessions", c.retry_after_s)
        cap = c.sessions_per_client
        if cap and self._per_client[party] >= cap:
            raise Refused(f"client {party!r} holds its maximum of {cap} sessions", c.retry_after_s)
        share = int(c.kv_budget_bytes * c.client_kv_share)
        if c.kv_budget_bytes and c.client_kv_share < 1 and self._client_kv[party] + kv_bytes > share:
            raise Refused(
                f"the session would need {_mib(kv_bytes)} of KV cache; client {party!r} holds "
                f"{_mib(self._client_kv[party])} of the {share >> 20} MiB one client may reserve",
                c.retry_after_s,
            )
        if c.kv_budget_bytes and self.kv_reserved + kv_bytes > c.kv_budget_bytes:
            raise NoRoom(
                f"the session would need {_mib(kv_bytes)} of KV cache; "
                f"{(c.kv_budget_bytes - self.kv_reserved) >> 20} MiB of the verifier's "
                f"{c.kv_budget_bytes >> 20} MiB budget is free",
                c.retry_after_s,
            )
        if c.sessions_per_minute:
            self._sweep(now)
            rate = self._rates.setdefault(party, Window(c.sessions_per_minute, 60.0))
            if not rate.allow(now):
                raise Refused(
                    f"client {party!r} opened {c.sessions_per_minute} sessions in the last minute",
                    rate.wait_s(now),
                )
        self._held[key] = _Held(party, kv_bytes)
        self._per_client[party] += 1
        self._client_kv[party] += kv_bytes
        self.kv_reserved += kv_bytes

    def idle(self, key: str, now: float) -> None:
        """Session `key` waits on its edge since `now` (until `busy`)."""
        if key in self._held:
            self._idle_since[key] = now

    def busy(self, key: str) -> None:
        """Session `key` has work (a message from its edge) and must not be preempted."""
        self._idle_since.pop(key, None)

    def victims(self, client: str, kv_bytes: int, now: float) -> list[str]:
        """The idle sessions to end so that an open of `client` needing `kv_bytes`, refused with NoRoom,
        fits: none unless the client holds less than its fair share (the session cap and the KV budget
        over the clients holding sessions, itself included), then sessions idle for preempt_idle_s of
        the clients over their fair share, the most over first, each left its fair share; [] when those
        cannot make room."""
        c, party = self.config, party_of(client)
        if not c.preempt_idle_s:
            return []
        parties = len(set(self._per_client) | {party})
        fair_sessions = c.max_sessions / parties if c.max_sessions else math.inf
        fair_kv = c.kv_budget_bytes / parties if c.kv_budget_bytes else math.inf
        if self._per_client[party] + 1 > fair_sessions or self._client_kv[party] + kv_bytes > fair_kv:
            return []

        def over(p: str) -> float:  # how far past its fair share a party is (> 0: over)
            return max(self._per_client[p] / fair_sessions, self._client_kv[p] / fair_kv) - 1

        idle = sorted(
            (k for k, since in self._idle_since.items() if now - since >= c.preempt_idle_s),
            key=lambda k: (-over(self._held[k].client), self._idle_since[k]),
        )
        chosen, sessions, kv = [], collections.Counter(), collections.Counter()
        for k in idle:
            if self._fits(chosen, kv_bytes):
                break
            p = self._held[k].client
            if (
                p == party
                or (self._per_client[p] - sessions[p]) <= fair_sessions
                and (self._client_kv[p] - kv[p] <= fair_kv)
            ):
                continue  # at or below its fair share: not preempted
            chosen.append(k)
            sessions[p] += 1
            kv[p] += self._held[k].kv_bytes
        return chosen if self._fits(chosen, kv_bytes) else []

    def _fits(self, gone: list[str], kv_bytes: int) -> bool:
        """Whether an open needing `kv_bytes` fits the verifier once the sessions `gone` are released."""
        c = self.config
        freed = sum(self._held[k].kv_bytes for k in gone)
        sessions_ok = not c.max_sessions or self.active - len(gone) < c.max_sessions
        return sessions_ok and (
            not c.kv_budget_bytes or self.kv_reserved - freed + kv_bytes <= c.kv_budget_bytes
        )

    def _sweep(self, now: float) -> None:
        """At most once a minute, forgets the clients with no open in the last minute: the table holds the
        clients of one minute, not every name ever seen."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + 60.0
        for table in (self._rates, self._refused):
            for client in [c for c, window in table.items() if window.empty(now)]:
                del table[client]

    def refused_open(self, client: str, now: float) -> None:
        """Counts an open of `client` refused at `now` (not one refused unread)."""
        if self.config.max_refused_opens_per_s:
            self._sweep(now)
            client = party_of(client)
            window = self._refused.setdefault(client, Window(self.config.max_refused_opens_per_s, 1.0))
            window.allow(now)

    def check_refusals(self, client: str, now: float) -> None:
        """Raises RefusedUnread when `client` had its maximum of refused opens in the last second: its
        next open is refused before it is read, until the oldest of those is a second old."""
        client = party_of(client)
        window = self._refused.get(client)
        if window is not None and (wait := window.wait_s(now)) > 0:
            raise RefusedUnread(
                f"client {client!r} had {window.limit} opens refused in the last second: "
                "its next opens are refused unread",
                wait,
            )

    @property
    def rate_clients(self) -> int:
        """Clients whose recent opens are counted."""
        return len(self._rates)

    def release(self, key: str) -> None:
        """Ends what session `key` held; a key never admitted is ignored."""
        held = self._held.pop(key, None)
        self._idle_since.pop(key, None)
        if held is None:
            return
        self._per_client[held.client] -= 1
        self._client_kv[held.client] -= held.kv_bytes
        if not self._per_client[held.client]:
            del self._per_client[held.client], self._client_kv[held.client]
        self.kv_reserved -= held.kv_bytes

    @property
    def kv_room(self) -> int:
        """Bytes of the KV budget no session reserved: what kept caches may hold (0 without a budget)."""
        return max(0, (self.config.kv_budget_bytes or 0) - self.kv_reserved)
