"""The gRPC face of the verifier: protobuf in, the stream (verifier_service/stream.py) run, protobuf out,
and one table from the project's exceptions to status codes.

Engine work runs on one executor thread, in arrival order, so the event loop stays free for the
wire and a session's KV cache is only touched by that thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging

import grpc
from google.protobuf.message import DecodeError

from draftwire import metrics, widths, wire
from draftwire.contract import ModelInfo, Verdict
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from verifier_service import auth
from verifier_service.admission import Refused
from verifier_service.batcher import ServedEngine
from verifier_service.constraints import serves_constraints
from verifier_service.grpc_kit import (
    RETRY_AFTER,
    STATS_DENIED,
    ServerConfig,
    add_health_and_reflection,
    bind_and_start,
    client_of,
    make_server,
    set_health,
    start_metrics,
)
from verifier_service.lifecycle import Preempted, Revoked, ShutDown, TimedOut
from verifier_service.session import InvalidRequest, VerifierLimits, WrongState
from verifier_service.stream import Flooded, Incoming, Open, Opened, Read, Unknown, Verifier

__all__ = ["ServerConfig", "VerifierLimits", "VerifierServer", "start_server"]
log = logging.getLogger(__name__)

# How each of the project's endings reaches the edge (Revoked: the status its refusal names; anything
# else: INTERNAL, for this session only).
STATUS = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    WrongState: grpc.StatusCode.FAILED_PRECONDITION,
    Refused: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Flooded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TimedOut: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShutDown: grpc.StatusCode.UNAVAILABLE,
    Preempted: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: Exception) -> tuple[grpc.StatusCode, str, tuple]:
    """The status code, details and trailing metadata a stream ending with `error` gets."""
    if isinstance(error, Revoked):
        return error.refusal.code, str(error), ()
    if isinstance(error, Refused):
        retry_ms = max(1, round(error.retry_after_s * 1000))
        return STATUS[Refused], f"{error}; retry after {retry_ms} ms", ((RETRY_AFTER, str(retry_ms)),)
    code = next((code for kind, code in STATUS.items() if isinstance(error, kind)), None)
    if code is None:
        return grpc.StatusCode.INTERNAL, f"verifier error: {type(error).__name__}: {error}", ()
    return code, str(error), ()


async def arrivals(requests):
    """The edge's messages (bytes: the Session stream is registered without a deserializer) as they
    arrive, each parsed and translated only when the stream calls it (stream.Arrival)."""
    async for raw in requests:
        yield functools.partial(translate, raw)
        raw = None  # a refused open keeps nothing of the request alive


def translate(raw: bytes) -> Incoming:
    """One message as the stream takes it; bytes that are no EdgeMessage are InvalidRequest (the edge's
    fault, not the verifier's), a uint32 field holding 2**32 or more included (draftwire.widths)."""
    try:
        message = PARSE_EDGE_MESSAGE(raw)
    except DecodeError as e:
        raise InvalidRequest(f"not an EdgeMessage: {e}") from None
    kind = message.WhichOneof("kind")
    if kind == "open":
        m = message.open
        return Open(len(m.prompt_token_ids), m.stop.max_new_tokens, lambda: wire.spec_from_proto(m))
    if kind == "proposal":
        return wire.proposal_from_proto(message.proposal)
    if kind == "read":
        return Read(message.read.committed_length)
    return Unknown()


PARSE_EDGE_MESSAGE = widths.strict_parser(pb.EdgeMessage.FromString)


def reply_to_proto(reply: Opened | Verdict) -> pb.VerifierMessage:
    if isinstance(reply, Opened):
        return pb.VerifierMessage(opened=pb.SessionOpened(**vars(reply)))
    return pb.VerifierMessage(verdict=wire.verdict_to_proto(reply))


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: ServedEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.verifier = Verifier(engine, config.stream)
        self.refusals: collections.Counter[str] = collections.Counter()  # sessions ended by a status
        self.tokens: auth.TokenTable | None = None  # the token file, when the server has one (start_server)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        limits, engine = self.config.limits, self.engine
        info = ModelInfo(
            engine.info,
            limits.max_gamma,
            self.config.max_message_bytes,
            engine.numerics,
            thin_sessions=limits.thin_sessions,
            constraints=serves_constraints(engine),
        )
        return wire.model_info_to_proto(info)

    async def GetStats(self, request, context) -> pb.ServerStats:
        """Server-wide figures, which tell of every client's traffic: for admins only when clients
        authenticate (PERMISSION_DENIED for the others)."""
        if not auth.caller().admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, STATS_DENIED)
        return self.stats_proto()

    def stats_proto(self) -> pb.ServerStats:
        """This process's counters (GetStats, and the Prometheus metrics)."""
        s, b = self.verifier.stats, self.verifier.batcher.stats
        return pb.ServerStats(
            **dataclasses.asdict(s),  # the session counters, each under its ServerStats name
            active_sessions=self.engine.active_sessions,
            target_positions_per_token=s.target_positions_per_token,
            engine_batches=b.batches,
            engine_forwards=b.forwards,
            engine_seconds=b.seconds,
            kept_caches=len(self.engine.prefix_cache),
            cache_bytes=self.engine.cache_bytes,
            refusals=self.refusals,
            batch_seconds_counts=b.seconds_counts,
            batch_size_counts=b.size_counts,
            gamma_cap=self.verifier.batcher.gamma_cap.value,
            numerics=[wire.numerics_to_proto(self.engine.numerics)],
        )

    async def Session(self, request_iterator, context):
        """The stream (Verifier.run) over protobuf; its ending becomes a status (STATUS)."""
        messages = arrivals(request_iterator)
        try:
            client = client_of(auth.caller(), context)
            write = lambda reply: context.write(reply_to_proto(reply))  # noqa: E731
            await self.verifier.run(client, auth.recheck(), messages, write)
            return
        except Exception as e:
            code, details, metadata = status_of(e)
        finally:  # a translation suspended at a refused open lets it go (one awaiting gRPC holds none)
            with contextlib.suppress(RuntimeError):
                await messages.aclose()
        # Aborted outside the except clause and with the request dropped: the abort's traceback holds
        # this frame, and a refused request must not stay alive with it (a 1 MiB open held 8 MB each).
        messages = None
        self.refusals[code.name] += 1
        await context.abort(code, details, trailing_metadata=metadata)

    def auth_families(self):
        """The metric families of authentication (draftwire.metrics.auth_families)."""
        tokens = self.tokens
        good = None if tokens is None else tokens.error is None
        return metrics.auth_families(good, tokens.failures if tokens else 0, self.verifier.revoked_sessions)

    async def watch_tokens(self, health_servicer) -> None:
        """Follows the token file: re-reads it when it changes (so a broken file is logged at once, not
        at the next call), and while it is broken health says NOT_SERVING (nobody can be admitted),
        SERVING again once it is fixed (unless draining)."""
        serving = True
        while True:
            await asyncio.sleep(self.config.lifetime.recheck_s)
            self.tokens.refresh()
            good = self.tokens.error is None
            if good != serving and not self.verifier.draining:
                await set_health(health_servicer, good)
                serving = good

    async def drain(self, timeout_s: float, health_servicer=None) -> None:
        """Health says NOT_SERVING, then Verifier.drain: opens get UNAVAILABLE, running sessions may
        finish for up to `timeout_s`, the rest end with UNAVAILABLE."""
        if health_servicer is not None:
            await set_health(health_servicer, False)
        await self.verifier.drain(timeout_s)


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


