"""The edge's transport: runs a generation's planner over one Session stream to the verifier.

The open message and the first proposal leave back to back, so the first round costs one round
trip; without pipelining every later round costs one more (see `edge_client.planner` for what
pipelining sends). Committed tokens are kept here, so a broken stream can be resumed elsewhere with
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Collection, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import grpc

from draftwire import wire
from draftwire.aio import within
from draftwire.contract import (
    Constraint,
    Drafting,
    Finish,
    ModelInfo,
    SamplingParams,
    TokenLogprob,
    Verdict,
    generation_budget,
)
from draftwire.grammar import Matcher
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire.vocab import Vocabulary
from edge_client.adaptive import Tuner
from edge_client.planner import (
    BadVerdict,
    DraftJob,
    GenerationRequest,
    GenerationStats,
    Planner,
    check_logprobs,
)

__all__ = ["Drafter", "EdgeSession", "GenerationRequest", "GenerationStats", "Timeouts", "VerifierError"]


class Drafter(Protocol):
    """What a session needs from a drafter: its vocabulary, and tokens in, draft tokens out."""

    vocabulary: Vocabulary
    executor: Executor | None  # where propose runs; None: on the event loop (it must be cheap)

    def propose(
        self,
        sequence: Sequence[int],
        gamma: int,
        params: SamplingParams,
        stop_token_ids: Collection[int] = (),
        prompt_length: int = 0,
    ) -> list[int]: ...


MATCHERS_KEPT = 8  # constraints whose draft matcher an EdgeSession keeps (compiled once each)


class VerifierError(Exception):
    """The verifier ended the session with a non-OK status (or the edge gave up on it)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Timeouts:
    """How long the edge waits on a verifier, and how it resumes after UNAVAILABLE."""

    call_s: float = 10.0  # deadline of each unary call (GetModelInfo)
    verdict_s: float | None = 60.0  # no verdict (or open) this long: a hung verifier, resumed; None: wait
    resume_s: float = 30.0  # time budget for re-opening after UNAVAILABLE, from the last progress
    # the same while the call has committed nothing (None: resume_s): the edge app's, short, answers a reply
    # that has shown nothing with a 503 instead of keeping it waiting on a verifier gone
    start_s: float | None = None
    backoff_s: float = 0.1  # first wait before a re-open; doubled each time, up to max_backoff_s
    max_backoff_s: float = 2.0

    def budget(self, committed: bool) -> float:
        """The resume budget of a call that has `committed` a token or not."""
        return self.resume_s if committed or self.start_s is None else self.start_s

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before re-open number `attempt` (1, 2, ...) of a streak."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))


@dataclass
class _Leg:
    """Speculation off, handed to the verifier: it decodes the session alone, in a thin session, from
    `start` to `end` generated tokens (or to a finish), and then the edge takes it back."""

    start: int
    end: int
    finish: Finish | None = None  # how the leg's thin session ended

    def request(self, request: GenerationRequest) -> GenerationRequest:
        """The leg's thin session: the request's, the verifier drafting by prompt lookup, to `end`."""
        return dataclasses.replace(request, drafting=Drafting.NGRAM, max_new_tokens=self.end, handoff=True)


