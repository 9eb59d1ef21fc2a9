"""The edge side of a generation session: draft locally, send proposals, commit what the verifier says.

The open message and the first proposal leave back to back, so the first round costs one round
trip; every later round costs one more. Committed tokens are kept here, so a broken stream can be
resumed elsewhere with them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire.vocab import Vocabulary
from verifier_service.rules import SamplingParams


class Drafter(Protocol):
    """What a session needs from a drafter: its vocabulary, and tokens in, draft tokens out."""

    vocabulary: Vocabulary
    blocking: bool  # True: propose runs off the event loop

    def propose(
        self,
        committed: Sequence[int],
        gamma: int,
        params: SamplingParams,
        stop_token_ids: Collection[int] = (),
    ) -> list[int]: ...


class VerifierError(Exception):
    """The verifier ended the session with a non-OK status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 64  # 0: until the target's context is full
    gamma: int = 4  # draft tokens per proposal
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class GenerationStats:
    rounds: int = 0
    draft_tokens: int = 0  # proposed
    accepted_tokens: int = 0  # proposed and accepted
    generated_tokens: int = 0  # committed by verdicts (accepted plus target tokens)
    target_positions: int = 0  # the verifier's figure for this session, prefill included
    wall_s: float = 0.0
    draft_s: float = 0.0  # time spent drafting on the edge
    round_s: list[float] = field(default_factory=list)  # send to verdict, per round
    resumes: int = 0  # streams re-opened with the committed tokens after UNAVAILABLE
    wire_bytes: int = 0  # serialized protobuf payload sent and received (no HTTP/2 framing)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    def as_json(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "wall_s": self.wall_s,
        }


class EdgeSession:
    """Runs generations against one verifier channel with one drafter."""

    def __init__(self, channel: grpc.aio.Channel, drafter: Drafter, max_resumes: int = 3):
        self.stub = pb_grpc.VerifierStub(channel)
        self.drafter = drafter
        self.max_resumes = max_resumes  # re-opens after UNAVAILABLE, per generation
        self._info: pb.ModelInfo | None = None

    async def model_info(self) -> pb.ModelInfo:
        if self._info is None:
            self._info = await self.stub.GetModelInfo(pb.ModelInfoRequest())
        return self._info

    async def generate(
        self,
        request: GenerationRequest,
        stats: GenerationStats | None = None,
        committed: list[int] | None = None,
    ) -> AsyncIterator[list[int]]:
        """Yields the tokens each round commits. `committed` (if given) receives every generated
        token as it is committed, and is where a resume starts from.

        A stream that breaks with UNAVAILABLE (a verifier or replica went away) is re-opened with the
        committed tokens, up to max_resumes times; the new verifier re-prefills them, so no token is
        lost or repeated. Raises VerifierError when the verifier refuses, or when resumes run out.
        """
        stats = stats if stats is not None else GenerationStats()
        generated = committed if committed is not None else []
        start = time.perf_counter()
        resumes = 0
        try:
            while True:
                try:
                    async for new in self._stream(request, stats, generated):
                        yield new
                    return
                except VerifierError as e:
                    if e.code != grpc.StatusCode.UNAVAILABLE or resumes >= self.max_resumes:
                        raise
                    resumes += 1
                    stats.resumes += 1
        finally:
            stats.wall_s = time.perf_counter() - start

    async def _stream(
        self, request: GenerationRequest, stats: GenerationStats, generated: list[int]
    ) -> AsyncIterator[list[int]]:
        """One Session stream, from open to finish."""
        info = await self.model_info()
        stops = set(request.stop_token_ids)
        if not request.ignore_eos:
            stops.update(info.special_tokens.eos_token_ids)
        budget = request.max_new_tokens or info.max_context - len(request.prompt_token_ids)
        sequence = [*request.prompt_token_ids, *generated]
        call = self.stub.Session()
        try:
            opening = pb.EdgeMessage(open=self._open_message(request, generated))
            stats.wire_bytes += opening.ByteSize()
            await _write(call, opening)
            for round_no in itertools.count(1):
                gamma = max(1, min(request.gamma, budget - len(generated) - 1, info.max_gamma))
                t0 = time.perf_counter()
                draft = await asyncio.to_thread(
                    self.drafter.propose, sequence, gamma, request.sampling, stops
                )
                t1 = time.perf_counter()
                proposal = pb.Proposal(round=round_no, start_position=len(sequence), draft_token_ids=draft)
                message = pb.EdgeMessage(proposal=proposal)
                await _write(call, message)
                verdict = await self._next_verdict(call)
                stats.wire_bytes += message.ByteSize() + verdict.ByteSize()
                stats.round_s.append(time.perf_counter() - t1)
                stats.draft_s += t1 - t0
                new = draft[: verdict.accepted]
                if verdict.HasField("target_token_id"):
                    new.append(verdict.target_token_id)
                sequence += new
                generated += new
                stats.rounds += 1
                stats.draft_tokens += len(draft)
                stats.accepted_tokens += verdict.accepted
                stats.generated_tokens += len(new)
                stats.target_positions = verdict.target_positions
                if new:
                    yield new
                if verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    break
            await call.done_writing()
        except grpc.aio.AioRpcError as e:
            raise VerifierError(e.code(), e.details() or "") from None
        finally:
            call.cancel()

    async def run(self, request: GenerationRequest) -> tuple[list[int], GenerationStats]:
        """Generates to the end; returns the generated ids and the figures. Raises VerifierError."""
        stats, generated = GenerationStats(), []
        async for _ in self.generate(request, stats, generated):
            pass
        return generated, stats

    def _open_message(self, request: GenerationRequest, generated: list[int]) -> pb.OpenSession:
        s = request.sampling
        return pb.OpenSession(
            prompt_token_ids=request.prompt_token_ids,
            sampling=pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed),
            stop=pb.StopConditions(
                max_new_tokens=request.max_new_tokens,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
            ),
            tokenizer_fingerprint=self.drafter.vocabulary.fingerprint,
            vocab_size=self.drafter.vocabulary.size,
            generated_token_ids=generated,
        )

    @staticmethod
    async def _next_verdict(call) -> pb.Verdict:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise VerifierError(grpc.StatusCode.UNAVAILABLE, "the verifier closed the session early")
            if message.WhichOneof("kind") == "verdict":
                return message.verdict


async def _write(call, message: pb.EdgeMessage) -> None:
    """Writes to the stream; a stream the verifier already ended raises its status as VerifierError."""
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        raise VerifierError(await call.code(), await call.details() or "") from None