class _Generated:
    """Takes what the generated registration (add_VerifierServicer_to_server) would register."""

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass  # built again below from the same table

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_to_server(servicer: VerifierServicer, server) -> None:
    """The generated registration, but the Session stream's messages stay bytes until the stream reads
    them (arrivals): a client refused too often is refused once its open has arrived, unparsed."""
    generated = _Generated()
    pb_grpc.add_VerifierServicer_to_server(servicer, generated)
    session = generated.handlers["Session"]._replace(request_deserializer=None)
    handlers = {**generated.handlers, "Session": session}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(generated.service, handlers),))
    server.add_registered_method_handlers(generated.service, handlers)


async def start_server(engine: ServedEngine, config: ServerConfig) -> tuple[VerifierServer, int]:
    """Starts the verifier, health and reflection services; returns the server and its bound port.

    Raises RuntimeError when the address cannot be bound.
    """
    if config.max_message_bytes is None:
        config = dataclasses.replace(
            config, max_message_bytes=wire.message_bytes_for(engine.info.max_context)
        )
    guards = auth.interceptors(config.auth, config.tls)
    server = make_server(config, guards)
    serving = None
    try:
        servicer = VerifierServicer(engine, config)
        servicer.tokens = next((g.tokens for g in guards if g.tokens is not None), None)
        add_to_server(servicer, server)
        health_servicer = add_health_and_reflection(server)
        serving = asyncio.ensure_future(bind_and_start(server, config.host, config.port, config.tls))
        port = await asyncio.shield(serving)  # a start cut short finishes before the stop below
        started = VerifierServer(server, servicer, health_servicer)
        if config.metrics_port is not None:
            started.metrics_port = start_metrics(  # the bound one (metrics_port 0 picks a free port)
                servicer.stats_proto,
                config.metrics_host,
                config.metrics_port,
                config.metrics_token_file,
                extra=servicer.auth_families,
            )
        await set_health(health_servicer, True)
        if servicer.tokens is not None:
            started.watch = asyncio.get_running_loop().create_task(servicer.watch_tokens(health_servicer))
        return started, port
    except BaseException:
        # A start cut short (Ctrl-C, a failure): the server stops in this loop, not at its garbage
        # collection on a closed one (`Exception ignored ... Event loop is closed`).
        if serving is not None:
            with contextlib.suppress(BaseException):  # its own failure is the one being raised
                await serving
        with contextlib.suppress(Exception):
            await server.stop(None)
        raise
