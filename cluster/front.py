"""The pool's gRPC front: pumps each edge's Session stream, byte for byte, to one replica's verifier.

The front never parses a proposal or a verdict: it relays serialized messages, so it knows nothing of
the verification rules, and a round costs one extra loopback hop (no Ray call). A replica's status
reaches the edge unchanged, with its trailing metadata; a replica that goes away mid-stream is
UNAVAILABLE, which the edge answers by resuming with its committed tokens (a new session, which goes to
a live replica).

The open is the one message the front holds on to: it goes to the least loaded live replica, and the
edge's next messages are left unread until that replica's first reply. A replica that refuses the open
(RESOURCE_EXHAUSTED: its caps, the client's rate or its KV budget) has then seen nothing else, so the
front frees its slot and sends the same open to the least loaded live replica it has not tried yet; the
edge sees the refusal only when every live replica refused, with the smallest `retry-after-ms` among
them. This costs nothing per round: the first proposal waits one hop for the open's reply.

A replica can also freeze (a stopped process, a hung host) without its connection breaking. The front
checks each replica's health every `health_interval_s` with that as the deadline, and gives every unary
relay a deadline (`call_timeout_s`): a replica that misses one is suspect, new sessions go elsewhere, and
opens it has not answered are sent on to another replica; after `frozen_after_misses` missed checks in a
row its sessions end UNAVAILABLE, and their edges resume elsewhere with their committed tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.pool import NoReplica, NoSuchNumerics, Pool
from cluster.routing import Slot, State, soonest
from draftwire.aio import within
from draftwire.counters import STATS
from draftwire.v1 import draftwire_pb2 as pb
from verifier_service import auth
from verifier_service.grpc_kit import (
    RETRY_AFTER,
    SERVICE,
    STATS_DENIED,
    ServerConfig,
    add_health_and_reflection,
    bind_and_start,
    client_of,
    make_server,
    start_metrics,
)
from verifier_service.lifecycle import LifetimeConfig, revocation

log = logging.getLogger(__name__)


def add_stats(total: pb.ServerStats, reply: pb.ServerStats) -> None:
    """Adds a replica's figures to the pool's, each as draftwire.counters.STATS says: sums (lists element
    by element, maps by key), the lowest γ cap set, each distinct numerics once; ratios come after."""
    for stat in STATS:
        mine, theirs = getattr(total, stat.field), getattr(reply, stat.field)
        if stat.pool == "min":
            setattr(total, stat.field, min((v for v in (mine, theirs) if v), default=0))
        elif stat.pool == "union":
            known = {n.identity for n in mine}  # numerics: one per identity
            mine.extend(n for n in theirs if n.identity not in known)
        elif stat.pool == "sum" and hasattr(theirs, "items"):  # a map
            for key, value in theirs.items():
                mine[key] += value
        elif stat.pool == "sum" and hasattr(theirs, "extend"):  # a list
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value
        elif stat.pool == "sum":
            setattr(total, stat.field, mine + theirs)


class _Relay:
    """One edge session's call to a replica: whether the replica answered its open, and why the front
    cut it (None: it did not)."""

    def __init__(self, call):
        self.call, self.opened, self.cut = call, False, None


class Front:
    def __init__(self, pool: Pool, config: ServerConfig):
        self.pool = pool
        self.config = config
        self.server: grpc.aio.Server | None = None
        self.metrics_port: int | None = None  # the bound one, once started with metrics
        self._health = None
        self._health_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._relays: dict[str, set[_Relay]] = {}  # replica name -> the session calls to it

    async def start(self) -> int:
        """Serves the Verifier service, health and reflection; returns the bound port.

        Raises ports.PortInUse (a RuntimeError) when something listens there, RuntimeError when the
        address cannot be bound otherwise.
        """
        self.server = make_server(self.config)  # edges authenticate here; replicas trust the front
        handlers = {
            # No (de)serializers: the Session stream and model info pass through as bytes.
            "Session": grpc.stream_stream_rpc_method_handler(self._session),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(self._model_info),
            "GetStats": grpc.unary_unary_rpc_method_handler(
                self._stats,
                request_deserializer=pb.StatsRequest.FromString,
                response_serializer=pb.ServerStats.SerializeToString,
            ),
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self._health = add_health_and_reflection(self.server)
        port = await bind_and_start(self.server, self.config.host, self.config.port, self.config.tls)
        if self.config.metrics_port is not None:
            loop = asyncio.get_running_loop()

            def snapshot() -> pb.ServerStats:  # on the metrics server's thread
                return asyncio.run_coroutine_threadsafe(self._stats(pb.StatsRequest(), None), loop).result(15)

            self.metrics_port = start_metrics(
                snapshot, self.config.metrics_host, self.config.metrics_port, self.config.metrics_token_file
            )
        self._health_task = asyncio.get_running_loop().create_task(self._follow_health())
        self._watch_task = asyncio.get_running_loop().create_task(self._watch_replicas())
        return port

    async def stop(self, grace: float = 2.0) -> None:
        for task in (self._health_task, self._watch_task):
            if task is not None:
                task.cancel()
        if self.server is not None:
            await self.server.stop(grace)

    async def _session(self, request_iterator, context):
        # A stream takes a slot (and counts for the autoscaler) once its first message is in: streams
        # that send nothing scale nothing, and end after the idle timeout.
        messages = aiter(request_iterator)
        idle_s = self.config.lifetime.idle_timeout_s
        try:
            first = await within(anext(messages, None), idle_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no open message within {idle_s:g} s")
        if first is None:
            return
        tried, refusals = set(), []
        numerics = _required_numerics(first)
        calls, revoked = [], []  # the call to the replica now; the revocation, once the edge's is revoked
        watch = self._watch_revocation(calls, revoked)
        try:
            while True:
                slot = await self._slot(tried, numerics, refusals, context)
                relay = self._relay(slot, context)
                call = relay.call
                calls[:] = [call]
                up = None
                try:
                    with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                        await call.write(first)  # a replica that ended the stream: the read says why
                    # Only the open goes before the replica's first reply: the edge's next messages wait
                    # unread, so if this replica refuses the session the next one can take it whole.
                    reply = await call.read()
                    relay.opened = True
                    up = asyncio.get_running_loop().create_task(_pump(messages, call))
                    while reply is not grpc.aio.EOF:
                        yield reply
                        reply = await call.read()
                    return
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and up is None:
                        refusals.append(e)  # refused at the open (admission): try another replica
                        continue
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        self.pool.replica_failed(slot)
                    await _abort(context, e)
                except asyncio.CancelledError:
                    if relay.cut is not None and not revoked:  # the replica stopped answering
                        if not relay.opened:
                            continue  # its open goes to another replica, whole
                        await context.abort(grpc.StatusCode.UNAVAILABLE, relay.cut)
                    if not revoked:  # the edge went away
                        raise
                    await context.abort(revoked[0].refusal.code, str(revoked[0]))
                finally:
                    if up is not None:
                        up.cancel()
                    self._relays[slot.name].discard(relay)
                    call.cancel()
                    self.pool.release(slot)
        finally:
            if watch is not None:
                watch.cancel()

    def _watch_revocation(self, calls: list, revoked: list) -> asyncio.Task | None:
        """The edge's credentials are checked again while the session runs, as on a single verifier (the
        replicas trust the front): once revoked, the replica's call in `calls` is cancelled and the
        revocation put in `revoked` (_revoke). None when nothing is rechecked."""
        if (again := auth.recheck()) is None:
            return None
        return asyncio.get_running_loop().create_task(_revoke(again, self.config.lifetime, calls, revoked))

    def _relay(self, slot: Slot, context) -> _Relay:
        """A Session call to the replica in `slot` (_call), followed so that a frozen replica's can be cut."""
        relay = _Relay(self._call(slot, context))
        self._relays.setdefault(slot.name, set()).add(relay)
        return relay

    async def _slot(self, tried: set, numerics: str, refusals: list, context):
        """The least loaded live replica with the session's numerics that was not `tried` yet (now it is).
        Ends the stream when there is none: with the soonest retry of the replicas' `refusals` when every
        live one refused, else UNAVAILABLE (FAILED_PRECONDITION: none computes those numerics)."""
        try:
            slot = await self.pool.acquire(exclude=tried, numerics=numerics)
        except NoSuchNumerics as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except NoReplica as e:
            if refusals:  # every live replica refused: the edge hears the soonest retry
                await _abort(context, refusals[soonest([_retry_after_ms(r) for r in refusals])])
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        tried.add(slot.name)
        return slot

    def _call(self, slot, context):
        """A Session call to the replica in `slot`, for the edge that calls the front. An anonymous edge is
        known by its connection to the front, so that the replica keeps its caches for it alone (not for
        every anonymous edge the front speaks for)."""
        client = auth.caller()
        metadata = self.pool.hop_metadata(auth.Identity(client_of(client, context), client.admin))
        return self.pool.channel(slot).stream_stream(f"/{SERVICE}/Session")(metadata=metadata)

    async def _model_info(self, request: bytes, context) -> bytes:
        """A live replica's model info, within the call deadline: a replica that misses it (or cannot be
        reached) is suspect, and the next one is asked."""
        tried: set[str] = set()
        while True:
            try:
                slot = await self.pool.acquire(session=False, exclude=tried)
            except NoReplica as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            tried.add(slot.name)
            try:
                call = self.pool.channel(slot).unary_unary(f"/{SERVICE}/GetModelInfo")
                return await call(
                    request,
                    metadata=self.pool.hop_metadata(auth.caller()),
                    timeout=self.pool.config.call_timeout_s,
                )
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    await context.abort(e.code(), e.details() or "")
                self.pool.suspect(slot, f"missed the model info's deadline ({e.code().name})")

    async def _stats(self, request: pb.StatsRequest, context) -> pb.ServerStats:
        """Sums the counters of the replicas that serve now (a restarted replica starts from zero); for
        admins only when clients authenticate, as on a single verifier."""
        if context is not None and not auth.caller().admin:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, STATS_DENIED)
        metadata = self.pool.hop_metadata(auth.Identity("front", admin=True))
        slots = self.pool.table.of(State.LIVE, State.DRAINING)
        calls = [
            self.pool.channel(s).unary_unary(
                f"/{SERVICE}/GetStats",
                request_serializer=pb.StatsRequest.SerializeToString,
                response_deserializer=pb.ServerStats.FromString,
            )(request, timeout=self.pool.config.call_timeout_s, metadata=metadata)
            for s in slots
        ]
        total = pb.ServerStats()
        for reply in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(reply, BaseException):
                log.warning("GetStats from a replica failed: %s", reply)
                continue
            add_stats(total, reply)
        if total.generated_tokens:
            total.target_positions_per_token = total.round_positions / total.generated_tokens
        return total

    async def _watch_replicas(self) -> None:
        """Checks every live replica's health each health_interval_s (its deadline too): one that misses
        a check is suspect (Pool.suspect) and the opens it has not answered go to another replica; one
        that misses frozen_after_misses in a row is frozen, and its sessions end UNAVAILABLE (their
        edges resume elsewhere); one that answers is trusted again."""
        config, misses = self.pool.config, {}
        while True:
            slots = [s for s in self.pool.table.of(State.LIVE) if self.pool.has_channel(s)]
            answers = await asyncio.gather(*(self._answers(s, config.health_interval_s) for s in slots))
            for slot, answered in zip(slots, answers, strict=True):
                if answered:
                    misses.pop(slot.name, None)
                    self.pool.trusted(slot)
                    continue
                misses[slot.name] = missed = misses.get(slot.name, 0) + 1
                self.pool.suspect(slot, f"missed {missed} health check(s)")
                self._cut(slot, frozen=missed >= config.frozen_after_misses)
            for name in [n for n in misses if n not in self.pool.table.slots]:
                del misses[name]
            await asyncio.sleep(config.health_interval_s)

    async def _answers(self, slot: Slot, timeout_s: float) -> bool:
        """Whether the replica answers a health check within `timeout_s` (SERVING or not: a draining
        replica answers, a frozen one does not)."""
        stub = health_pb2_grpc.HealthStub(self.pool.channel(slot))
        metadata = self.pool.hop_metadata(auth.Identity("front", admin=True))
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            return e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        return True

    def _cut(self, slot: Slot, frozen: bool) -> None:
        """Cancels the session calls to a replica that stopped answering: those it has not opened yet (they
        go to another replica), and once it is `frozen` the others too (their edges resume elsewhere)."""
        why = (
            f"the verifier replica {slot.name} stopped answering: resume elsewhere with the committed tokens"
        )
        for relay in list(self._relays.get(slot.name, ())):
            if relay.cut is None and (frozen or not relay.opened):
                relay.cut = why
                relay.call.cancel()

    async def _follow_health(self) -> None:
        """SERVING while at least one replica is live."""
        codes = health_pb2.HealthCheckResponse
        while True:
            serving = bool(self.pool.table.of(State.LIVE))
            for name in ("", SERVICE):
                await self._health.set(name, codes.SERVING if serving else codes.NOT_SERVING)
            await self.pool.wait_for(lambda p, was=serving: bool(p.table.of(State.LIVE)) != was, timeout=None)


