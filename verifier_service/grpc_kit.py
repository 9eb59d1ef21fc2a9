"""The verifier's gRPC kit: what any server of the Verifier service needs around its handlers, the
replica's (servicer.start_server) and the pool's front (cluster/front.py) alike.

The listen config, making and binding the server (one process per port, keepalive, message limits,
authentication), health and reflection, INVALID_ARGUMENT for requests that do not parse, whom a call
belongs to, and the Prometheus endpoint. Nothing here knows what a session does.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from draftwire import metrics, ports, widths, wire
from draftwire.metrics import StatsCollector
from draftwire.v1 import draftwire_pb2 as pb
from verifier_service import auth
from verifier_service.admission import ANONYMOUS, AdmissionConfig
from verifier_service.auth import AuthConfig, TlsConfig
from verifier_service.batcher import BatchConfig
from verifier_service.engine import PrefixCacheConfig
from verifier_service.gamma_cap import CapConfig
from verifier_service.lifecycle import LifetimeConfig
from verifier_service.session import VerifierLimits
from verifier_service.stream import StreamConfig

SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
STATS_DENIED = "server-wide figures are for admin clients (`admin` after the token in the token file)"


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a verifier listens, and (`stream`) what its sessions run under."""

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    # Larger messages are refused with RESOURCE_EXHAUSTED by gRPC, unparsed. None: what the target's context
    # needs (wire.message_bytes_for, set by start_server); a pool's front, which forwards, takes 1 MiB.
    max_message_bytes: int | None = None
    limits: VerifierLimits = VerifierLimits()
    batch: BatchConfig = BatchConfig()
    metrics_port: int | None = None  # Prometheus metrics over HTTP on metrics_host:metrics_port (None: off)
    metrics_host: str = "127.0.0.1"  # plain HTTP: loopback unless asked otherwise ("0.0.0.0" spelled out)
    metrics_token_file: Path | None = None  # scrapes must send `Authorization: Bearer T`, T in this file
    # Finished sessions' caches kept for the next turn of a conversation (StreamConfig's default).
    prefix_cache: PrefixCacheConfig = StreamConfig.prefix_cache
    tls: TlsConfig | None = None  # None: plaintext
    auth: AuthConfig = AuthConfig()  # who may call (verifier_service/auth.py); default: anyone
    admission: AdmissionConfig = AdmissionConfig()  # caps, rates, KV budget (verifier_service/admission.py)
    lifetime: LifetimeConfig = LifetimeConfig()  # idle timeout, maximum age, drain (lifecycle.py)
    gamma_cap: CapConfig = CapConfig()  # the γ cap the verdicts advertise under load (gamma_cap.py)
    # A connection must finish its handshake (TLS, and the HTTP/2 preface and settings) within this, or it
    # is closed: half-open connections (slow-loris) hold nothing for long.
    handshake_timeout_s: float = 10.0

    @property
    def message_limit(self) -> int:
        """The largest message taken: the configured one, else 1 MiB (start_server sets a verifier's from
        its target's context first, so this default is a pool front's)."""
        return self.max_message_bytes or wire.MAX_MESSAGE_BYTES

    @property
    def stream(self) -> StreamConfig:
        """What the sessions run under (verifier_service.stream)."""
        return StreamConfig(
            self.limits, self.batch, self.prefix_cache, self.admission, self.lifetime, self.gamma_cap
        )


RETRY_AFTER = "retry-after-ms"  # trailing metadata of a RESOURCE_EXHAUSTED open: when to try again


def client_of(identity: auth.Identity, context) -> str:
    """Whom a session belongs to: the per-client caps and KV share count it against this client, it
    starts only from this client's kept caches, and the cache it leaves is this client's.

    An anonymous caller (no token, no certificate) cannot be recognised on another connection, so its
    connection (the peer's address and port) stands for it:
    - a conversation's turns on one channel reuse their caches, and no other connection takes them
      (reuse across connections needs an identity; `reused_positions` tells an anonymous caller nothing
      of what others sent);
    - for the caps and fair shares, though, the anonymous connections from one address are one client
      (admission.party_of): a host opening many connections gets one share, as callers behind one NAT
      do; give clients tokens to tell them apart."""
    return identity.name or ANONYMOUS + (context.peer() or "")


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
    # What the server sends (verdicts, model info with its chat template) is its own: 1 MiB bounds it.
    options = wire.message_size_options(config.message_limit, wire.MAX_MESSAGE_BYTES)
    if guards is None:
        guards = auth.interceptors(config.auth, config.tls)
    handshake = [("grpc.server_handshake_timeout_ms", max(1, round(config.handshake_timeout_s * 1000)))]
    return grpc.aio.server(
        options=[*options, *KEEPALIVE_OPTIONS, *handshake, *ports.SERVER_OPTIONS],
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


class StopSignal:
    """SIGINT and SIGTERM over a server's whole run, taken by its event loop from before the run starts.
    The loop's wakeup fd sees a signal whichever thread it lands on and however late Python gets round
    to a handler, so no signal is lost between handlers (asyncio's Runner's, then the loop's):
    - one the loop takes before the server awaits `wait` cuts the start short: the run is cancelled,
      and `run_until_signal` ends it as a Ctrl-C (KeyboardInterrupt). (A start that holds the loop, a
      calibration say, may end before the loop takes a signal that came meanwhile: it then drains.)
    - once it serves (awaiting `wait`), the first returns from `wait`, and the server drains;
    - one more during the drain cancels the run: a second Ctrl-C does not wait for the drain."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._task: asyncio.Task | None = None
        self._serving = False
        self._stop = asyncio.Event()
        self.cut_short = False  # a signal cancelled the run
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signalled)

    def _signalled(self) -> None:
        if self._serving and not self._stop.is_set():
            self._stop.set()
            return
        self.cut_short = True
        if self._task is not None:
            self._task.cancel()

    async def run(self, main) -> None:
        """Awaits main(self) as the run that a signal cancels."""
        self._task = asyncio.current_task()
        if self.cut_short:  # a signal came before the run began
            raise asyncio.CancelledError
        await main(self)

    async def wait(self) -> None:
        """Returns at the first SIGINT or SIGTERM from now on: the server's cue to stop gracefully."""
        self._serving = True
        await self._stop.wait()


def run_until_signal(main) -> None:
    """asyncio.run(main(stop)), with `stop` a StopSignal that the loop holds from before main starts;
    raises KeyboardInterrupt where a signal cut the run short. A Ctrl-C while the loop is being built
    waits until it is whole (else the half-made loop complains when it is collected)."""
    held = []
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        loop = asyncio.new_event_loop()
        stop = StopSignal(loop)  # its handlers replace the one above (the loop restores them as it closes)
    except BaseException:
        signal.signal(signal.SIGINT, previous)
        raise
    try:
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            if held:
                raise KeyboardInterrupt
            runner.run(stop.run(main))
    except asyncio.CancelledError:
        if stop.cut_short:
            raise KeyboardInterrupt from None
        raise


async def set_health(health_servicer: health.aio.HealthServicer, serving: bool) -> None:
    """Says SERVING or NOT_SERVING for the server as a whole and for the Verifier service."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE):
        await health_servicer.set(name, status)
