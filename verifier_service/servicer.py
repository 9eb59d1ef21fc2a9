"""The gRPC face of the verifier: converts protobuf to dataclasses, calls the session, converts back.

Engine work runs on one executor thread, in arrival order, so the event loop stays free for the
wire and a session's KV cache is only touched by that thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from draftwire import metrics, ports, widths, wire
from draftwire.contract import ModelInfo
from draftwire.metrics import StatsCollector
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from verifier_service import auth
from verifier_service.admission import Admission, AdmissionConfig, Refused, Window
from verifier_service.auth import AuthConfig, TlsConfig
from verifier_service.batcher import BatchConfig, Batcher, ServedEngine
from verifier_service.engine import PrefixCacheConfig
from verifier_service.gamma_cap import CapConfig, GammaCap
from verifier_service.lifecycle import Ended, Lifetime, LifetimeConfig, cut_off
from verifier_service.session import (
    InvalidRequest,
    SessionError,
    VerifierLimits,
    VerifierSession,
    VerifierStats,
    WrongState,
)

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
STATS_DENIED = "server-wide figures are for admin clients (`admin` after the token in the token file)"
_STATUS = {InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, WrongState: grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES  # larger messages are refused with RESOURCE_EXHAUSTED
    limits: VerifierLimits = VerifierLimits()
    batch: BatchConfig = BatchConfig()
    metrics_port: int | None = None  # Prometheus metrics over HTTP on metrics_host:metrics_port (None: off)
    metrics_host: str = "127.0.0.1"  # plain HTTP: loopback unless asked otherwise ("0.0.0.0" spelled out)
    metrics_token_file: Path | None = None  # scrapes must send `Authorization: Bearer T`, T in this file
    # Finished sessions' caches kept for the next turn of a conversation: 1 GiB for 10 minutes.
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig(budget_bytes=1 << 30, ttl_s=600.0)
    tls: TlsConfig | None = None  # None: plaintext
    auth: AuthConfig = AuthConfig()  # who may call (verifier_service/auth.py); default: anyone
    admission: AdmissionConfig = AdmissionConfig()  # caps, rates, KV budget (verifier_service/admission.py)
    lifetime: LifetimeConfig = LifetimeConfig()  # idle timeout, maximum age, drain (lifecycle.py)
    gamma_cap: CapConfig = CapConfig()  # the γ cap the verdicts advertise under load (gamma_cap.py)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: ServedEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.stats = VerifierStats()
        self.batcher = Batcher(engine, config.batch, GammaCap(config.limits.max_gamma, config.gamma_cap))
        self.refusals: collections.Counter[str] = collections.Counter()  # sessions ended by a status
        self.admission = Admission(sized(config.admission))
        # Kept caches live inside the KV budget too: they give way to the sessions' reservations.
        room = (lambda: self.admission.kv_room) if self.admission.config.kv_budget_bytes else None
        engine.keep_finished(config.prefix_cache, room)
        self.draining = False  # opens are refused with UNAVAILABLE (the edge resumes elsewhere)
        self.tokens: auth.TokenTable | None = None  # the token file, when the server has one (start_server)
        self.revoked_sessions = 0  # open sessions ended because their credentials no longer admit them
        self.cut = asyncio.Event()  # set when the drain's time is up: every session ends, UNAVAILABLE

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return wire.model_info_to_proto(
            ModelInfo(
                self.engine.info,
                self.config.limits.max_gamma,
                self.config.max_message_bytes,
                self.engine.numerics,
            )
        )

    async def GetStats(self, request, context) -> pb.ServerStats:
        """Server-wide figures, which tell of every client's traffic: for admins only when clients
        authenticate (PERMISSION_DENIED for the others)."""
        if not auth.caller().admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, STATS_DENIED)
        return self.stats_proto()

    def stats_proto(self) -> pb.ServerStats:
        """This process's counters (GetStats, and the Prometheus metrics)."""
        s, b = self.stats, self.batcher.stats
        return pb.ServerStats(
            active_sessions=self.engine.active_sessions,
            sessions_opened=s.sessions_opened,
            rounds=s.rounds,
            generated_tokens=s.generated_tokens,
            round_positions=s.round_positions,
            prefill_positions=s.prefill_positions,
            target_positions_per_token=s.target_positions_per_token,
            engine_batches=b.batches,
            engine_forwards=b.forwards,
            engine_seconds=b.seconds,
            reused_positions=s.reused_positions,
            kept_caches=len(self.engine.prefix_cache),
            cache_bytes=self.engine.cache_bytes,
            drafts=s.drafts,
            draft_tokens=s.draft_tokens,
            accepted_tokens=s.accepted_tokens,
            accepted_per_position=s.accepted_per_position,
            stale_proposals=s.stale_proposals,
            thin_sessions=s.thin_sessions,
            refusals=self.refusals,
            batch_seconds_counts=b.seconds_counts,
            batch_size_counts=b.size_counts,
            gamma_cap=self.batcher.gamma_cap.value,
            numerics=[wire.numerics_to_proto(self.engine.numerics)],
        )

    async def Session(self, request_iterator, context):
        """Translates the stream: open, then one verdict per proposal (a thin session: one per round the
        verifier plays itself, to the finish, at most read_ahead tokens past the edge's last Read); a
        SessionError becomes a status.

        After a finish the stream stays open until the edge half-closes; a proposal sent meanwhile is
        answered stale if the finish made it obsolete, else refused (FAILED_PRECONDITION).
        """
        # Not guessable; the session, its cache and what it leaves for a next turn belong to the caller.
        key = f"session-{secrets.token_urlsafe(12)}"
        client = client_of(auth.caller(), context)  # its caps, its share, its kept caches
        session: VerifierSession | None = None
        # Ends the session within 2 × recheck_s when its token or certificate name is revoked.
        lifetime = Lifetime(self.config.lifetime, self.cut, auth.recheck())
        stale, stale_in_a_row = Window(self.config.admission.max_stale_per_s, 1.0), 0
        loop = asyncio.get_running_loop()
        try:
            async for message in lifetime.messages(request_iterator):
                kind = message.WhichOneof("kind")
                if session is None:
                    if kind != "open":
                        raise InvalidRequest("the first message of a session must be `open`")
                    opening = message.open
                    VerifierSession.check_lengths(
                        self.engine.info, len(opening.prompt_token_ids), opening.stop.max_new_tokens
                    )
                    spec = wire.spec_from_proto(opening)
                    del opening
                    del message  # a refused open keeps nothing of the request alive
                    if self.draining:
                        raise cut_off()
                    session = await VerifierSession.open(
                        self.batcher,
                        spec,
                        self.config.limits,
                        self.stats,
                        key,
                        owner=client,
                        admit=lambda s: self.admission.admit(
                            key, client, s.max_positions * self.engine.bytes_per_position, loop.time()
                        ),
                    )
                    opened = pb.SessionOpened(
                        session_id=key,
                        committed_length=len(session.committed),
                        reused_positions=session.reused_positions,
                        numerics=self.engine.numerics.identity,
                        read_ahead=session.limits.read_ahead if session.spec.thin else 0,
                    )
                    await lifetime.sent(context.write(pb.VerifierMessage(opened=opened)))
                elif kind == "read":
                    session.read(message.read.committed_length)
                elif session.spec.thin:
                    raise InvalidRequest("a thin session takes no proposals: the verifier drafts for it")
                elif kind != "proposal":
                    raise InvalidRequest("the session is already open: send proposals")
                else:
                    verdict = await session.play(wire.proposal_from_proto(message.proposal))
                    stale_in_a_row = stale_in_a_row + 1 if verdict.stale else 0
                    if verdict.stale:
                        self._check_stale(stale_in_a_row, stale, loop.time())
                    await lifetime.sent(
                        context.write(pb.VerifierMessage(verdict=wire.verdict_to_proto(verdict)))
                    )
                # A thin session: the verifier plays its rounds itself, up to read_ahead past what the
                # edge has read; then it waits for the edge's next Read.
                while session.plays_on:
                    lifetime.check()
                    verdict = await session.play(session.own_proposal())
                    await lifetime.sent(
                        context.write(pb.VerifierMessage(verdict=wire.verdict_to_proto(verdict)))
                    )
        except Refused as e:
            log.info("session %s not admitted: %s", key, e)
            retry_ms = max(1, round(e.retry_after_s * 1000))
            ending = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after {retry_ms} ms", retry_ms)
        except Ended as e:
            log.info("session %s ended: %s", key, e)
            self.revoked_sessions += lifetime.revoked.is_set()
            ending = (e.code, str(e), None)
        except SessionError as e:
            log.info("session %s refused: %s", key, e)
            ending = (_STATUS[type(e)], str(e), None)
        except DecodeError as e:  # bytes that are no EdgeMessage: the edge's fault, not the verifier's
            log.info("session %s sent a malformed message: %s", key, e)
            ending = (grpc.StatusCode.INVALID_ARGUMENT, f"not an EdgeMessage: {e}", None)
        except Exception as e:  # a bug or a device failure: end this session only, say so
            log.exception("session %s failed", key)
            ending = (grpc.StatusCode.INTERNAL, f"verifier error: {type(e).__name__}: {e}", None)
        else:
            return
        finally:
            lifetime.close()
            # Queued behind any forward of this key, so nothing outlives the release.
            self.batcher.release(key)
            self.admission.release(key)
        # Aborted outside the except clauses and with the request dropped: the abort's traceback holds
        # this frame, and a refused request must not stay alive with it (a 1 MiB open held 8 MB each).
        session = spec = message = opening = None
        code, details, retry_ms = ending
        self.refusals[code.name] += 1
        metadata = ((RETRY_AFTER, str(retry_ms)),) if retry_ms is not None else ()
        await context.abort(code, details, trailing_metadata=metadata)

    def auth_families(self):
        """The metric families of authentication (draftwire.metrics.auth_families)."""
        tokens = self.tokens
        return metrics.auth_families(
            None if tokens is None else tokens.error is None,
            tokens.failures if tokens is not None else 0,
            self.revoked_sessions,
        )

    async def watch_tokens(self, health_servicer) -> None:
        """Follows the token file: re-reads it when it changes (so a broken file is logged at once, not
        at the next call), and while it is broken health says NOT_SERVING (nobody can be admitted),
        SERVING again once it is fixed (unless draining)."""
        serving = True
        while True:
            await asyncio.sleep(self.config.lifetime.recheck_s)
            self.tokens.refresh()
            good = self.tokens.error is None
            if good != serving and not self.draining:
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if good
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in ("", SERVICE):
                    await health_servicer.set(name, status)
                serving = good

    def _check_stale(self, in_a_row: int, per_second: Window, now: float) -> None:
        """Raises Ended (RESOURCE_EXHAUSTED) when a session's stale proposals look like a flood."""
        limit = self.config.admission.max_stale_in_a_row
        if limit and in_a_row > limit:
            raise Ended(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than {limit} stale proposals in a row: the session is ended",
            )
        if per_second.limit and not per_second.allow(now):
            raise Ended(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than {per_second.limit} stale proposals in a second: the session is ended",
            )

    async def drain(self, timeout_s: float, health_servicer=None) -> None:
        """Stops admitting (opens get UNAVAILABLE, health says NOT_SERVING), lets running sessions
        finish for up to `timeout_s`, then ends the rest with UNAVAILABLE."""
        self.draining = True
        if health_servicer is not None:
            for name in ("", SERVICE):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.admission.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.cut.set()
        deadline = loop.time() + 2.0  # the cut sessions' streams end at their next message or round
        while self.admission.active and loop.time() < deadline:
            await asyncio.sleep(0.02)