def _required_numerics(first: bytes) -> str:
    """The numerics identity a resumed session's open asks for ("" any; a message that does not parse
    is the replica's to refuse)."""
    try:
        message = pb.EdgeMessage.FromString(first)
    except DecodeError:
        return ""
    return message.open.numerics if message.WhichOneof("kind") == "open" else ""


async def _abort(context, error: grpc.aio.AioRpcError) -> None:
    """Ends the edge's call with a replica's status, its details and its trailing metadata
    (`retry-after-ms` of a refusal)."""
    await context.abort(
        error.code(), error.details() or "", trailing_metadata=tuple(error.trailing_metadata() or ())
    )


def _retry_after_ms(error: grpc.aio.AioRpcError) -> int | None:
    """The retry hint of a replica's refusal; None when it gave none."""
    hint = dict(error.trailing_metadata() or ()).get(RETRY_AFTER)
    try:
        return int(hint) if hint is not None else None
    except ValueError:
        return None


async def _revoke(again, lifetime: LifetimeConfig, calls: list, revoked: list) -> None:
    """Waits for the edge's credentials to be revoked (lifecycle.revocation), then records how the
    session ends in `revoked` and cancels the replica's call in `calls`."""
    revoked.append(await revocation(again, lifetime.recheck_s))
    for call in calls:
        call.cancel()


async def _pump(request_iterator, call) -> None:
    """Edge to replica: each message as it arrives, then the half-close."""
    try:
        async for message in request_iterator:
            await call.write(message)
        await call.done_writing()
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        pass  # the replica ended the stream; the reading side reports its status