class EdgeSession:
    """Runs generations against one verifier channel with one drafter."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        drafter: Drafter | None,
        timeouts: Timeouts = Timeouts(),
        vocabulary: Vocabulary | None = None,
    ):
        """`drafter` None: a thin client, whose requests must ask the verifier to decode (drafting NONE
        or NGRAM); `vocabulary` then names the vocabulary its prompt ids are in, if it knows it.

        With speculation off (edge_client.adaptive), the session is handed to the verifier to decode
        alone (prompt lookup, as a thin client's) until the next probe, unless the tuner's config says
        not to (`hand_off`) or the verifier once refused such a leg: then the edge sends plain steps."""
        self.stub = pb_grpc.VerifierStub(channel)
        self.drafter = drafter
        self.vocabulary = drafter.vocabulary if drafter is not None else vocabulary
        self.timeouts = timeouts
        # Adaptive requests' γ and depth: its estimates outlive a generation (same drafter, same link).
        self.tuner = Tuner()
        self._info: ModelInfo | None = None
        self.hand_off = True  # False once the verifier refused a leg
        self._matchers: dict[Constraint, Matcher | None] = {}  # the draft's, by constraint (_matcher)

    async def model_info(self) -> ModelInfo:
        """What the verifier serves (asked once per EdgeSession)."""
        if self._info is None:
            reply = await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeouts.call_s)
            self._info = wire.model_info_from_proto(reply)
        return self._info

    async def generate(
        self,
        request: GenerationRequest,
        stats: GenerationStats | None = None,
        generated: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> AsyncIterator[list[int]]:
        """Yields the tokens each round commits. `generated` (if given) receives every generated
        token as it is committed, and is where a resume starts from; `logprobs` (if given, with
        request.top_logprobs set) receives theirs, as the target computed them.

        A stream that breaks with UNAVAILABLE (a verifier or replica went away, a draining one, or
        one that sent no verdict within timeouts.verdict_s) is re-opened with the committed tokens,
        after a backoff that doubles, until timeouts.resume_s pass without progress (timeouts.start_s,
        if set, while this call has committed nothing); the new verifier re-prefills them, so no token
        is lost or repeated. Raises VerifierError when the verifier refuses, answers a bad verdict
        (INTERNAL), or when the resume budget is spent (UNAVAILABLE, saying so); `generated` then holds
        every committed token.

        A leg (speculation off, handed to the verifier) is a thin session resumed from the committed
        tokens, and the edge session that takes it back another resume: the same tokens either way.
        """
        stats = stats if stats is not None else GenerationStats()
        generated = generated if generated is not None else []
        logprobs = logprobs if logprobs is not None else []
        start = stats.started_at = time.perf_counter()
        streak, since, progress = 0, 0.0, len(generated)  # re-opens without progress, since when
        started = len(generated)
        legs: list[_Leg] = []  # the hand-off under way, if any
        try:
            while True:
                try:
                    # Closed at once when the caller stops reading: the stream is cancelled on the verifier.
                    stream = self._next_stream(request, stats, generated, logprobs, legs)
                    async with contextlib.aclosing(stream) as stream:
                        async for new in stream:
                            yield new
                    if self._finished(request, stats, generated, legs):
                        return
                except (VerifierError, grpc.aio.AioRpcError) as caught:
                    e = _as_verifier_error(caught)
                    if self._leg_refused(e, stats, generated, legs):
                        continue
                    if e.code != grpc.StatusCode.UNAVAILABLE:
                        raise e from None
                    now = time.perf_counter()
                    if len(generated) > progress or streak == 0:
                        streak, since, progress = 0, now, len(generated)
                    streak += 1
                    wait = self.timeouts.backoff(streak)
                    if now - since + wait > self.timeouts.budget(len(generated) > started):
                        raise VerifierError(
                            e.code,
                            f"gave up after {streak - 1} resumes in {now - since:.1f} s "
                            f"({len(generated)} tokens committed): {e.details}",
                        ) from None
                    stats.resumes += 1
                    await asyncio.sleep(wait)
        finally:
            stats.wall_s = time.perf_counter() - start

    def _next_stream(
        self,
        request: GenerationRequest,
        stats: GenerationStats,
        generated: list[int],
        logprobs: list,
        legs: list[_Leg],
    ) -> AsyncIterator[list[int]]:
        """The stream that goes on with the generation: a thin request's, a leg's, or the edge's."""
        if request.spec().thin:
            return self._thin_stream(request, stats, generated, logprobs)
        if legs:
            return self._thin_stream(legs[0].request(request), stats, generated, logprobs, legs[0])
        return self._stream(request, stats, generated, logprobs, legs)

    def _finished(
        self, request: GenerationRequest, stats: GenerationStats, generated: list[int], legs: list[_Leg]
    ) -> bool:
        """After a stream ended without error: whether the generation did (else a leg begins or ends)."""
        if not legs:
            return True
        if legs[0].finish is None:  # _stream handed the session off: the leg begins
            stats.legs += 1
            return False
        leg = legs.pop()  # the leg ended: the edge takes the session back, and probes
        self.tuner.observe_leg(len(generated) - leg.start)
        return leg.finish is Finish.STOP or len(generated) >= self._budget(request)

    def _leg_refused(
        self, error: VerifierError, stats: GenerationStats, generated: list[int], legs: list[_Leg]
    ) -> bool:
        """Whether `error` is the verifier refusing a leg before its first token; then the edge sends
        plain steps instead from now on."""
        if not legs or len(generated) != legs[0].start or error.code not in _LEG_REFUSALS:
            return False
        legs.clear()
        self.hand_off = False
        self.tuner.reason = stats.speculation_reason = (
            f"speculation off, in plain steps: the verifier refused a thin session ({error.details})"
        )
        return True

    async def run(
        self, request: GenerationRequest, logprobs: list[TokenLogprob] | None = None
    ) -> tuple[list[int], GenerationStats]:
        """Generates to the end; returns the generated ids and the figures (`logprobs`, when given,
        receives the ids' log-probabilities). Raises VerifierError."""
        stats, generated = GenerationStats(), []
        async for _ in self.generate(request, stats, generated, logprobs):
            pass
        return generated, stats

    def vocab_size(self) -> int:
        """The ids both the target (its model info, asked first) and the draft know."""
        size = self._info.target.vocabulary.size
        return min(size, self.vocabulary.size) if self.vocabulary is not None else size

    def _budget(self, request: GenerationRequest) -> int:
        """The tokens the request may generate on this verifier."""
        max_context = self._info.target.max_context
        return generation_budget(request.max_new_tokens, max_context, len(request.prompt_token_ids))

    async def _stream(
        self,
        request: GenerationRequest,
        stats: GenerationStats,
        generated: list[int],
        logprobs: list,
        legs: list[_Leg],
    ) -> AsyncIterator[list[int]]:
        """One Session stream, from open to finish, or to a hand-off (speculation off: the leg it
        appends to `legs`): the edge's round loop."""
        plan = Planner(request, await self.model_info(), generated, stats, self.tuner, self.hand_off)
        call = self.stub.Session()
        inbox = _Inbox(call, stats, self.tuner)
        try:
            await self._write(call, pb.EdgeMessage(open=self._open_message(request, generated, stats)), stats)
            while not plan.finished:
                verdict = inbox.get_nowait()
                if verdict is None:
                    # No verdict waiting: send what was drafted if no verdict refuted it meanwhile...
                    if (proposal := plan.next_proposal(time.perf_counter())) is not None:
                        message = pb.EdgeMessage(proposal=wire.proposal_to_proto(proposal))
                        await self._write(call, message, stats)
                        continue
                    # ...else draft the next proposal, if the pipeline has room for one...
                    if (job := plan.next_draft()) is not None:
                        if job.handoff:  # speculation off: the verifier decodes the next leg alone
                            legs.append(_Leg(len(generated), len(generated) + job.handoff))
                            break
                        drafted_s = stats.draft_s
                        tokens = await self._draft(job, request, plan.stops, stats)
                        plan.add_draft(job, tokens, stats.draft_s - drafted_s, time.perf_counter())
                        continue
                    # ...else wait for the oldest proposal's verdict.
                    if not plan.in_flight:
                        raise VerifierError(
                            grpc.StatusCode.INTERNAL, "no verdict awaited and nothing to draft"
                        )
                    verdict = await inbox.get(self.timeouts.verdict_s)
                # Timed to its arrival, not to now: the loop may have been drafting when it came.
                new = plan.apply(verdict, inbox.arrived.pop(verdict.round, None))
                if new:
                    if stats.first_token_s is None:
                        stats.first_token_s = time.perf_counter() - stats.started_at
                    generated += new
                    logprobs += verdict.logprobs
                    yield new
            await call.done_writing()
        except BadVerdict as e:
            raise VerifierError(grpc.StatusCode.INTERNAL, f"bad verdict from the verifier: {e}") from None
        except (grpc.aio.AioRpcError, VerifierError) as e:
            error = e if isinstance(e, VerifierError) else VerifierError(e.code(), e.details() or "")
            if _broken_transport(error) or (error.code == grpc.StatusCode.INTERNAL and not inbox.opened):
                await self._raise_open_refusal(request, generated, stats)
                # The verifier accepts this open: the status was the transport failing (a dropped
                # connection, a killed verifier, bytes corrupted in flight), which a resume can cure.
                error = _stream_broke(error)
            raise (error if inbox.opened else _before_open(error)) from None
        finally:
            inbox.close()
            call.cancel()

    async def _thin_stream(
        self,
        request: GenerationRequest,
        stats: GenerationStats,
        generated: list[int],
        logprobs: list,
        leg: _Leg | None = None,
    ) -> AsyncIterator[list[int]]:
        """One thin Session stream: the open, then the verdicts of the rounds the verifier plays itself.
        Each batch of tokens is yielded to the reader first and acknowledged (a Read) once it has taken
        them, every read_ahead / 2 tokens: the verifier decodes no further ahead of the reader than
        its read_ahead. A `leg` (an edge session's, handed off) learns its finish, and its tokens
        count as the verifier's, not as drafts: the edge's acceptance figures stay its draft's."""
        await self.model_info()
        call = self.stub.Session()
        inbox = _Inbox(call, stats, self.tuner)
        try:
            await self._write(call, pb.EdgeMessage(open=self._open_message(request, generated, stats)), stats)
            finish, read = None, None
            while finish is None:
                verdict = await inbox.get(self.timeouts.verdict_s)
                if bad := _bad_thin_verdict(verdict, self._info.target.vocabulary.size, request.top_logprobs):
                    raise VerifierError(grpc.StatusCode.INTERNAL, f"bad verdict from the verifier: {bad}")
                new = list(verdict.thin_committed)
                stats.rounds += 1
                if leg is None:
                    stats.draft_tokens += len(verdict.server_draft_token_ids)
                    stats.accepted_tokens += verdict.accepted
                else:
                    stats.server_tokens += len(new)
                    self.tuner.observe_verify(len(verdict.server_draft_token_ids), verdict.verify_seconds)
                stats.generated_tokens += len(new)
                stats.target_positions = verdict.target_positions
                stats.verify_s += verdict.verify_seconds
                stats.batched_with += verdict.batch_size
                finish = verdict.finish
                if leg is not None:
                    leg.finish = finish
                if new:
                    if stats.first_token_s is None:
                        stats.first_token_s = time.perf_counter() - stats.started_at
                    generated += new
                    logprobs += verdict.logprobs
                    yield new
                if read is None:  # the open's committed length: the verifier counts from there
                    read = verdict.committed_length - len(new)
                if (
                    finish is None
                    and inbox.read_ahead
                    and 2 * (verdict.committed_length - read) >= inbox.read_ahead
                ):
                    read = verdict.committed_length
                    await self._write(call, pb.EdgeMessage(read=pb.Read(committed_length=read)), stats)
            await call.done_writing()
        except grpc.aio.AioRpcError as e:
            raise VerifierError(e.code(), e.details() or "") from None
        finally:
            inbox.close()
            call.cancel()

    async def _raise_open_refusal(
        self, request: GenerationRequest, generated: list[int], stats: GenerationStats
    ) -> None:
        """Raises the verifier's status for this open, if it refuses it.

        The first proposal leaves right behind the open message, without waiting. When the verifier
        refuses the open, that write can race the refusal, and the gRPC core then reports a bare
        INTERNAL for the whole call. A stream with the open message alone gets the real status."""
        call = self.stub.Session(timeout=self.timeouts.call_s)
        try:
            await call.write(pb.EdgeMessage(open=self._open_message(request, generated, stats)))
            await call.read()
        except grpc.aio.AioRpcError as e:
            error = VerifierError(e.code(), e.details() or "")
            raise (_stream_broke(error) if _broken_transport(error) else error) from None
        finally:
            call.cancel()

    async def _draft(
        self, job: DraftJob, request: GenerationRequest, stops: Collection[int], stats: GenerationStats
    ) -> list[int]:
        if job.gamma == 0:  # a plain step: speculation is off (edge_client.adaptive)
            return []
        params = request.sampling
        start = time.perf_counter()
        try:
            executor, prompt_length = self.drafter.executor, len(request.prompt_token_ids)
            matcher = await self._matcher(request)
            extra = {"matcher": matcher} if matcher is not None else {}
            propose = functools.partial(self.drafter.propose, **extra)
            if executor is None:
                return propose(job.base, job.gamma, params, stops, prompt_length)
            return await asyncio.get_running_loop().run_in_executor(
                executor, propose, job.base, job.gamma, params, stops, prompt_length
            )
        finally:
            stats.draft_s += time.perf_counter() - start

    async def _matcher(self, request: GenerationRequest) -> Matcher | None:
        """The draft's matcher of a constrained request, so that it proposes under the verifier's mask;
        None unconstrained, or where the drafter builds none (it then drafts unmasked, and the verifier
        rejects what the constraint refuses). Kept per constraint: a matcher follows whatever sequence
        it is given (it rolls back to where the sequences part), so requests of one constraint share it."""
        build = getattr(self.drafter, "constraint_matcher", None)
        if request.constraint is None or build is None:
            return None
        if request.constraint not in self._matchers:
            eos = (await self.model_info()).target.eos_token_ids
            if self.drafter.executor is None:
                matcher = build(request.constraint, eos)
            else:
                loop = asyncio.get_running_loop()
                matcher = await loop.run_in_executor(self.drafter.executor, build, request.constraint, eos)
            while len(self._matchers) >= MATCHERS_KEPT:
                del self._matchers[next(iter(self._matchers))]
            self._matchers[request.constraint] = matcher
        return self._matchers[request.constraint]

    def _open_message(
        self, request: GenerationRequest, generated: list[int], stats: GenerationStats
    ) -> pb.OpenSession:
        """The open (or resume) message; a resume asks for the numerics the session began with, so it
        never continues on a verifier that could compute other tokens. Raises VerifierError
        INVALID_ARGUMENT for a logit_bias id outside the vocabulary (the drafter would index with it)."""
        if (refusal := logit_bias_refusal(request.sampling, self.vocab_size())) is not None:
            raise VerifierError(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        vocabulary = self.vocabulary
        if vocabulary is None:  # a thin client that sends ids as they are
            return wire.spec_to_proto(request.spec(generated, numerics=stats.numerics))
        spec = request.spec(generated, vocabulary.fingerprint, vocabulary.size, stats.numerics)
        return wire.spec_to_proto(spec)

    @staticmethod
    async def _write(call, message: pb.EdgeMessage, stats: GenerationStats) -> None:
        """Writes to the stream; a stream the verifier already ended raises its status as VerifierError."""
        stats.wire_bytes += message.ByteSize()
        try:
            await call.write(message)
        except asyncio.InvalidStateError:
            raise VerifierError(await call.code(), await call.details() or "") from None


# A verifier's refusals of a thin session that plain steps in an edge session can get past: its policy
# or its load (an older or a stricter verifier), not the request's credentials.
_LEG_REFUSALS = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)

# What the gRPC core (not the verifier) reports when the connection breaks under a write; the
# verifier's own INTERNAL statuses say "verifier error: ...".
_CORE_INTERNAL = "Internal error from Core"
# And when the connection's bytes go bad (TLS fails a record's check: TSI_DATA_CORRUPTED) or it is torn
# down under a stream; the verifier never answers UNKNOWN itself.
_STREAM_REMOVED = "Stream removed"


def _as_verifier_error(error: VerifierError | grpc.aio.AioRpcError) -> VerifierError:
    """An error of a stream as the generation loop takes it; an AioRpcError is the model info's, asked
    before an open (_before_open)."""
    if isinstance(error, VerifierError):
        return error
    return _before_open(VerifierError(error.code(), error.details() or ""))


def _before_open(error: VerifierError) -> VerifierError:
    """An error before a session opened as the generation loop takes it: a deadline missed then (the
    model info's or the open's: a frozen or overloaded verifier) is the UNAVAILABLE the edge resumes
    after, within its resume budget, as after a broken stream."""
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return VerifierError(grpc.StatusCode.UNAVAILABLE, f"no answer in time: {error.details}")
    return error


def logit_bias_refusal(sampling, vocab_size: int) -> str | None:
    """What is wrong with the logit_bias of `sampling` (SamplingParams) on a vocabulary of `vocab_size`
    ids, or None: an id outside it would index past the logits."""
    bad = [token for token, _ in sampling.logit_bias if not 0 <= token < vocab_size]
    if bad:
        return f"logit_bias names token {bad[0]}, outside the vocabulary of {vocab_size} ids"
    return None


def _stream_broke(error: VerifierError) -> VerifierError:
    """A transport failure as the UNAVAILABLE the edge resumes after."""
    return VerifierError(grpc.StatusCode.UNAVAILABLE, f"the stream broke: {error}")


def _broken_transport(error: VerifierError) -> bool:
    """The gRPC core's own status for a connection that broke, not one the verifier chose."""
    return (error.code == grpc.StatusCode.INTERNAL and error.details == _CORE_INTERNAL) or (
        error.code == grpc.StatusCode.UNKNOWN and error.details.startswith(_STREAM_REMOVED)
    )


def _bad_thin_verdict(verdict: Verdict, vocab_size: int, top_logprobs: int | None) -> str | None:
    """What is wrong with a thin session's verdict (ids outside the vocabulary, no progress, logprobs
    not as asked), or None."""
    ids = verdict.thin_committed
    if any(not 0 <= t < vocab_size for t in ids) or verdict.accepted > len(verdict.server_draft_token_ids):
        return f"round {verdict.round}: ids outside the vocabulary of {vocab_size}"
    if not ids and verdict.finish is None:
        return f"round {verdict.round} commits nothing and does not finish"
    try:
        check_logprobs(verdict, len(ids), top_logprobs, vocab_size)
    except BadVerdict as e:
        return str(e)
    return None


class _Inbox:
    """The verdicts of a stream as they arrive, read by a task of its own; then the stream's end or
    failure, as a VerifierError."""

    def __init__(self, call, stats: GenerationStats, tuner: Tuner):
        self.opened = False  # the verifier answered the open message
        self.tuner = tuner  # told the verifier's forward costs the open carries
        self.read_ahead = 0  # a thin session: tokens the verifier decodes past the last Read (0: no Reads)
        self.arrived: dict[int, float] = {}  # round -> when its verdict arrived (perf_counter)
        self.stats = stats
        self._queue: asyncio.Queue[Verdict | VerifierError] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read(call))

    def get_nowait(self) -> Verdict | None:
        """The next verdict if one has arrived, else None; raises the stream's error in its turn."""
        return None if self._queue.empty() else self._take(self._queue.get_nowait())

    async def get(self, timeout_s: float | None = None) -> Verdict:
        """The next verdict; raises VerifierError UNAVAILABLE when none comes within `timeout_s` (a hung
        verifier: the generation resumes elsewhere)."""
        try:
            item = await within(self._queue.get(), timeout_s)
        except TimeoutError:
            raise VerifierError(
                grpc.StatusCode.UNAVAILABLE, f"no verdict from the verifier within {timeout_s:g} s"
            ) from None
        return self._take(item)

    def close(self) -> None:
        self._reader.cancel()

    @staticmethod
    def _take(item: Verdict | VerifierError) -> Verdict:
        if isinstance(item, VerifierError):
            raise item
        return item

    async def _read(self, call) -> None:
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise VerifierError(grpc.StatusCode.UNAVAILABLE, "the verifier closed the session early")
                kind = message.WhichOneof("kind")
                if kind == "verdict":
                    self.stats.wire_bytes += message.verdict.ByteSize()
                    verdict = wire.verdict_from_proto(message.verdict)
                    self.arrived[verdict.round] = time.perf_counter()
                    self._queue.put_nowait(verdict)
                elif kind == "opened":
                    self.opened = True
                    self.read_ahead = message.opened.read_ahead
                    self.stats.reused_positions = message.opened.reused_positions
                    self.stats.numerics = self.stats.numerics or message.opened.numerics
                    self.tuner.observe_server_costs(message.opened.forward_seconds)
        except grpc.aio.AioRpcError as e:
            self._queue.put_nowait(VerifierError(e.code(), e.details() or ""))
        except VerifierError as e:
            self._queue.put_nowait(e)
