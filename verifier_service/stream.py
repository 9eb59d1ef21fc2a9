"""One verifier's sessions, without the wire: what happens on a Session stream between the edge's
messages and the verifier's replies.

`Verifier.run` is a whole stream: the first-message rule, the drain's refusal, admission, the open,
then the edge's proposals (or, for a thin session, the rounds the verifier plays itself), the stale
flood limit and the session's lifetime. Its messages come in as they arrive, each one read when the stream
calls it (an `Arrival`: the contract's `Open`, `Read` or `Proposal` once read), and its replies go out as
the contract's dataclasses (`Opened`, `Verdict`); how a stream ends is the project's own
exceptions (SessionError, Refused, Ended), which the servicer maps to gRPC statuses. No grpc here, so the
whole of it runs in a unit test over a fake engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass

from draftwire.contract import Proposal, SessionSpec, Verdict, generation_budget
from verifier_service.admission import Admission, AdmissionConfig, NoRoom, Refused, RefusedUnread, Window
from verifier_service.batcher import BatchConfig, Batcher, ServedEngine
from verifier_service.engine import PrefixCacheConfig
from verifier_service.gamma_cap import CapConfig, GammaCap
from verifier_service.lifecycle import Ended, Lifetime, LifetimeConfig, Preempted, ShutDown
from verifier_service.session import (
    InvalidRequest,
    SessionError,
    VerifierLimits,
    VerifierSession,
    VerifierStats,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Open:
    """The edge's first message. Its lengths are read at once; `parse()` converts the rest (every id)
    only once they pass, so a refused 1 MiB open costs no walk over its ids."""

    prompt_length: int
    max_new_tokens: int
    parse: Callable[[], SessionSpec]


@dataclass(frozen=True)
class Read:
    """A thin session's edge has read the verdicts up to `committed_length`."""

    committed_length: int


@dataclass(frozen=True)
class Unknown:
    """A message of no kind this server knows (a newer edge's, or none set)."""


Incoming = Open | Read | Proposal | Unknown
# A message received and not read yet: calling it parses it (raising InvalidRequest for bytes that are no
# message). The stream may refuse a message that has arrived without paying for its parse.
Arrival = Callable[[], Incoming]


@dataclass(frozen=True)
class Opened:
    """The reply to an open: the session's key and where it starts."""

    session_id: str
    committed_length: int
    reused_positions: int
    numerics: str
    read_ahead: int  # a thin session's: tokens played past the edge's last Read (0 for an edge session)
    forward_seconds: dict[int, float]  # a round's forward time by its positions (BatchStats.round_costs)


class Flooded(Ended):
    """A session's stale proposals came too many in a row, or too fast (RESOURCE_EXHAUSTED)."""


ENDED = "the session is ended"


class StaleLimit:
    """One session's stale proposals: more than `max_stale_in_a_row` in a row, or more than
    `max_stale_per_s` in a second, look like a flood (0: no limit)."""

    def __init__(self, config: AdmissionConfig):
        self.most_in_a_row, self.in_a_row = config.max_stale_in_a_row, 0
        self.per_second = Window(config.max_stale_per_s, 1.0)

    def record(self, stale: bool, now: float) -> None:
        """Counts a verdict; raises Flooded when the stale ones look like a flood."""
        self.in_a_row = self.in_a_row + 1 if stale else 0
        if not stale:
            return
        if self.most_in_a_row and self.in_a_row > self.most_in_a_row:
            raise Flooded(f"more than {self.most_in_a_row} stale proposals in a row: {ENDED}")
        if self.per_second.limit and not self.per_second.allow(now):
            raise Flooded(f"more than {self.per_second.limit} stale proposals in a second: {ENDED}")


@dataclass(frozen=True)
class StreamConfig:
    """What the sessions of one verifier run under (a part of the server's config)."""

    limits: VerifierLimits = VerifierLimits()
    batch: BatchConfig = BatchConfig()
    # Finished sessions' caches kept for the next turn of a conversation: 1 GiB for 10 minutes.
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig(budget_bytes=1 << 30, ttl_s=600.0)
    admission: AdmissionConfig = AdmissionConfig()
    lifetime: LifetimeConfig = LifetimeConfig()
    gamma_cap: CapConfig = CapConfig()


