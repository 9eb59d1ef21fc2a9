"""How long a session may live on the verifier: an idle timeout, a maximum age, the revocation of its
credentials, and the drain that ends the rest when the server shuts down. The stream reads a session's
messages through `messages` and writes its replies through `sent`. No grpc here: the ways a session
ends are the project's own exceptions, which the servicer turns into statuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LifetimeConfig:
    idle_timeout_s: float = 60.0  # no message from the edge this long: DEADLINE_EXCEEDED, cache freed
    max_age_s: float = 3600.0  # a session open this long ends with DEADLINE_EXCEEDED
    drain_timeout_s: float = 30.0  # on SIGTERM, running sessions may finish this long; then UNAVAILABLE
    # How often an open session's credentials are checked again (a revoked token's session ends after
    # two checks in a row refuse it: within 2 × recheck_s, and a token file caught mid-write ends none).
    recheck_s: float = 1.0


class Ended(Exception):
    """The verifier ends a session for its own reasons (one of the subclasses says which)."""


class TimedOut(Ended):
    """Idle too long, a reply unread too long, or older than the maximum age (DEADLINE_EXCEEDED)."""


class ShutDown(Ended):
    """The drain's time is up, or the verifier admits no new session while draining (UNAVAILABLE)."""

    def __init__(self):
        super().__init__(SHUTTING_DOWN)


class Preempted(Ended):
    """A full verifier ended this idle session of a client over its fair share, to let in a client
    below its own (admission.Admission.victims): UNAVAILABLE, so the edge resumes with its committed
    tokens (elsewhere in a pool; here only once its client is back within its share)."""


class Revoked(Ended):
    """The credentials the session was admitted with no longer admit it; `refusal` is what the
    authentication layer says of them (its status and message)."""

    def __init__(self, refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


SHUTTING_DOWN = "the verifier is shutting down: resume elsewhere with the committed tokens"
PREEMPTED = (
    "the verifier is full and this idle session's client holds more than its fair share: "
    "the session ended to let another client in; resume with the committed tokens"
)


async def revocation(admitted: Callable, every_s: float) -> Revoked:
    """Rechecks a session's credentials every `every_s` (`admitted()`: None while they admit it, else a
    refusal) and returns how the session ends once two checks in a row refuse it: within 2 × every_s
    of a revocation, and a token file caught mid-write ends nothing."""
    refused_before = False
    while True:
        await asyncio.sleep(every_s)
        refusal = admitted()
        if refusal is not None and refused_before:
            return Revoked(refusal)
        refused_before = refusal is not None


class Lifetime:
    """One session's clock: since when it is open, the server-wide `cut` that ends it, and the recheck of
    its credentials (`admitted()`: None while they still admit it, else a refusal with `code` and
    `message`), which ends it when they are revoked. `close()` when the session ends."""

    def __init__(self, config: LifetimeConfig, cut: asyncio.Event, admitted: Callable | None = None):
        self.config, self.cut = config, cut
        loop = asyncio.get_running_loop()
        self.opened_at = loop.time()
        self.revoked = asyncio.Event()  # set when the credentials no longer admit the session
        self.preempted = asyncio.Event()  # set to end the session for another client (Preempted)
        self._revocation: Revoked | None = None
        self._watch = loop.create_task(self._recheck(admitted)) if admitted is not None else None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _recheck(self, admitted: Callable) -> None:
        self._revocation = await revocation(admitted, self.config.recheck_s)
        self.revoked.set()

    def age_left(self) -> float:
        return self.config.max_age_s - (asyncio.get_running_loop().time() - self.opened_at)

    def check(self) -> None:
        """Raises Ended when the session must end now (the drain cut it, its credentials were revoked, or
        it is too old)."""
        if self.cut.is_set():
            raise ShutDown()
        if self.preempted.is_set():
            raise Preempted(PREEMPTED)
        if self._revocation is not None:
            raise self._revocation
        if self.age_left() <= 0:
            raise TimedOut(self._too_old())

    def _too_old(self) -> str:
        return f"the session reached the verifier's maximum age of {self.config.max_age_s:g} s"

    async def messages(self, requests: AsyncIterable) -> AsyncIterator:
        """The edge's messages, until it half-closes. Raises Ended when none comes within the idle
        timeout, when the session reaches its maximum age, when the drain cuts it, or when its
        credentials are revoked."""
        it = aiter(requests)
        stops = self._stops()
        end, read = object(), None
        try:
            while True:
                self.check()
                read = asyncio.ensure_future(anext(it, end))
                wait = min(self.config.idle_timeout_s, self.age_left())
                done, _ = await asyncio.wait(
                    {read, *stops}, timeout=max(wait, 0.0), return_when="FIRST_COMPLETED"
                )
                if read not in done:
                    read.cancel()
                    self.check()
                    raise TimedOut(
                        f"no message from the edge for {self.config.idle_timeout_s:g} s: "
                        "the session ended and its cache was freed",
                    )
                message = read.result()
                if message is end:
                    return
                yield message
        finally:  # the handler may be cancelled while a read is pending: leave no task behind
            for stop in stops:
                stop.cancel()
            if read is not None and not read.done():
                read.cancel()

    def _stops(self) -> list[asyncio.Future]:
        """Futures done when the session must end before its next message: the cut, the revocation."""
        stops = [asyncio.ensure_future(self.cut.wait()), asyncio.ensure_future(self.preempted.wait())]
        if self._watch is not None:
            stops.append(asyncio.ensure_future(self.revoked.wait()))
        return stops

    async def sent(self, write: Awaitable) -> None:
        """Awaits `write` (a reply to the edge). Raises Ended when it is still held after the idle
        timeout (an edge that reads no verdicts: flow control holds the write, and with it the
        session's cache), when the session reaches its maximum age, or when the drain cuts it."""
        write = asyncio.ensure_future(write)
        stops = self._stops()
        try:
            wait = min(self.config.idle_timeout_s, self.age_left())
            done, _ = await asyncio.wait(
                {write, *stops}, timeout=max(wait, 0.0), return_when="FIRST_COMPLETED"
            )
        finally:
            for stop in stops:
                stop.cancel()
            if not write.done():
                write.cancel()
        if write not in done:
            self.check()
            raise TimedOut(
                f"the edge read no reply for {self.config.idle_timeout_s:g} s: "
                "the session ended and its cache was freed",
            )
        write.result()
