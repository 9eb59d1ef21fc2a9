"""The edge's planner: what to draft and send next, and what each verdict commits. Pure: no gRPC, no I/O.

Without pipelining the planner drafts, sends, and waits for the verdict. With `pipeline = n`, up to n
proposals leave ahead of their verdicts, each drafted on the assumption that the one before it is
accepted whole and that the target's bonus token is the draft's own next choice (sent as the assumed
token, so that the verifier can tell). While the assumptions hold, round trips and drafting overlap
the verification; when one fails, the verifier answers the proposals built on it as stale, at no cost
to the target, and the planner drafts again from what was committed.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from draftwire.contract import (
    Constraint,
    Drafting,
    ModelInfo,
    Proposal,
    SamplingParams,
    SessionSpec,
    Verdict,
    generation_budget,
    proposed_among,
    stop_set,
)
from edge_client.adaptive import Tuner


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 64  # 0: until the target's context is full
    gamma: int | None = 4  # draft tokens per proposal; None: chosen online (edge_client.adaptive)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    pipeline: int | None = 0  # proposals sent ahead of their verdicts; 0 waits for each; None: chosen online
    drafting: Drafting = Drafting.EDGE  # NONE or NGRAM: a thin session, the verifier decodes it
    top_logprobs: int | None = None  # None: no logprobs; k: each token's and the k most likely (k <= 20)
    handoff: bool = False  # a leg: a thin session EdgeSession opens while speculation is off
    constraint: Constraint | None = None  # structured output (draftwire/grammar.py); None: unconstrained

    @property
    def adaptive(self) -> bool:
        """Whether γ or the pipeline depth is left to a Tuner."""
        return self.gamma is None or self.pipeline is None

    def spec(
        self, generated: Sequence[int] = (), fingerprint: str = "", vocab_size: int = 0, numerics: str = ""
    ) -> SessionSpec:
        """The session to open for this request, resuming after `generated` tokens on a verifier of
        `numerics` (the identity the session began with; "" any)."""
        return SessionSpec(
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            generated_token_ids=tuple(generated),
            tokenizer_fingerprint=fingerprint,
            vocab_size=vocab_size,
            drafting=self.drafting,
            numerics=numerics,
            top_logprobs=self.top_logprobs,
            handoff=self.handoff,
            constraint=self.constraint,
        )


@dataclass
class GenerationStats:
    rounds: int = 0  # verdicts that verified something
    stale_rounds: int = 0  # pipelined proposals that came back stale
    sent_ahead: int = 0  # proposals sent before the verdict of the one before them
    plain_steps: int = 0  # verified rounds of no draft token: speculation off (edge_client.adaptive)
    server_tokens: int = 0  # decoded by the verifier alone: speculation off, handed off in legs
    legs: int = 0  # such hand-offs
    speculation: str = "on"  # the tuner's state when the generation ended: on, off or probing
    speculation_reason: str = ""  # why it last changed (empty: it never did)
    step_s: float = 0.0  # the target's one-step time: its forward over one position, from the verdicts
    drafts: int = 0  # drafter calls (a proposal each, sent or refuted before it left)
    # Drafts begun with no live proposal in flight: the verifier has nothing of this session's to
    # verify meanwhile. Every draft unpipelined; pipelined, the first and each after a miss.
    restarts: int = 0
    draft_tokens: int = 0  # proposed by the draft model in verified rounds (forced ones apart)
    accepted_tokens: int = 0  # proposed and accepted
    forced_tokens: int = 0  # committed as a constraint forced them: sent with no draft step (DraftTokens)
    generated_tokens: int = 0  # committed by verdicts (accepted plus target tokens)
    target_positions: int = 0  # the verifier's figure for this session, prefill included
    reused_positions: int = 0  # prefill positions the verifier took from a kept cache (last open)
    first_token_s: float | None = None  # from the start to the first committed token
    first_tokens: int = 0  # committed with it, by the first verdict (a speculative one commits several)
    started_at: float = 0.0  # perf_counter() when the generation started
    verify_s: float = 0.0  # the verifier's forward passes for this generation's rounds, as it reports
    batched_with: int = 0  # sum over rounds of the sessions that shared the round's forward pass
    wall_s: float = 0.0
    draft_s: float = 0.0  # time spent drafting on the edge
    round_s: list[float] = field(default_factory=list)  # send to the verdict's arrival, per verified round
    resumes: int = 0  # streams re-opened with the committed tokens after UNAVAILABLE
    wire_bytes: int = 0  # serialized protobuf payload sent and received (no HTTP/2 framing)
    gamma_cap: int = 0  # the γ cap the last verdict advertised (0: none); min_gamma_cap the lowest
    min_gamma_cap: int = 0
    numerics: str = ""  # the verifier's numerics identity from the first open; resumes ask for it

    def verified(
        self, verdict: Verdict, draft_tokens: int, accepted: int, committed: int, forced: int = 0
    ) -> None:
        """A verdict that verified something: its round, tokens and the verifier's figures."""
        self.rounds += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        self.forced_tokens += forced
        self.generated_tokens += committed
        self.target_positions = verdict.target_positions
        self.verify_s += verdict.verify_seconds
        self.batched_with += verdict.batch_size

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def speculation_gain(self) -> float:
        """Tokens/s after the first verdict over the target alone's at its one-step time (0: unknown):
        below 1, this request would have been faster without speculation."""
        return self.decode_rate * self.step_s

    @property
    def after_first_verdict(self) -> tuple[int, float]:
        """The tokens committed after the first verdict, and the seconds after it: the rounds alone,
        without the prefill and the first round (which commits one token alone, or several under
        speculation), which benches sum over replies."""
        return self.generated_tokens - max(self.first_tokens, 1), self.wall_s - (self.first_token_s or 0.0)

    @property
    def decode_rate(self) -> float:
        """Tokens/s after the first verdict (after_first_verdict); 0 where nothing followed it."""
        later, after_first = self.after_first_verdict
        return later / after_first if after_first > 0 and later > 0 else 0.0

    def as_json(self) -> dict:
        """The figures `generate --json` and `reference --json` print."""
        return {
            "rounds": self.rounds,
            "stale_rounds": self.stale_rounds,
            "sent_ahead": self.sent_ahead,
            "plain_steps": self.plain_steps,
            "server_tokens": self.server_tokens,
            "handoffs": self.legs,
            "speculation_gain": self.speculation_gain,
            "speculation": self.speculation,
            "speculation_reason": self.speculation_reason,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_tokens": self.forced_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "wall_s": self.wall_s,
            "gamma_cap": self.gamma_cap,
            "min_gamma_cap": self.min_gamma_cap,
        }