class Verifier:
    """One engine's sessions: the batcher that runs their forwards, admission, the counters, the drain."""

    def __init__(self, engine: ServedEngine, config: StreamConfig):
        self.engine, self.config = engine, config
        self.stats = VerifierStats()
        self.batcher = Batcher(engine, config.batch, GammaCap(config.limits.max_gamma, config.gamma_cap))
        if config.batch.calibrate:  # with no finished cache kept (an engine may have served before)
            engine.keep_finished(PrefixCacheConfig())
            self.batcher.calibrate(config.limits.max_gamma + 1)
        self.admission = Admission(sized(config.admission, str(engine.device)))
        # Kept caches live inside the KV budget too: they give way to the sessions' reservations.
        room = (lambda: self.admission.kv_room) if self.admission.config.kv_budget_bytes else None
        engine.keep_finished(config.prefix_cache, room)
        self.draining = False  # opens are refused with ShutDown (the edge resumes elsewhere)
        self.cut = asyncio.Event()  # set when the drain's time is up: every session ends
        self.revoked_sessions = 0  # open sessions ended because their credentials no longer admit them
        self.preempted_sessions = 0  # idle sessions ended to let a client below its fair share in
        self._lifetimes: dict[str, Lifetime] = {}  # key -> the clock of each open stream (to preempt it)

    async def run(
        self,
        client: str,
        admitted: Callable | None,
        arrivals: AsyncIterable[Arrival],
        write: Callable[[Opened | Verdict], Awaitable],
    ) -> None:
        """Runs one Session stream to its end: an `Open`, then one verdict per proposal (a thin session:
        one per round the verifier plays itself, to the finish, at most read_ahead tokens past the edge's
        last Read). `client` owns the session (its caps, its share, its kept caches); `admitted()`, when
        given, rechecks its credentials (lifecycle.Lifetime).

        After a finish the stream stays open until the edge half-closes; a proposal sent meanwhile is
        answered stale if the finish made it obsolete, else refused (WrongState).

        Raises SessionError, Refused or Ended for an ending the edge is told of, and what the engine
        raises; the session's cache and reservation are freed either way."""
        # Not guessable; the session, its cache and what it leaves for a next turn belong to the caller.
        key = f"session-{secrets.token_urlsafe(12)}"
        lifetime = Lifetime(self.config.lifetime, self.cut, admitted)
        stale = StaleLimit(self.config.admission)
        sent = lambda reply: lifetime.sent(write(reply))  # noqa: E731
        session = None
        self._lifetimes[key] = lifetime
        loop = asyncio.get_running_loop()
        try:
            async for arrived in lifetime.messages(arrivals):
                self.admission.busy(key)
                if session is None:
                    # A client whose opens were refused too often just now: its open is refused once it
                    # has arrived (a status sent while the edge still writes can reach it as a bare
                    # INTERNAL from its gRPC library), but before it is read.
                    self.admission.check_refusals(client, asyncio.get_running_loop().time())
                    session = await self._open(key, client, arrived())
                    arrived = None  # a refused open keeps nothing of the request alive
                    await sent(self._opened(key, session))
                else:
                    await self._answer(session, arrived(), stale, sent)
                while session.plays_on:  # a thin session's rounds, up to read_ahead past its Read
                    lifetime.check()
                    await sent(await session.play(session.own_proposal()))
                self.admission.idle(key, loop.time())  # waits on its edge: may be preempted
        except Preempted as e:
            raise self._preempted(key, client, session, e) from None
        except (SessionError, Refused, Ended) as e:
            log.info("session %s ended: %s: %s", key, type(e).__name__, e)
            self.revoked_sessions += lifetime.revoked.is_set()
            if session is None and isinstance(e, SessionError | Refused) and not isinstance(e, RefusedUnread):
                self.admission.refused_open(client, asyncio.get_running_loop().time())
            raise
        except Exception:  # a bug or a device failure: this session only
            log.exception("session %s failed", key)
            raise
        finally:
            lifetime.close()
            self._lifetimes.pop(key, None)
            # Queued behind any forward of this key, so nothing outlives the release.
            self.batcher.release(key)
            self.admission.release(key)

    async def _open(self, key: str, client: str, message: Incoming) -> VerifierSession:
        """The session the first message opens: refused before any parsing when it is not an open or its
        lengths are out of bounds, then while draining, then by admission."""
        if not isinstance(message, Open):
            raise InvalidRequest("the first message of a session must be `open`")
        VerifierSession.check_lengths(self.engine.info, message.prompt_length, message.max_new_tokens)
        spec = message.parse()
        if self.draining:
            raise ShutDown()
        loop, per_position = asyncio.get_running_loop(), self.engine.bytes_per_position
        admit = lambda s: self.admission.admit(key, client, s.max_positions * per_position, loop.time())  # noqa: E731
        opening = lambda: VerifierSession.open(  # noqa: E731
            self.batcher, spec, self.config.limits, self.stats, key, owner=client, admit=admit
        )
        try:
            return await opening()
        except NoRoom:
            budget = generation_budget(
                message.max_new_tokens, self.engine.info.max_context, message.prompt_length
            )
            kv_bytes = (message.prompt_length + budget) * per_position
            if not await self._preempt(self.admission.victims(client, kv_bytes, loop.time())):
                raise
        return await opening()  # the room the preempted sessions left (Refused if another took it)

    def _preempted(self, key: str, client: str, session: VerifierSession | None, e: Preempted) -> Preempted:
        """How a preempted session ends: saying how many generated tokens it had committed."""
        self.preempted_sessions += 1
        committed = len(session.generated) if session is not None else 0
        log.info("session %s of %r preempted after %d generated tokens", key, client, committed)
        return Preempted(f"{e} ({committed} generated tokens committed)")

    async def _preempt(self, keys: list[str], wait_s: float = 2.0) -> bool:
        """Ends the idle sessions `keys` (Preempted) and waits up to `wait_s` for their release; returns
        whether they were released."""
        lifetimes = [self._lifetimes[k] for k in keys if k in self._lifetimes]
        for lifetime in lifetimes:
            lifetime.preempted.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while keys and loop.time() < deadline:
            if not any(self.admission.holds(k) for k in keys):
                return True
            await asyncio.sleep(0.01)
        return bool(keys) and not any(self.admission.holds(k) for k in keys)

    def _opened(self, key: str, session: VerifierSession) -> Opened:
        return Opened(
            session_id=key,
            committed_length=len(session.committed),
            reused_positions=session.reused_positions,
            numerics=self.engine.numerics.identity,
            read_ahead=session.limits.read_ahead if session.spec.thin else 0,
            forward_seconds=dict(self.batcher.stats.round_costs.means),
        )

    async def _answer(self, session: VerifierSession, message: Incoming, stale: StaleLimit, sent) -> None:
        """A message after the open: a Read, or (an edge session's) a proposal, answered with its verdict."""
        if isinstance(message, Read):
            session.read(message.committed_length)
        elif session.spec.thin:
            raise InvalidRequest("a thin session takes no proposals: the verifier drafts for it")
        elif not isinstance(message, Proposal):
            raise InvalidRequest("the session is already open: send proposals")
        else:
            verdict = await session.play(message)
            stale.record(verdict.stale, asyncio.get_running_loop().time())
            await sent(verdict)

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting (opens end with ShutDown), lets running sessions finish for up to `timeout_s`,
        then ends the rest (ShutDown)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.admission.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.cut.set()
        deadline = loop.time() + 2.0  # the cut sessions' streams end at their next message or round
        while self.admission.active and loop.time() < deadline:
            await asyncio.sleep(0.02)


def sized(config: AdmissionConfig, device: str = "cpu") -> AdmissionConfig:
    """The config with its KV budget resolved: None becomes half the memory available now (the target
    loaded) where the KV caches live, the `device` (a torch device name), so that sessions are refused
    before the kernel's out-of-memory killer picks the server, or CUDA runs out of memory."""
    if config.kv_budget_bytes is not None:
        return config
    return dataclasses.replace(config, kv_budget_bytes=available_memory(device) // 2)


def available_memory(device: str = "cpu") -> int:
    """Bytes of memory available to new allocations on `device`: a GPU's free memory as CUDA reports it
    (torch.cuda.mem_get_info, which counts other processes' use of the GPU too); on the CPU the host's
    MemAvailable (all of it where /proc cannot say)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