RETRY_AFTER = "retry-after-ms"  # trailing metadata of a RESOURCE_EXHAUSTED open: when to try again
ANONYMOUS = "#connection "  # no listed client is named so: '#' starts a comment in a token file


def client_of(identity: auth.Identity, context) -> str:
    """Whom a session belongs to: the per-client caps and KV share count it against this client, it
    starts only from this client's kept caches, and the cache it leaves is this client's.

    An anonymous caller (no token, no certificate) cannot be recognised on another connection, so its
    connection (the peer's address and port) stands for it:
    - a conversation's turns on one channel reuse their caches, and no other connection takes them
      (reuse across connections needs an identity; `reused_positions` tells an anonymous caller nothing
      of what others sent);
    - callers behind one NAT or on one host are not one client, so one of them cannot lock the others
      out; a caller with many connections is held only by the server-wide caps: give clients tokens
      when that matters."""
    return identity.name or ANONYMOUS + (context.peer() or "")


def sized(config: AdmissionConfig) -> AdmissionConfig:
    """The config with its KV budget resolved: None becomes half the memory available now (the target
    loaded), so that sessions are refused before the kernel's out-of-memory killer picks the server."""
    if config.kv_budget_bytes is not None:
        return config
    return dataclasses.replace(config, kv_budget_bytes=available_memory() // 2)


def available_memory() -> int:
    """Bytes of memory available to new allocations (MemAvailable; all of it where /proc cannot say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class VerifierServer:
    """A started verifier: its gRPC server, servicer and health, stopped at once or drained."""

    def __init__(self, server: grpc.aio.Server, servicer: VerifierServicer, health_servicer):
        self.server, self.servicer, self.health = server, servicer, health_servicer
        self.metrics_port: int | None = None  # where the Prometheus metrics listen (None: nowhere)
        self.watch: asyncio.Task | None = None  # follows the token file (VerifierServicer.watch_tokens)

    async def stop(self, grace: float | None = None) -> None:
        if self.watch is not None:
            self.watch.cancel()
        await self.server.stop(grace)

    async def drain(self, timeout_s: float | None = None) -> None:
        """Graceful shutdown: VerifierServicer.drain (the config's drain timeout when None), then stop."""
        if timeout_s is None:
            timeout_s = self.servicer.config.lifetime.drain_timeout_s
        await self.servicer.drain(timeout_s, self.health)
        await self.stop(1.0)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(engine: ServedEngine, config: ServerConfig) -> tuple[VerifierServer, int]:
    """Starts the verifier, health and reflection services; returns the server and its bound port.

    Raises RuntimeError when the address cannot be bound.
    """
    guards = auth.interceptors(config.auth, config.tls)
    server = make_server(config, guards)
    servicer = VerifierServicer(engine, config)
    servicer.tokens = next((g.tokens for g in guards if g.tokens is not None), None)
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server)
    port = await bind_and_start(server, config.host, config.port, config.tls)
    metrics_port = None
    if config.metrics_port is not None:
        try:
            metrics_port = start_metrics(
                servicer.stats_proto,
                config.metrics_host,
                config.metrics_port,
                config.metrics_token_file,
                extra=servicer.auth_families,
            )
        except BaseException:
            await server.stop(None)
            raise
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    started = VerifierServer(server, servicer, health_servicer)
    started.metrics_port = metrics_port  # the bound one (metrics_port 0 picks a free port)
    if servicer.tokens is not None:
        started.watch = asyncio.get_running_loop().create_task(servicer.watch_tokens(health_servicer))
    return started, port


def start_metrics(snapshot, host: str, port: int, token_file: Path | None = None, extra=None) -> int:
    """Serves Prometheus metrics made from `snapshot()` (a ServerStats) and `extra()` (more metric
    families, when given) at http://host:port/metrics, on a thread of its own; returns the bound port
    (0 picks a free one). `host` must be named: `0.0.0.0` (or `::`) for every interface, never "".
    With `token_file`, every scrape must send `Authorization: Bearer T` with the token in that file
    (re-read at each scrape, so it can be rotated).

    Raises ValueError for an empty host, ports.PortInUse when something listens there, OSError when it
    cannot bind otherwise or the token file cannot be read."""
    if not host:
        raise ValueError(metrics.EMPTY_HOST)
    if token_file is not None:
        metrics.read_token(token_file)  # unreadable or empty: said at start, not at the first scrape
    ports.check_free(host, port)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot, extra))
    return metrics.serve(registry, host, port, token_file)