class BadVerdict(Exception):
    """A verdict that does not answer the proposal it should: a fault of the verifier."""


class DraftTokens(list):
    """A drafter's tokens, and the indexes of those a constraint forced (`forced`): where the grammar
    allows one token alone (a JSON key, a brace), the drafter appends it with no draft step. The draft
    model did not propose them, so the acceptance and the tuner count only the others, as the field
    counts draft tokens; the generation's stats count the forced ones apart. A drafter that knows no
    constraint returns a plain list: none forced."""

    def __init__(self, tokens: Sequence[int] = (), forced: Sequence[int] = ()):
        super().__init__(tokens)
        self.forced = frozenset(i for i in forced if 0 <= i < len(self))


def forced_of(tokens: Sequence[int]) -> frozenset[int]:
    """The indexes of `tokens` a constraint forced (DraftTokens), none for a plain list."""
    return getattr(tokens, "forced", frozenset())


@dataclass
class InFlight:
    """A drafted proposal, then on the wire until its verdict."""

    prefix: list[int]  # the committed sequence it builds on, assumed tokens included
    assumed: list[int]  # the last tokens of prefix, not yet committed when it was drafted
    draft: list[int]
    final: bool  # its verdict may finish the session: nothing is drafted on top of it
    round: int = 0  # set when sent
    queued: bool = False  # sent while others were in flight: it may wait behind their forwards
    opening: bool = False  # sent before the stream's first verdict: it may wait for the open's prefill
    sent_s: float | None = None  # when it was sent (the transport's clock), if the transport says
    ahead: bool = False  # the drafter drafted while it was in flight: verified beside drafting
    forced: tuple[int, ...] = ()  # increasing indexes of draft that a constraint forced (DraftTokens)

    def proposed(self, n: int) -> int:
        """How many of the first `n` draft tokens the draft model proposed (not forced)."""
        return proposed_among(self.forced, n)

    def builds_on(self, committed: Sequence[int]) -> bool:
        """Whether it is still live: what it assumes agrees with the `committed` sequence."""
        return self.prefix[: len(committed)] == list(committed)


