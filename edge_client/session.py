"""The edge side of a generation session: draft locally, send proposals, commit what the verifier says.

The open message and the first proposal leave back to back, so the first round costs one round
trip. Without pipelining every later round costs one more. With `pipeline = n`, up to n proposals
leave ahead of their verdicts, each drafted on the assumption that the one before it is accepted
whole and that the target's bonus token is the draft's own next choice (sent as the assumed token,
so that the verifier can tell); while the assumptions hold, round trips and drafting overlap the
verification, and when one fails the verifier answers the proposals built on it as stale, at no
cost to the target. Committed tokens are kept here, so a broken stream can be resumed elsewhere
with them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncIterator, Collection, Sequence
from concurrent.futures import Executor
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
    executor: Executor | None  # where propose runs; None: on the event loop (it must be cheap)

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
    pipeline: int = 0  # proposals sent ahead of their verdicts; 0 waits for every verdict


@dataclass
class GenerationStats:
    rounds: int = 0  # verdicts that verified something
    stale_rounds: int = 0  # pipelined proposals that came back stale
    sent_ahead: int = 0  # proposals sent before the verdict of the one before them
    draft_tokens: int = 0  # proposed
    accepted_tokens: int = 0  # proposed and accepted
    generated_tokens: int = 0  # committed by verdicts (accepted plus target tokens)
    target_positions: int = 0  # the verifier's figure for this session, prefill included
    wall_s: float = 0.0
    draft_s: float = 0.0  # time spent drafting on the edge
    round_s: list[float] = field(default_factory=list)  # send to verdict, per verified round
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
            "stale_rounds": self.stale_rounds,
            "sent_ahead": self.sent_ahead,
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
        plan = _Planner(request, info.max_gamma, budget, stops)
        sequence = [*request.prompt_token_ids, *generated]
        inflight: collections.deque[_Sent] = collections.deque()
        rounds = itertools.count(1)
        call = self.stub.Session()
        verdicts: asyncio.Queue = asyncio.Queue()
        opened = asyncio.Event()
        reader = asyncio.create_task(_read_verdicts(call, verdicts, opened))
        try:
            opening = pb.EdgeMessage(open=self._open_message(request, generated))
            stats.wire_bytes += opening.ByteSize()
            await _write(call, opening)
            pending: _Sent | None = None  # drafted, to be sent unless a verdict refutes it first
            while True:
                if not verdicts.empty():
                    verdict = verdicts.get_nowait()
                elif pending is not None:
                    if pending.builds_on(sequence):
                        pending.send(next(rounds))
                        stats.sent_ahead += bool(inflight)
                        stats.wire_bytes += pending.message.ByteSize()
                        await _write(call, pending.message)
                        inflight.append(pending)
                    pending = None
                    continue
                elif (step := plan.next(sequence, inflight)) is not None:
                    t0 = time.perf_counter()
                    tokens = await self._propose(step.base, step.gamma, request.sampling, stops)
                    stats.draft_s += time.perf_counter() - t0
                    pending = plan.proposal(step, tokens)
                    continue
                elif not inflight:
                    raise VerifierError(grpc.StatusCode.INTERNAL, "no verdict awaited and nothing to propose")
                else:
                    verdict = await verdicts.get()
                new, finished = self._apply(verdict, inflight, sequence, stats)
                if new:
                    generated += new
                    yield new
                if finished:
                    break
            await call.done_writing()
        except (grpc.aio.AioRpcError, VerifierError) as e:
            error = e if isinstance(e, VerifierError) else VerifierError(e.code(), e.details() or "")
            if error.code == grpc.StatusCode.INTERNAL and not opened.is_set():
                await self._raise_open_refusal(request, generated)
            raise error from None
        finally:
            reader.cancel()
            call.cancel()

    async def _raise_open_refusal(self, request: GenerationRequest, generated: list[int]) -> None:
        """Raises the verifier's status for this open, if it refuses it.

        The first proposal leaves right behind the open message, without waiting. When the verifier
        refuses the open, that write can race the refusal, and the gRPC core then reports a bare
        INTERNAL for the whole call. A stream with the open message alone gets the real status."""
        call = self.stub.Session()
        try:
            await call.write(pb.EdgeMessage(open=self._open_message(request, generated)))
            await call.read()
        except grpc.aio.AioRpcError as e:
            raise VerifierError(e.code(), e.details() or "") from None
        finally:
            call.cancel()

    @staticmethod
    def _apply(
        verdict, inflight: collections.deque[_Sent], sequence: list[int], stats: GenerationStats
    ) -> tuple[list[int], bool]:
        """Commits a verdict of the oldest proposal in flight: (new tokens, finished)."""
        if isinstance(verdict, BaseException):
            raise verdict
        sent = inflight.popleft()
        stats.wire_bytes += verdict.ByteSize()
        if verdict.round != sent.round:
            raise VerifierError(grpc.StatusCode.INTERNAL, f"verdict {verdict.round} for {sent.round}")
        if verdict.stale:
            stats.stale_rounds += 1
            return [], False
        stats.round_s.append(time.perf_counter() - sent.sent_at)
        new = list(sent.draft[: verdict.accepted])
        if verdict.HasField("target_token_id"):
            new.append(verdict.target_token_id)
        sequence += new
        stats.rounds += 1
        stats.draft_tokens += len(sent.draft)
        stats.accepted_tokens += verdict.accepted
        stats.generated_tokens += len(new)
        stats.target_positions = verdict.target_positions
        return new, verdict.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    async def _propose(self, sequence: list[int], gamma: int, params: SamplingParams, stops) -> list[int]:
        executor = self.drafter.executor
        if executor is None:
            return self.drafter.propose(sequence, gamma, params, stops)
        return await asyncio.get_running_loop().run_in_executor(
            executor, self.drafter.propose, sequence, gamma, params, stops
        )

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


@dataclass
class _Sent:
    """A proposal on the wire, waiting for its verdict."""

    prefix: list[int]  # the sequence it builds on, assumed tokens included; len == start_position
    assumed: list[int]  # the last tokens of prefix, not yet committed when it was drafted
    draft: list[int]
    final: bool  # its verdict may finish the session: nothing is drafted on top of it
    round: int = 0
    message: pb.EdgeMessage | None = None
    sent_at: float = 0.0

    def builds_on(self, sequence: list[int]) -> bool:
        """Whether it is still live: what it assumes agrees with the committed `sequence`."""
        return self.prefix[: len(sequence)] == sequence

    def send(self, round_no: int) -> None:
        self.round, self.sent_at = round_no, time.perf_counter()
        self.message = pb.EdgeMessage(
            proposal=pb.Proposal(
                round=round_no,
                start_position=len(self.prefix),
                draft_token_ids=self.draft,
                assumed_token_ids=self.assumed,
            )
        )


@dataclass(frozen=True)
class _Step:
    """What to draft next: `gamma` tokens after `base`; when `assumes` the first of them is the guess
    of the bonus token of the proposal before, sent as the assumed token, not as a draft token."""

    base: list[int]
    gamma: int
    assumes: bool


@dataclass
class _Planner:
    request: GenerationRequest
    max_gamma: int
    budget: int  # tokens the session may generate
    stops: Collection[int]
    blocked: int = -1  # a base length whose guess was a stop token: wait for verdicts there

    def next(self, sequence: list[int], inflight: collections.deque[_Sent]) -> _Step | None:
        """The next thing to draft, or None to wait for a verdict. A proposal in flight is live while
        the committed sequence agrees with what it assumed; the next one builds on the last live one."""
        live = [s for s in inflight if s.builds_on(sequence)]
        if not live:
            gamma = self._gamma(len(sequence))
            return _Step(sequence, gamma, False) if gamma else None
        last = live[-1]
        base = [*last.prefix, *last.draft]
        if len(live) > self.request.pipeline or last.final or self.blocked == len(base):
            return None
        gamma = self._gamma(len(base) + 1)
        return _Step(base, gamma + 1, True) if gamma else None

    def proposal(self, step: _Step, tokens: list[int]) -> _Sent | None:
        """The proposal drafted for `step`, or None when the guess is a stop token (nothing follows it)."""
        assumed, draft = (tokens[:1], tokens[1:]) if step.assumes else ([], tokens)
        if not draft or any(t in self.stops for t in assumed):
            self.blocked = len(step.base)
            return None
        prefix = [*step.base, *assumed]
        return _Sent(prefix, assumed, draft, self._final(prefix, draft))

    def _final(self, prefix: list[int], draft: list[int]) -> bool:
        """Whether the proposal's verdict may finish the session (budget or a stop token)."""
        generated = len(prefix) - len(self.request.prompt_token_ids)
        return generated + len(draft) + 1 >= self.budget or any(t in self.stops for t in draft)

    def _gamma(self, length: int) -> int:
        left = self.budget - (length - len(self.request.prompt_token_ids))
        # The last round may propose more than the budget leaves: the verifier drops the excess.
        return max(1, min(self.request.gamma, left - 1, self.max_gamma)) if left > 0 else 0


async def _read_verdicts(call, verdicts: asyncio.Queue, opened: asyncio.Event) -> None:
    """Puts every verdict of the stream on the queue; then an error for an early end or a failure."""
    try:
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise VerifierError(grpc.StatusCode.UNAVAILABLE, "the verifier closed the session early")
            if message.WhichOneof("kind") == "verdict":
                verdicts.put_nowait(message.verdict)
            elif message.WhichOneof("kind") == "opened":
                opened.set()
    except grpc.aio.AioRpcError as e:
        verdicts.put_nowait(VerifierError(e.code(), e.details() or ""))
    except VerifierError as e:
        verdicts.put_nowait(e)


async def _write(call, message: pb.EdgeMessage) -> None:
    """Writes to the stream; a stream the verifier already ended raises its status as VerifierError."""
    try:
        await call.write(message)
    except asyncio.InvalidStateError:
        raise VerifierError(await call.code(), await call.details() or "") from None