def add_health_and_reflection(server: grpc.aio.Server) -> health.aio.HealthServicer:
    """Adds grpc.health.v1 and reflection (listing the Verifier service) to a server not yet started;
    returns the health servicer, whose status starts unset."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE, health_name, reflection.SERVICE_NAME), server)
    return health_servicer


def make_server(config: ServerConfig, guards: list | None = None) -> grpc.aio.Server:
    """A grpc.aio server with the config's message limits, keepalive (a vanished client's streams end)
    and its authentication (`guards`, else auth.interceptors of the config); without SO_REUSEPORT, so
    that it never shares a port (draftwire.ports).

    Raises OSError or auth.BadTokenFile when the token file cannot be read."""
    options = wire.message_size_options(config.max_message_bytes)
    if guards is None:
        guards = auth.interceptors(config.auth, config.tls)
    return grpc.aio.server(
        options=[*options, *KEEPALIVE_OPTIONS, *ports.SERVER_OPTIONS],
        interceptors=[*guards, MalformedRequests()],
    )


class _Malformed:
    """What a unary call's request deserializes to when its bytes are not the request message."""

    def __init__(self, error: DecodeError):
        self.error = error


class MalformedRequests(grpc.aio.ServerInterceptor):
    """A call with one request (unary, or server streaming like health Watch) whose bytes do not parse
    gets INVALID_ARGUMENT, where grpc would answer UNKNOWN. (A Session's messages: the servicer catches
    the DecodeError.) A uint32 field holding 2**32 or more is such bytes too, refused before protobuf
    would keep its low 32 bits (draftwire.widths). Innermost: authentication comes first."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        handler = handler._replace(request_deserializer=widths.strict_parser(handler.request_deserializer))
        if handler.unary_unary is None and handler.unary_stream is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method.rsplit("/", 1)[-1]

        def lenient(data: bytes):
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(e)

        async def refuse(request, context) -> None:
            if isinstance(request, _Malformed):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"not a {method} request: {request.error}"
                )

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                await refuse(request, context)
                return await inner(request, context)

            return handler._replace(unary_unary=unary_unary, request_deserializer=lenient)
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):

            async def unary_stream(request, context):
                await refuse(request, context)
                async for reply in inner(request, context):
                    yield reply

        else:  # writes its replies with context.write (health Watch)

            async def unary_stream(request, context):
                await refuse(request, context)
                return await inner(request, context)

        return handler._replace(unary_stream=unary_stream, request_deserializer=lenient)


# A connection silent for 30 s is pinged; one that does not answer in 10 s is closed with its streams.
# Edges may ping every 10 s or more; connections live at most a day (then clients reconnect).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_connection_age_ms", 24 * 3600 * 1000),
    ("grpc.max_connection_age_grace_ms", 3600 * 1000),
]


async def bind_and_start(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None = None) -> int:
    """Binds host:port (0 picks a free port), with TLS when given, and starts serving; returns the
    bound port.

    Raises ports.PortInUse (a RuntimeError) when something listens there, RuntimeError when the address
    cannot be bound otherwise."""
    ports.check_free(host, port)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot bind {host}:{port}")
    await server.start()
    return bound


async def wait_for_stop_signal() -> None:
    """Returns when the process gets SIGINT or SIGTERM: how `serve` knows to stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