@dataclass(frozen=True)
class DraftJob:
    """What to draft next: `gamma` tokens after `base`; when `assumes`, the first of them is the guess
    of the bonus token of the proposal before, sent as the assumed token, not as a draft token."""

    base: list[int]
    gamma: int
    assumes: bool
    # Speculation off, decoding handed to the verifier (edge_client.adaptive): the tokens it decodes
    # alone, in a thin session, before the edge takes the session back. Nothing is drafted or sent here.
    handoff: int = 0
    # The most tokens the drafter may return (0: `gamma`): the verifier's cap on a proposal, which
    # tokens a constraint forces fill past γ at no draft step (LlamaDrafter.propose).
    most: int = 0


class Planner:
    """One session's plan on the edge, fed verdicts by the transport."""

    def __init__(
        self,
        request: GenerationRequest,
        info: ModelInfo,
        generated: Sequence[int] = (),
        stats: GenerationStats | None = None,
        tuner: Tuner | None = None,
        hand_off: bool = False,
    ):
        """`tuner`: where an adaptive request's γ and depth come from (one is made when None). Every
        request's verdicts teach it, a fixed one's too: the estimates then hold for whatever request
        follows, and show what the model predicts for a fixed setting. `hand_off`: the transport can
        hand the session to the verifier to decode alone (DraftJob.handoff) when speculation is off."""
        self.request = request
        self.tuner = tuner or Tuner()
        self.stats = stats if stats is not None else GenerationStats()
        self.committed = [*request.prompt_token_ids, *generated]  # prompt + generated
        self.stops = stop_set(request.stop_token_ids, request.ignore_eos, info.target.eos_token_ids)
        self.budget = generation_budget(request.max_new_tokens, info.target.max_context, self._prompt_length)
        self._verifier_max_gamma = info.max_gamma
        self.max_gamma = info.max_gamma  # the verifier's limit; then its cap under load (Verdict.gamma_cap)
        self.vocab_size = info.target.vocabulary.size  # a verdict's ids must be below it
        self._plain_steps = info.plain_steps  # the verifier takes proposals of no draft token
        edge = request.drafting is Drafting.EDGE
        allowed = hand_off and self.tuner.config.hand_off
        self._hand_off = allowed and info.thin_sessions and info.plain_steps and edge
        self.in_flight: collections.deque[InFlight] = collections.deque()
        self.drafted: InFlight | None = None  # drafted, sent unless a verdict refutes it first
        self.finished = False
        self._blocked = -1  # a base length whose guess was a stop token: wait for verdicts there
        self._first_draft = True  # the stream's first drafter call, which also feeds it the prompt
        self._answered = False  # a verdict came back on this stream
        self._progress_from: float | None = None  # when the last verdict that committed arrived
        # (start, end) of recent drafter calls on the transport's clock, while it says when (add_draft's
        # `now`): how much of each forward the drafter spent drafting beside it (apply).
        self._drafting: collections.deque[tuple[float, float]] = collections.deque(maxlen=64)
        self._draft_times = False  # add_draft was ever told `now`: the record above speaks, even when empty
        self._rounds = itertools.count(1)

    @property
    def _prompt_length(self) -> int:
        return len(self.request.prompt_token_ids)

    def next_draft(self) -> DraftJob | None:
        """What to draft next, or None to wait for a verdict. A proposal in flight is live while the
        committed sequence agrees with what it assumed; the next one builds on the last live one."""
        if self.drafted is not None or self.finished:
            return None
        live = [s for s in self.in_flight if s.builds_on(self.committed)]
        chosen, depth = self.setting()
        if not live:
            gamma = self._gamma(len(self.committed), chosen)
            if gamma is None:
                return None
            self.stats.restarts += gamma > 0
            if gamma == 0 and self._hand_off:  # speculation off: the verifier decodes the next leg
                left = self.budget - (len(self.committed) - self._prompt_length)
                return DraftJob(list(self.committed), 0, False, min(self.tuner.leg_tokens(), left))
            # γ 0: a plain step, nothing to draft
            return DraftJob(list(self.committed), gamma, False, most=max(gamma, self.max_gamma))
        last = live[-1]
        base = [*last.prefix, *last.draft]
        if len(live) > depth or last.final or self._blocked == len(base):
            return None
        gamma = self._gamma(len(base) + 1, chosen)
        if not gamma:
            return None
        for sent in self.in_flight:
            sent.ahead = True
        # The guess of the bonus is sent as assumed, not as a draft token: the cap is one more.
        return DraftJob(base, gamma + 1, True, most=max(gamma, self.max_gamma) + 1)

    def setting(self) -> tuple[int, int]:
        """The (γ, pipeline depth) to plan with now: the request's, or the tuner's for what it leaves open."""
        if not self.request.adaptive:
            return self.request.gamma, self.request.pipeline
        chosen = self.tuner.choose(
            self.request.gamma, self.request.pipeline, self.max_gamma, self._plain_steps, self._hand_off
        )
        self.stats.speculation, self.stats.speculation_reason = self.tuner.state, self.tuner.reason
        return chosen

    def add_draft(
        self, job: DraftJob, tokens: list[int], seconds: float | None = None, now: float | None = None
    ) -> None:
        """Takes the drafter's tokens for `job`; a guess that is a stop token is not sent (nothing
        follows a stop), and the planner waits for verdicts at that base instead.

        `seconds`: how long the drafter took, for the tuner; the first call is not counted, as it also
        fed the drafter the prompt (or a resume's committed tokens), a prefill that would teach the tuner
        that drafts cost the same whatever their length. `now`: when the drafter finished, on the clock
        that apply's `arrived` uses."""
        if seconds is not None and now is not None:
            self._drafting.append((now - seconds, now))
            self._draft_times = True
        if job.gamma == 0:  # a plain step: the drafter's next call catches up on what it did not see
            self._first_draft = True
            self.drafted = InFlight(list(job.base), [], [], self._final(job.base, []))
            return
        forced = forced_of(tokens)
        if seconds is not None and not self._first_draft:
            self.tuner.observe_draft(len(tokens) - len(forced), seconds, ahead=job.assumes)
        self._first_draft = False
        self.stats.drafts += 1
        assumed, draft = (tokens[:1], tokens[1:]) if job.assumes else ([], tokens)
        if not draft or any(t in self.stops for t in assumed):
            self._blocked = len(job.base)
            return
        prefix = [*job.base, *assumed]
        forced = tuple(sorted(i - len(assumed) for i in forced if i >= len(assumed)))  # draft's indexes
        self.drafted = InFlight(prefix, assumed, draft, self._final(prefix, draft), forced=forced)

    def next_proposal(self, now: float | None = None) -> Proposal | None:
        """The drafted proposal, numbered and counted in flight, if it still builds on the committed
        sequence; a drafted proposal that a verdict refuted meanwhile is dropped. `now`: the time it is
        sent, on the clock that apply's `arrived` uses."""
        drafted, self.drafted = self.drafted, None
        if drafted is None or not drafted.builds_on(self.committed):
            return None
        drafted.round = next(self._rounds)
        drafted.queued, drafted.sent_s = bool(self.in_flight), now
        drafted.opening = not self._answered
        self.stats.sent_ahead += drafted.queued
        self.in_flight.append(drafted)
        draft, assumed = tuple(drafted.draft), tuple(drafted.assumed)
        return Proposal(drafted.round, len(drafted.prefix), draft, assumed, drafted.forced)

    def apply(self, verdict: Verdict, arrived: float | None = None) -> list[int]:
        """Commits the verdict of the oldest proposal in flight; returns the tokens it adds.
        `arrived`: when the verdict arrived (not when the transport, maybe busy drafting, reads it):
        with the proposal's send, the round's time, for the stats and the tuner's round trip.

        Raises BadVerdict when it does not answer that proposal (see check_verdict).
        """
        if not self.in_flight:
            raise BadVerdict(f"verdict for round {verdict.round} with no proposal in flight")
        sent = self.in_flight.popleft()
        self._answered = True
        check_verdict(verdict, sent, self.committed, self.vocab_size)
        if verdict.gamma_cap:  # the verifier's cap under load: the next drafts obey it
            self.max_gamma = min(verdict.gamma_cap, self._verifier_max_gamma)
            self.stats.gamma_cap = verdict.gamma_cap
            self.stats.min_gamma_cap = min(self.stats.min_gamma_cap or verdict.gamma_cap, verdict.gamma_cap)
        if verdict.stale:
            self.stats.stale_rounds += 1
            return []
        new = [*sent.draft[: verdict.accepted], *verdict.committed_token_ids]
        check_logprobs(verdict, len(new), self.request.top_logprobs, self.vocab_size)
        # The draft model's tokens alone: a round's forced tokens are neither proposed nor judged by it.
        # Only a finish refuses a forced token (the target's mask allows nothing else), so the position
        # after the accepted ones is not judged there either.
        proposed, accepted = sent.proposed(len(sent.draft)), sent.proposed(verdict.accepted)
        cut = verdict.finish is not None or verdict.accepted in sent.forced
        if proposed or not sent.draft:  # a round of forced tokens alone teaches the tuner nothing
            self.tuner.observe_verdict(proposed, accepted, cut=cut)
        beside = self._beside(sent, verdict.verify_seconds, arrived)
        self.tuner.observe_verify(len(sent.draft), verdict.verify_seconds, beside)
        self.stats.step_s = self.tuner.step_s()
        if arrived is not None and sent.sent_s is not None:
            self.stats.round_s.append(arrived - sent.sent_s)
            # Proposals sent before the stream's first verdict came back waited for the open's prefill
            # (a whole prompt, unless a kept cache holds it), which no round trip includes: they teach
            # the tuner nothing. Counted, a cold prompt's prefill of a second or two set a new tuner's
            # estimate to that, and moved a tuner's by a tenth of it at every generation's start.
            if not sent.opening:
                self.tuner.observe_round(self.stats.round_s[-1], verdict.verify_seconds, sent.queued)
        after = self.in_flight[0] if self.in_flight else self.drafted
        bonus = verdict.target_token_id
        if verdict.accepted == len(sent.draft) and bonus is not None and after and after.assumed:
            if after.prefix[:-1] == [*sent.prefix, *sent.draft]:  # drafted on top of `sent`: it guessed
                self.tuner.observe_guess(proposed, after.assumed[-1] == bonus)
        self.committed += new
        if arrived is not None:  # speculation's wall rate, verdict to verdict (a stale one's time included)
            if sent.draft and self._progress_from is not None:
                self.tuner.observe_progress(len(new), arrived - self._progress_from)
            self._progress_from = arrived
        self.stats.verified(verdict, proposed, accepted, len(new), forced=verdict.accepted - accepted)
        self.stats.plain_steps += not sent.draft
        self.finished = verdict.finish is not None
        return new

    def _beside(self, sent: InFlight, verify_s: float, arrived: float | None) -> float:
        """The share of a verdict's forward the drafter spent drafting: the drafter calls that overlap
        the forward, placed at the verdict's arrival less half the round trip (none, where every call
        ended before it began). Without the times, 1 for a proposal the drafter drafted beside
        (InFlight.ahead), else 0."""
        if arrived is None or not self._draft_times or verify_s <= 0:
            return 1.0 if sent.ahead else 0.0
        end = arrived - (self.tuner.rtt_s or 0.0) / 2
        start = end - verify_s
        if sent.sent_s is not None:
            # Not before its proposal left: a round trip shorter than the estimate would otherwise lay
            # the draft it was drafted in beside it (a depth-0 forward read as side by side).
            start = max(start, sent.sent_s)
        while self._drafting and self._drafting[0][1] <= start:  # forwards end in order: none needs it
            self._drafting.popleft()
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._drafting)
        return min(1.0, busy / verify_s)

    def _final(self, prefix: list[int], draft: list[int]) -> bool:
        """Whether the proposal's verdict may finish the session (budget or a stop token)."""
        generated = len(prefix) - self._prompt_length
        return generated + len(draft) + 1 >= self.budget or any(t in self.stops for t in draft)

    def _gamma(self, length: int, chosen: int) -> int | None:
        """Draft tokens for a proposal starting at `length`: None once the budget is spent, 0 for a
        plain step (chosen 0)."""
        left = self.budget - (length - self._prompt_length)
        if left <= 0:
            return None
        # The last round may propose more than the budget leaves: the verifier drops the excess.
        return 0 if chosen == 0 else max(1, min(chosen, left - 1, self.max_gamma))


