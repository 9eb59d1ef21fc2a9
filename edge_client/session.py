"""The edge's transport: runs a generation's planner over one Session stream to the verifier.

The open message and the first proposal leave back to back, so the first round costs one round
trip; without pipelining every later round costs one more (see `edge_client.planner` for what
pipelining sends). Committed tokens are kept here, so a broken stream can be resumed elsewhere with
them. The stream's incoming side, verdicts and failures, is `edge_client.inbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

import grpc

from draftwire import wire
from draftwire.contract import (
    Drafting,
    Finish,
    ModelInfo,
    TokenLogprob,
    Verdict,
    generation_budget,
)
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire.vocab import Vocabulary
from edge_client.adaptive import Tuner
from edge_client.inbox import (
    Inbox,
    VerifierError,
    as_verifier_error,
    bad_thin_verdict,
    before_open,
    broken_transport,
    stream_broke,
)
from edge_client.planner import BadVerdict, DraftJob, GenerationRequest, GenerationStats, Planner
from edge_client.proposer import Drafter, Proposer

__all__ = [
    "Drafter",
    "EdgeSession",
    "Generation",
    "GenerationRequest",
    "GenerationStats",
    "Timeouts",
    "VerifierError",
]


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
class Leg:
    """Speculation off, handed to the verifier: it decodes the session alone, in a thin session, from
    `start` to `end` generated tokens (or to a finish), and then the edge takes it back."""

    start: int
    end: int
    finish: Finish | None = None  # how the leg's thin session ended

    def request(self, request: GenerationRequest) -> GenerationRequest:
        """The leg's thin session: the request's, the verifier drafting by prompt lookup, to `end`."""
        return dataclasses.replace(request, drafting=Drafting.NGRAM, max_new_tokens=self.end, handoff=True)


@dataclass
class Generation:
    """One generation under way, kept across its streams (resumes and legs): what it asks, its
    figures, and what it has committed."""

    request: GenerationRequest
    stats: GenerationStats = field(default_factory=GenerationStats)
    generated: list[int] = field(default_factory=list)  # every committed token: where a resume starts
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when request.top_logprobs is set
    leg: Leg | None = None  # the hand-off under way, if any

    def commit(self, new: list[int], logprobs: Sequence[TokenLogprob]) -> None:
        """Tokens a verdict committed, and their logprobs."""
        if self.stats.first_token_s is None:
            self.stats.first_token_s = time.perf_counter() - self.stats.started_at
            self.stats.first_tokens = len(new)
        self.generated += new
        self.logprobs += logprobs


@dataclass
class Resumes:
    """A generation's re-opens after UNAVAILABLE: the streak without progress, within its budget."""

    timeouts: Timeouts
    started: int  # tokens committed when the call began
    streak: int = 0  # re-opens since the last progress
    since: float = 0.0  # when the streak began
    progress: int = 0  # tokens committed then

    def wait(self, error: VerifierError, committed: int) -> float:
        """Seconds to wait before the next re-open, `committed` tokens in; raises VerifierError (the
        code of `error`, saying so) when the resume budget is spent."""
        now = time.perf_counter()
        if committed > self.progress or self.streak == 0:
            self.streak, self.since, self.progress = 0, now, committed
        self.streak += 1
        wait = self.timeouts.backoff(self.streak)
        if now - self.since + wait > self.timeouts.budget(committed > self.started):
            raise VerifierError(
                error.code,
                f"gave up after {self.streak - 1} resumes in {now - self.since:.1f} s "
                f"({committed} tokens committed): {error.details}",
            ) from None
        return wait


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
        self.proposer = Proposer(drafter) if drafter is not None else None
        self.vocabulary = drafter.vocabulary if drafter is not None else vocabulary
        self.timeouts = timeouts
        # Adaptive requests' γ and depth: its estimates outlive a generation (same drafter, same link).
        self.tuner = Tuner()
        self._info: ModelInfo | None = None
        self.hand_off = True  # False once the verifier refused a leg

    async def model_info(self) -> ModelInfo:
        """What the verifier serves (asked once per EdgeSession, until forget_model_info)."""
        if self._info is None:
            reply = await self.stub.GetModelInfo(pb.ModelInfoRequest(), timeout=self.timeouts.call_s)
            self._info = wire.model_info_from_proto(reply)
        return self._info

    def forget_model_info(self) -> None:
        """Asks the verifier what it serves again at the next model_info (it may have been replaced)."""
        self._info = None

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
        gen = Generation(request)
        gen.stats = stats if stats is not None else gen.stats
        gen.generated = generated if generated is not None else gen.generated
        gen.logprobs = logprobs if logprobs is not None else gen.logprobs
        start = gen.stats.started_at = time.perf_counter()
        resumes = Resumes(self.timeouts, started=len(gen.generated), progress=len(gen.generated))
        try:
            while True:
                try:
                    # Closed at once when the caller stops reading: the stream is cancelled on the verifier.
                    async with contextlib.aclosing(self._next_stream(gen)) as stream:
                        async for new in stream:
                            yield new
                    if self._finished(gen):
                        return
                except (VerifierError, grpc.aio.AioRpcError) as caught:
                    e = as_verifier_error(caught)
                    if self._leg_refused(e, gen):
                        continue
                    if e.code != grpc.StatusCode.UNAVAILABLE:
                        raise e from None
                    wait = resumes.wait(e, len(gen.generated))
                    gen.stats.resumes += 1
                    await asyncio.sleep(wait)
        finally:
            gen.stats.wall_s = time.perf_counter() - start

    def _next_stream(self, gen: Generation) -> AsyncIterator[list[int]]:
        """The stream that goes on with the generation: a thin request's, a leg's, or the edge's."""
        if gen.request.spec().thin:
            return self._thin_stream(gen)
        if gen.leg is not None:
            return self._thin_stream(gen, gen.leg)
        return self._stream(gen)

    def _finished(self, gen: Generation) -> bool:
        """After a stream ended without error: whether the generation did (else a leg begins or ends)."""
        leg = gen.leg
        if leg is None:
            return True
        if leg.finish is None:  # _stream handed the session off: the leg begins
            gen.stats.legs += 1
            return False
        gen.leg = None  # the leg ended: the edge takes the session back, and probes
        self.tuner.observe_leg(len(gen.generated) - leg.start)
        return leg.finish is Finish.STOP or len(gen.generated) >= self._budget(gen.request)

    def _leg_refused(self, error: VerifierError, gen: Generation) -> bool:
        """Whether `error` is the verifier refusing a leg before its first token; then the edge sends
        plain steps instead from now on."""
        leg = gen.leg
        if leg is None or len(gen.generated) != leg.start or error.code not in LEG_REFUSALS:
            return False
        gen.leg = None
        self.hand_off = False
        self.tuner.reason = gen.stats.speculation_reason = (
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

    async def _stream(self, gen: Generation) -> AsyncIterator[list[int]]:
        """One Session stream, from open to finish, or to a hand-off (speculation off: the leg it sets
        in `gen`): the edge's round loop."""
        request, stats = gen.request, gen.stats
        plan = Planner(request, await self.model_info(), gen.generated, stats, self.tuner, self.hand_off)
        call = self.stub.Session()
        inbox = Inbox(call, stats, self.tuner)
        try:
            await self._write(call, pb.EdgeMessage(open=self._open_message(request, gen)), stats)
            while not plan.finished:
                verdict = inbox.get_nowait()
                if verdict is None:
                    verdict = await self._send_draft_or_wait(plan, gen, call, inbox)
                if verdict is None:
                    if gen.leg is not None:  # speculation off: the verifier decodes the next leg alone
                        break
                    continue
                # Timed to its arrival, not to now: the loop may have been drafting when it came.
                new = plan.apply(verdict, inbox.arrived.pop(verdict.round, None))
                if new:
                    gen.commit(new, verdict.logprobs)
                    yield new
            await call.done_writing()
        except BadVerdict as e:
            raise VerifierError(grpc.StatusCode.INTERNAL, f"bad verdict from the verifier: {e}") from None
        except (grpc.aio.AioRpcError, VerifierError) as e:
            raise await self._stream_error(e, gen, inbox) from None
        finally:
            inbox.close()
            call.cancel()

    async def _send_draft_or_wait(self, plan: Planner, gen: Generation, call, inbox: Inbox) -> Verdict | None:
        """With no verdict waiting: sends what was drafted if no verdict refuted it meanwhile, else
        drafts the next proposal if the pipeline has room for one (or hands the session off, setting
        gen.leg), else waits for the oldest proposal's verdict. None: nothing to apply yet."""
        stats = gen.stats
        if (proposal := plan.next_proposal(time.perf_counter())) is not None:
            await self._write(call, pb.EdgeMessage(proposal=wire.proposal_to_proto(proposal)), stats)
            return None
        if (job := plan.next_draft()) is not None:
            if job.handoff:
                gen.leg = Leg(len(gen.generated), len(gen.generated) + job.handoff)
                return None
            drafted_s = stats.draft_s
            tokens = await self._draft(job, gen.request, plan.stops, stats)
            plan.add_draft(job, tokens, stats.draft_s - drafted_s, time.perf_counter())
            return None
        if not plan.in_flight:
            raise VerifierError(grpc.StatusCode.INTERNAL, "no verdict awaited and nothing to draft")
        return await inbox.get(self.timeouts.verdict_s)

    async def _stream_error(
        self, e: grpc.aio.AioRpcError | VerifierError, gen: Generation, inbox: Inbox
    ) -> VerifierError:
        """The error an edge stream that failed ends with; raises the verifier's refusal of the open
        instead, where the failure hid one."""
        error = e if isinstance(e, VerifierError) else VerifierError(e.code(), e.details() or "")
        if broken_transport(error) or (error.code == grpc.StatusCode.INTERNAL and not inbox.opened):
            await self._raise_open_refusal(gen.request, gen)
            # The verifier accepts this open: the status was the transport failing (a dropped
            # connection, a killed verifier, bytes corrupted in flight), which a resume can cure.
            error = stream_broke(error)
        return error if inbox.opened else before_open(error)

    async def _thin_stream(self, gen: Generation, leg: Leg | None = None) -> AsyncIterator[list[int]]:
        """One thin Session stream: the open, then the verdicts of the rounds the verifier plays itself.
        Each batch of tokens is yielded to the reader first and acknowledged (a Read) once it has taken
        them, every read_ahead / 2 tokens: the verifier decodes no further ahead of the reader than
        its read_ahead. A `leg` (an edge session's, handed off) learns its finish, and its tokens
        count as the verifier's, not as drafts: the edge's acceptance figures stay its draft's."""
        request = leg.request(gen.request) if leg is not None else gen.request
        stats = gen.stats
        await self.model_info()
        call = self.stub.Session()
        inbox = Inbox(call, stats, self.tuner)
        try:
            await self._write(call, pb.EdgeMessage(open=self._open_message(request, gen)), stats)
            finish, read = None, None
            while finish is None:
                verdict = await inbox.get(self.timeouts.verdict_s)
                if bad := bad_thin_verdict(verdict, self._info.target.vocabulary.size, request.top_logprobs):
                    raise VerifierError(grpc.StatusCode.INTERNAL, f"bad verdict from the verifier: {bad}")
                new = list(verdict.thin_committed)
                self._count_thin(verdict, len(new), stats, leg, request.drafting)
                finish = verdict.finish
                if leg is not None:
                    leg.finish = finish
                if new:
                    gen.commit(new, verdict.logprobs)
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

    def _count_thin(
        self, verdict: Verdict, committed: int, stats: GenerationStats, leg: Leg | None, drafting: Drafting
    ) -> None:
        """A thin verdict's figures; a leg's tokens count as the verifier's, and its forward feeds the
        tuner. The leading server drafts a constraint forced (Verdict.server_forced_tokens; all of them
        where the verifier drafts nothing) count as forced, not drafted."""
        if leg is None:
            drafted = len(verdict.server_draft_token_ids)
            forced = drafted if drafting is Drafting.NONE else min(verdict.server_forced_tokens, drafted)
            accepted = max(0, verdict.accepted - forced)
            stats.verified(verdict, drafted - forced, accepted, committed, forced=verdict.accepted - accepted)
        else:
            stats.verified(verdict, 0, 0, committed)
            stats.server_tokens += committed
            self.tuner.observe_verify(len(verdict.server_draft_token_ids), verdict.verify_seconds)

    async def _raise_open_refusal(self, request: GenerationRequest, gen: Generation) -> None:
        """Raises the verifier's status for this open, if it refuses it.

        The first proposal leaves right behind the open message, without waiting. When the verifier
        refuses the open, that write can race the refusal, and the gRPC core then reports a bare
        INTERNAL for the whole call. A stream with the open message alone gets the real status."""
        call = self.stub.Session(timeout=self.timeouts.call_s)
        try:
            await call.write(pb.EdgeMessage(open=self._open_message(request, gen)))
            await call.read()
        except grpc.aio.AioRpcError as e:
            error = VerifierError(e.code(), e.details() or "")
            raise (stream_broke(error) if broken_transport(error) else error) from None
        finally:
            call.cancel()

    async def _draft(
        self, job: DraftJob, request: GenerationRequest, stops: Collection[int], stats: GenerationStats
    ) -> list[int]:
        if job.gamma == 0:  # a plain step: speculation is off (edge_client.adaptive)
            return []
        start = time.perf_counter()
        try:
            return await self.proposer.propose(job, request, stops, self._info.target.eos_token_ids)
        finally:
            stats.draft_s += time.perf_counter() - start

    def _open_message(self, request: GenerationRequest, gen: Generation) -> pb.OpenSession:
        """The open (or resume) message; a resume asks for the numerics the session began with, so it
        never continues on a verifier that could compute other tokens. Raises VerifierError
        INVALID_ARGUMENT for a logit_bias id outside the vocabulary (the drafter would index with it)."""
        if (refusal := logit_bias_refusal(request.sampling, self.vocab_size())) is not None:
            raise VerifierError(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        vocabulary = self.vocabulary
        if vocabulary is None:  # a thin client that sends ids as they are
            return wire.spec_to_proto(request.spec(gen.generated, numerics=gen.stats.numerics))
        spec = request.spec(gen.generated, vocabulary.fingerprint, vocabulary.size, gen.stats.numerics)
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
LEG_REFUSALS = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def logit_bias_refusal(sampling, vocab_size: int) -> str | None:
    """What is wrong with the logit_bias of `sampling` (SamplingParams) on a vocabulary of `vocab_size`
    ids, or None: an id outside it would index past the logits."""
    bad = [token for token, _ in sampling.logit_bias if not 0 <= token < vocab_size]
    if bad:
        return f"logit_bias names token {bad[0]}, outside the vocabulary of {vocab_size} ids"
    return None
