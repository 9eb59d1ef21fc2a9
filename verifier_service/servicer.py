"""The gRPC face of the verifier: converts protobuf to dataclasses, calls the session, converts back.

Engine work runs on one executor thread, in arrival order, so the event loop stays free for the
wire and a session's KV cache is only touched by that thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from verifier_service.batcher import BatchConfig, Batcher
from verifier_service.engine import TargetEngine
from verifier_service.rules import Finish, SamplingParams
from verifier_service.session import (
    InvalidRequest,
    Proposal,
    SessionError,
    SessionSpec,
    Verdict,
    VerifierLimits,
    VerifierSession,
    VerifierStats,
    WrongState,
)

log = logging.getLogger(__name__)

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    Finish.STOP: pb.FINISH_REASON_STOP,
    Finish.LENGTH: pb.FINISH_REASON_LENGTH,
}
_STATUS = {InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT, WrongState: grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    max_message_bytes: int = 1 << 20  # larger messages are refused with RESOURCE_EXHAUSTED
    limits: VerifierLimits = VerifierLimits()
    batch: BatchConfig = BatchConfig()


def spec_from_proto(m: pb.OpenSession) -> SessionSpec:
    s = m.sampling
    return SessionSpec(
        prompt_token_ids=tuple(m.prompt_token_ids),
        sampling=SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            seed=s.seed,
        ),
        max_new_tokens=m.stop.max_new_tokens,
        stop_token_ids=tuple(m.stop.stop_token_ids),
        ignore_eos=m.stop.ignore_eos,
        generated_token_ids=tuple(m.generated_token_ids),
        tokenizer_fingerprint=m.tokenizer_fingerprint,
        vocab_size=m.vocab_size,
    )


def verdict_to_proto(v: Verdict) -> pb.Verdict:
    return pb.Verdict(
        round=v.round,
        start_position=v.start_position,
        accepted=v.accepted,
        target_token_id=v.target_token_id,
        finish_reason=_FINISH[v.finish],
        stale=v.stale,
        committed_length=v.committed_length,
        target_positions=v.target_positions,
    )


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: TargetEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.stats = VerifierStats()
        self.batcher = Batcher(engine, config.batch)
        self._keys = itertools.count(1)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        info = self.engine.info
        return pb.ModelInfo(
            target_id=info.target_id,
            vocab_size=info.vocabulary.size,
            tokenizer_fingerprint=info.vocabulary.fingerprint,
            max_gamma=self.config.limits.max_gamma,
            max_context=info.max_context,
            special_tokens=pb.SpecialTokens(
                bos_token_id=info.bos_token_id,
                eos_token_ids=list(info.eos_token_ids),
                pad_token_id=info.pad_token_id,
            ),
            chat_template=info.chat_template,
            max_message_bytes=self.config.max_message_bytes,
        )

    async def GetStats(self, request, context) -> pb.ServerStats:
        s = self.stats
        return pb.ServerStats(
            active_sessions=self.engine.active_sessions,
            sessions_opened=s.sessions_opened,
            rounds=s.rounds,
            generated_tokens=s.generated_tokens,
            round_positions=s.round_positions,
            prefill_positions=s.prefill_positions,
            target_positions_per_token=s.target_positions_per_token,
            engine_batches=self.batcher.stats.batches,
            engine_forwards=self.batcher.stats.forwards,
            engine_seconds=self.batcher.stats.seconds,
        )

    async def Session(self, request_iterator, context):
        key = f"session-{next(self._keys)}"
        session: VerifierSession | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("kind")
                if session is None:
                    if kind != "open":
                        raise InvalidRequest("the first message of a session must be `open`")
                    spec = spec_from_proto(message.open)
                    session = VerifierSession(self.engine, spec, self.config.limits, self.stats, key)
                    self.batcher.join(key)
                    await self.batcher.forward(session.prefill())
                    yield pb.VerifierMessage(
                        opened=pb.SessionOpened(session_id=key, committed_length=len(session.committed))
                    )
                    continue
                if kind != "proposal":
                    raise InvalidRequest("the session is already open: send proposals")
                p = message.proposal
                step = session.begin(
                    Proposal(p.round, p.start_position, tuple(p.draft_token_ids), tuple(p.assumed_token_ids))
                )
                if isinstance(step, Verdict):  # stale
                    verdict = step
                else:
                    verdict = session.complete(step, await self.batcher.forward(step.forward))
                    if verdict.finish is not None:
                        self.batcher.release(key)
                # After a finish the stream stays open until the edge half-closes; a proposal sent
                # meanwhile is answered stale if the finish made it obsolete, else refused
                # (FAILED_PRECONDITION) by the session.
                yield pb.VerifierMessage(verdict=verdict_to_proto(verdict))
        except SessionError as e:
            log.info("session %s refused: %s", key, e)
            await context.abort(_STATUS[type(e)], str(e))
        except Exception as e:  # a bug or a device failure: end this session only, say so
            log.exception("session %s failed", key)
            await context.abort(grpc.StatusCode.INTERNAL, f"verifier error: {type(e).__name__}: {e}")
        finally:
            # Queued behind any forward of this key, so nothing outlives the release.
            self.batcher.release(key)


async def start_server(engine: TargetEngine, config: ServerConfig) -> tuple[grpc.aio.Server, int]:
    """Starts the verifier, health and reflection services; returns the server and its bound port.

    Raises RuntimeError when the address cannot be bound.
    """
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_VerifierServicer_to_server(VerifierServicer(engine, config), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (
        pb.DESCRIPTOR.services_by_name["Verifier"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(services, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise RuntimeError(f"cannot bind {config.host}:{config.port}")
    await server.start()
    for name in ("", services[0]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def wait_for_stop_signal() -> None:
    """Returns when the process gets SIGINT or SIGTERM: how `serve` knows to stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