def check_logprobs(verdict: Verdict, committed: int, top_logprobs: int | None, vocab_size: int) -> None:
    """Raises BadVerdict unless the verdict carries what the session asked for: no logprobs, or one per
    token it commits with at most `top_logprobs` alternatives each, their ids in the vocabulary (the
    edge detokenizes them)."""
    wanted = committed if top_logprobs is not None else 0
    if len(verdict.logprobs) != wanted:
        raise BadVerdict(f"round {verdict.round}: {len(verdict.logprobs)} logprobs for {wanted} tokens")
    for t in verdict.logprobs:
        if len(t.top) > (top_logprobs or 0):
            raise BadVerdict(f"round {verdict.round}: more than {top_logprobs} top logprobs")
        if any(not 0 <= token < vocab_size for token, _ in t.top):
            raise BadVerdict(
                f"round {verdict.round}: a top logprob's id outside the vocabulary of {vocab_size}"
            )


def check_verdict(verdict: Verdict, sent: InFlight, committed: Sequence[int], vocab_size: int) -> None:
    """Raises BadVerdict unless `verdict` can answer `sent`, the oldest proposal in flight, given the
    `committed` sequence: its round, its start, ids in the vocabulary, and progress. A stale verdict
    for a proposal that builds exactly on the committed sequence would loop the edge forever; so would
    a verdict that commits nothing and does not finish."""
    if verdict.round != sent.round:
        raise BadVerdict(f"verdict for round {verdict.round}, expected round {sent.round}")
    if verdict.start_position != len(sent.prefix):
        raise BadVerdict(
            f"round {sent.round}: verdict starts at {verdict.start_position}, not {len(sent.prefix)}"
        )
    if verdict.stale:
        if list(sent.prefix) == list(committed):
            raise BadVerdict(f"round {sent.round} answered stale, but it builds on the committed tokens")
        return
    if not 0 <= verdict.accepted <= len(sent.draft):
        raise BadVerdict(f"round {sent.round}: {verdict.accepted} of {len(sent.draft)} draft tokens accepted")
    target = verdict.target_token_id
    if target is not None and not 0 <= target < vocab_size:
        raise BadVerdict(f"round {sent.round}: token id {target} outside the vocabulary of {vocab_size}")
    added = verdict.accepted + (target is not None)
    if added == 0 and verdict.finish is None:
        raise BadVerdict(f"round {sent.round}: the verdict commits nothing and does not finish")
    if verdict.committed_length != len(sent.prefix) + added:
        raise BadVerdict(
            f"round {sent.round}: committed length {verdict.committed_length}, "
            f"expected {len(sent.prefix) + added}"
        )
