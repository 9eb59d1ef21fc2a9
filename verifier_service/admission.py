"""Who may open a session now: caps on sessions (global, per client), a per-client rate of new ones,
and a budget of KV memory. Pure: no gRPC, no torch; the clock is passed in.

The servicer asks `admit` before any work for an open, and `release`s the session when its stream
ends, however it ends. A refusal says when trying again may succeed (`Refused.retry_after_s`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    """On by default: at most 256 sessions, and a KV budget the server sizes from the memory it has
    (None: half the memory available when it starts), of which one client may reserve at most half. A
    client is its token's or certificate's name, else its connection (grpc_kit.client_of)."""

    max_sessions: int = 256  # sessions open at once on this verifier; 0: no cap
    max_sessions_per_client: int = 0  # sessions one client holds open at once; 0: no cap
    sessions_per_minute: int = 0  # new sessions one client may open in any 60 s; 0: no cap
    # KV memory the open sessions may reserve, kept caches included; 0: no budget, None: sized at start
    kv_budget_bytes: int | None = None
    client_kv_share: float = 0.5  # of the KV budget, the most one client may reserve; 1: no cap
    retry_after_s: float = 1.0  # the hint when nothing better is known (a cap: someone must leave)
    # Stale proposals (answered without the target): a pipelined edge makes at most its depth stale per
    # rejection, a flood many more. More in a row than this ends the session; 0: no limit.
    max_stale_in_a_row: int = 64
    max_stale_per_s: int = 0  # stale proposals one session may send in any second; 0: no limit
    # Opens of one client refused (bad input, no room) in any second; past it, its next opens are refused
    # before a byte of them is parsed, until the second has passed (a flood of bad opens costs the
    # server their parsing otherwise); 0: no limit.
    max_refused_opens_per_s: int = 20


class Refused(Exception):
    """An open this verifier cannot take now (gRPC RESOURCE_EXHAUSTED, with the retry hint)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
        self._held: dict[str, _Held] = {}  # session key -> what it holds
        self._per_client: collections.Counter[str] = collections.Counter()
        self._client_kv: collections.Counter[str] = collections.Counter()
        self._rates: dict[str, Window] = {}  # client -> its recent opens; emptied windows are dropped
        self._refused: dict[str, Window] = {}  # client -> its opens refused in the last second
        self._next_sweep = 0.0
        self.kv_reserved = 0

    @property
    def active(self) -> int:
        return len(self._held)

    def admit(self, key: str, client: str, kv_bytes: int, now: float) -> None:
        """Admits session `key` of `client`, which may need `kv_bytes` of KV cache, at time `now`.

        Raises Refused, changing nothing, when a cap, the rate or the KV budget says no."""
        c = self.config
        if c.max_sessions and self.active >= c.max_sessions:
            raise Refused(f"the verifier holds its maximum of {c.max_sessions} sessions", c.retry_after_s)
        if c.max_sessions_per_client and self._per_client[client] >= c.max_sessions_per_client:
            raise Refused(
                f"client {client!r} holds its maximum of {c.max_sessions_per_client} sessions",
                c.retry_after_s,
            )
        if c.kv_budget_bytes and self.kv_reserved + kv_bytes > c.kv_budget_bytes:
            raise Refused(
                f"the session would need {_mib(kv_bytes)} of KV cache; "
                f"{(c.kv_budget_bytes - self.kv_reserved) >> 20} MiB of the verifier's "
                f"{c.kv_budget_bytes >> 20} MiB budget is free",
                c.retry_after_s,
            )
        share = int(c.kv_budget_bytes * c.client_kv_share)
        if c.kv_budget_bytes and c.client_kv_share < 1 and self._client_kv[client] + kv_bytes > share:
            raise Refused(
                f"the session would need {_mib(kv_bytes)} of KV cache; client {client!r} holds "
                f"{_mib(self._client_kv[client])} of the {share >> 20} MiB one client may reserve",
                c.retry_after_s,
            )
        if c.sessions_per_minute:
            self._sweep(now)
            rate = self._rates.setdefault(client, Window(c.sessions_per_minute, 60.0))
            if not rate.allow(now):
                raise Refused(
                    f"client {client!r} opened {c.sessions_per_minute} sessions in the last minute",
                    rate.wait_s(now),
                )
        self._held[key] = _Held(client, kv_bytes)
        self._per_client[client] += 1
        self._client_kv[client] += kv_bytes
        self.kv_reserved += kv_bytes

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
            window = self._refused.setdefault(client, Window(self.config.max_refused_opens_per_s, 1.0))
            window.allow(now)

    def check_refusals(self, client: str, now: float) -> None:
        """Raises RefusedUnread when `client` had its maximum of refused opens in the last second: its
        next open is refused before it is read, until the oldest of those is a second old."""
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
