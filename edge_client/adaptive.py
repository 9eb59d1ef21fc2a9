"""Adaptive speculation: the γ and pipeline depth that promise the most committed tokens per second,
chosen online from what the edge measures. Pure: no clock, no I/O; the transport passes the figures in.

What is measured, each smoothed exponentially (weight `smoothing` for a new figure, the acceptance
counts `acceptance_smoothing`):
  α_i     acceptance of draft position i given positions 0..i-1 accepted (decayed counts, shrunk to
          the pooled rate, so a position seldom reached borrows from the others: i.i.d.-ish; every
          position's counts decay each round, so one not reached lately fades back to it). A round of
          γ tokens judges positions up to γ - 1; when all γ are accepted, a pipelined successor's guess
          of the bonus (the draft's token γ) judges position γ.
  D(n)    seconds to draft n tokens (one drafter call); V(n) seconds of the verifier's forward over n
          positions (Verdict.verify_seconds): each a line fitted over the sizes seen so far, and V at a
          size seen its own figures shrunk towards the line (a forward's cost need not grow with its
          positions). Each kept twice: in turn (depth 0) and side by side (the drafter drafting while
          the proposal is verified), since two processes sharing a machine's memory bandwidth slow
          each other: 5-30 % on the two-core rig's verifier (docs/runs/benchmarks-history.md). A
          forward is told
          with the share s of it the drafter spent drafting (the planner times both), and costs
          V + s·(V_beside - V): each size's forwards are fitted against their shares (BesideFit), and
          each tells both ends, moved to each by the fitted gap.
  R       round trip: send to the verdict's arrival (not to when the edge, busy drafting, reads it),
          less the verify time. Only a proposal sent with nothing in flight measures it; one queued
          behind others only bounds it from above.

They feed the model of the tokens per second a (γ, depth) promises: edge_client.speed_model.

Hysteresis: nothing moves before `warmup` verified rounds, nor within `dwell` rounds of the last move;
a move needs `margin` more predicted tokens/s than staying, and γ moves by at most `max_step`.

Speculation that does not pay (γ = 0, "off"): a proposal of no draft token is a plain step, the target's
next token, at 1 / (R + V(1)) tokens/s with no drafting. When adaptive γ is allowed to (`plain`), the
tuner turns speculation off once plain steps promise `off_margin` more than the best speculative
setting anywhere on the grid (a wider margin than a move's: where speculation barely pays or loses,
estimates that swing would turn it off and on for nothing), judged on at least `off_window`
speculative rounds since the last move (the acceptance a collapse is read from decays over about
1 / acceptance_smoothing rounds). Plain steps judge no draft position, and the counts decay as in any
round, so while off the estimate fades back towards the prior; after `probe_after` plain steps the
tuner probes: `dwell` rounds at the γ the model likes best, unpipelined, then decides again as above,
on what the probe saw more than on what turned speculation off. A probe that finds speculation
still losing doubles the wait for the next (up to `max_probe_after`); one that finds it paying keeps
it on. Every change of state says why (`reason`).

The model is checked against what speculation makes: the planner tells the tokens each verdict
committed and the wall time since the verdict before it (`observe_progress`), and the tuner keeps the
measured rate's ratio to the model's at the setting that made it. Where the measured rate falls short
of the model's by more than `shortfall_tolerance` (the model's own error against the planner's
timeline is within 11 %), the fallback judges speculation at the measured level: the model promises
every speculative setting times that ratio. Costs the model does not see (the draft and the verifier
fighting over one machine's cores, the edge's own work a round) then turn speculation off where it
does not pay, instead of a gain below 1 with speculation on.

Decoding on the verifier (`hand_off`): where the verifier can decode the session itself (a thin session,
which it plays back to back and streams: no round trip a token), speculation off means that instead of
plain steps. The edge hands the session to the verifier for the tokens left before the next probe (a
*leg*), then takes it back to probe; a leg of n tokens costs a round trip to open and n one-step
forwards, so off promises 1 / (V(1) + R / n) tokens/s. Where round trips are dear (a GPU verifier's
step of tens of ms, a mobile link's RTT of as much), that is the fallback that pays: plain steps
would pay R a token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from draftwire.speculation import AcceptanceCounts, BesideFit, CostLine
from edge_client.policy import ModelRule, Rule, StepRule
from edge_client.speed_model import (
    Costs,
    Estimates,
    best_setting,
    off_tokens_per_second,
    tokens_per_second,
)


@dataclass(frozen=True)
class TunerConfig:
    max_gamma: int = 8  # largest γ considered (the verifier's max_gamma caps it further)
    max_depth: int = 3  # deepest pipeline considered
    smoothing: float = 0.1  # weight of a new figure in the cost and round-trip estimates
    acceptance_smoothing: float = 0.05  # decay of the acceptance counts a round (rejections are rare
    # where acceptance is high: a shorter memory swings γ on a few of them)
    margin: float = 0.05  # a move must promise this share more tokens/s than staying
    dwell: int = 4  # verified rounds between moves
    warmup: int = 3  # verified rounds before the first move
    max_step: int = 2  # γ moves by at most this much at once
    prior_acceptance: float = 0.6  # α before anything is seen, worth `prior_weight` observations
    prior_weight: float = 2.0
    initial: tuple[int, int] = (4, 2)  # (γ, depth) until there is something to go on
    # Pipelined from the start, the costs in turn (depth 0) are not measured and borrow those side by side,
    # a pessimistic guess where the two share a machine: the tuner tries depth 0 once, for `dwell` rounds,
    # if the model puts it within this share of staying.
    explore_margin: float = 0.1
    fixed_share_draft: float = 0.1  # share of a drafter call not growing with its tokens, until fitted
    fixed_share_verify: float = 0.5  # share of a forward not growing with its positions, until fitted
    beside_prior: float = 0.15  # a forward beside drafting all through costs this share more, until told
    beside_smoothing: float = 0.03  # weight of a new forward in the fit of that share (BesideFit)
    plain: bool = True  # adaptive γ may turn speculation off (plain steps) where it does not pay
    off_window: int = 16  # speculative rounds since the last move before speculation may turn off
    off_margin: float = 0.1  # plain steps must promise this share more than the best speculative setting
    shortfall_tolerance: float = 0.15  # the measured rate below the model's by more: judged at it
    # Weight of a new verdict in that measure: a verdict's tokens swing with acceptance, so it keeps a
    # longer memory than the costs' (about 50 verdicts), and speaks after `off_window` of them.
    progress_smoothing: float = 0.02
    probe_after: int = 16  # plain steps before the first probe; doubled after each failed probe
    max_probe_after: int = 256
    hand_off: bool = True  # off hands decoding to the verifier where it can, instead of plain steps
    # How γ and depth move while speculation is on (Rule): "model", the setting the speed model promises
    # the most tokens/s; "step", Hugging Face's +2/-1 on γ at the initial depth. Both keep the same
    # estimates and the same fallback (speculation off, probes).
    rule: str = "model"


def _costs(draft: CostLine, verify: CostLine, verify_measured: Mapping[int, float]) -> Costs:
    draft_fixed, draft_token = draft.line()
    verify_fixed, verify_position = verify.line()
    return Costs(
        draft_fixed_s=draft_fixed,
        draft_token_s=draft_token,
        verify_fixed_s=verify_fixed,
        verify_position_s=verify_position,
        verify_measured=verify_measured,
    )


SERVER_FIGURES = 1.0  # what the verifier's figure at a size weighs against this edge's own (_with_server)
PATH_LENGTH = 256  # changes of choice a Tuner's path keeps


def _with_server(table: dict[int, float], timed: Mapping[int, float], server: Mapping[int, float]) -> dict:
    """`table` (V by positions, as measured; `timed`: each size's forwards, decayed by how long ago, as
    Tuner keeps them) joined with the verifier's `server` figures, scaled by the two's ratio at the
    sizes both have, weighted by `timed` (1 where none): the verifier's figure alone at a size the table
    lacks, and where both have one, the two weighted by `timed` against SERVER_FIGURES. So the verifier
    gives the shape and this edge's recent forwards the level, and a size this edge timed only long ago
    leans on the verifier's figure at today's level instead of its own old one. Without that, a few
    slow forwards at γ 4 at the start (1.8 times the cost seen later) held a tuner at γ 2 for good on
    haiku, and three cheap forwards at 2 positions early on, against a slow stretch at 3, sent it to
    γ 1 (docs/runs/benchmarks-history.md).

    V(1), a plain step's, included: speculating, the edge times no forward of one position, and its own
    line through a size or two near γ + 1, with the guessed fixed share, put the 1.5B target's step at
    0.58 of a 6-position round where the verifier's figures say 0.9. Plain steps then looked cheap, and
    speculation turned off in chat and haiku, where it paid 1.5-2.3x (docs/runs/benchmarks-history.md).
    A V(1) from the
    verifier's figures is held at or below every other size's estimate: the scaling mixes two sources,
    and a plain step dearer than a round would keep a wrong draft speculating."""
    server = _rising(server)
    common = [n for n in table if n in server]
    ratio = 1.0
    if common:
        ratio = sum(timed[n] * table[n] for n in common) / sum(timed[n] * server[n] for n in common)
    merged = {n: s * ratio for n, s in server.items()}
    for n, own in table.items():
        if n in merged:
            w = timed[n]
            own = (w * own + SERVER_FIGURES * merged[n]) / (w + SERVER_FIGURES)
        merged[n] = own
    if 1 in merged and 1 not in table and len(merged) > 1:
        merged[1] = min(merged[1], *(s for n, s in merged.items() if n > 1))
    return merged


def _rising(seconds: Mapping[int, float]) -> dict[int, float]:
    """The verifier's figures by positions made non-decreasing (adjacent sizes that fall are pooled to
    their mean): one forward timed a size at start-up is noisy, and on a small model a dip between two
    sizes, within noise, made the tuner prefer the larger γ with a wrong draft, or a γ 1 round cheaper
    than a plain step. The tuner's own figures may still show a real dip (CostLine)."""
    blocks: list[list[float]] = []  # [total, count] of pooled adjacent sizes
    sizes = sorted(seconds)
    for n in sizes:
        blocks.append([seconds[n], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    means = [total / count for total, count in blocks for _ in range(int(count))]
    return dict(zip(sizes, means, strict=True))


def path_rounds(path: list[tuple[int, int, int]], rounds: int) -> list[list[int]]:
    """A tuner's path ((round, γ, depth) at each change, Tuner.path) as [γ, depth, rounds played at it] in
    order, `rounds` the verified rounds seen in all."""
    ends = [r for r, _, _ in path[1:]] + [rounds]
    return [[g, d, end - start] for (start, g, d), end in zip(path, ends, strict=True)]


@dataclass
class Tuner:
    """The running estimates and the current (γ, depth) of one edge: kept across generations, since
    the drafter, the link and the verifier outlive a request. Fed by the planner and the transport."""

    config: TunerConfig = field(default_factory=TunerConfig)
    rounds: int = 0  # verified rounds seen
    choice: tuple[int, int] = (0, 0)  # current (γ, depth); set from config.initial
    moves: int = 0  # times the choice changed
    rtt_s: float | None = None
    plain_steps: int = 0  # verified rounds of no draft token (speculation off, γ 0)
    server_tokens: int = 0  # tokens the verifier decoded alone, handed off (speculation off)
    legs: int = 0  # times speculation off handed decoding to the verifier
    offs: int = 0  # times speculation turned off
    probes: int = 0  # probes begun while off
    reason: str = ""  # why the last change of state: speculation off, probing, on again
    # (verified rounds seen, γ, depth) at the start and at each change of the choice since: the tuner's
    # path, for a bench to read its learning cost from (the last PATH_LENGTH kept).
    path: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = self.config
        self.choice = (min(c.initial[0], c.max_gamma), min(c.initial[1], c.max_depth))
        self.path = [(0, *self.choice)]
        size = c.max_gamma + 2  # positions 0..max_gamma (the last: the guessed bonus)
        self._acceptance = AcceptanceCounts(size, c.acceptance_smoothing, c.prior_acceptance, c.prior_weight)
        # In turn (depth 0) and side by side (the drafter drafting while a proposal is verified).
        self.draft = CostLine(c.smoothing, c.fixed_share_draft)
        self.verify = CostLine(c.smoothing, c.fixed_share_verify)
        self.draft_ahead = CostLine(c.smoothing, c.fixed_share_draft)
        self.verify_ahead = CostLine(c.smoothing, c.fixed_share_verify)
        self.beside = BesideFit(c.beside_smoothing, c.beside_prior)  # how a forward grows beside drafting
        self.turn_forwards = 0  # forwards seen with no drafting beside them
        # positions -> forwards timed there, each decayed by 1 - smoothing a forward since: how lately
        # each size was timed, either way (_with_server)
        self._timed: dict[int, float] = {}
        self.last_move = 0  # verified rounds seen at the last move (settled)
        self.rule: Rule = ModelRule() if c.rule == "model" else StepRule(*self.choice)
        self._probe_after = self.config.probe_after
        self._plain_since = 0  # plain steps since speculation turned off (or since the last probe)
        self._probing = False
        self._server = False  # off hands decoding to the verifier (choose's `server`)
        self._server_costs: dict[int, float] = {}  # the verifier's V(n), by positions (observe_server_costs)
        # Speculation's wall time and the model's for the same tokens, each decayed (observe_progress)
        self._measured_s = 0.0
        self._modelled_s = 0.0
        self._progress_weight = 0.0  # verdicts in that measure, decayed alike

    @property
    def state(self) -> str:
        """ "on", "off" (plain steps) or "probing" (speculating again for a few rounds, to see)."""
        return "probing" if self._probing else ("off" if self.choice[0] == 0 else "on")

    # --- what is measured ---

    def observe_verdict(self, draft_tokens: int, accepted: int, cut: bool) -> None:
        """A verified round of `draft_tokens` of which the first `accepted` were accepted; `cut`: the
        round ended by a finish, so the position after the accepted ones was not judged. A plain step
        (no draft token) judges nothing."""
        self.rounds += 1
        if draft_tokens == 0:
            self.plain_steps += 1
            self._plain_since += 1
            self._acceptance.round(0, 0)  # judges nothing; the counts decay as every round's do
            return
        # Every position's counts decay each round, judged or not: what a position not reached lately
        # (γ moved below it) once showed fades, and it borrows the pooled rate again.
        self._acceptance.round(draft_tokens, accepted, cut)
        self.rule.observe(draft_tokens, accepted, cut)

    def observe_leg(self, tokens: int) -> None:
        """The verifier decoded `tokens` alone (a leg, speculation off): each counts as a plain step
        towards the next probe, and the acceptance counts decay as over that many rounds."""
        self.legs += 1
        self.server_tokens += tokens
        self.rounds += tokens
        self._plain_since += tokens
        for _ in range(tokens):
            self._acceptance.round(0, 0)

    def leg_tokens(self) -> int:
        """While off: the tokens to hand to the verifier before the next probe (at least 1)."""
        return max(1, self._probe_after - self._plain_since)

    def observe_server_costs(self, seconds: Mapping[int, float]) -> None:
        """The verifier's recent forward time by positions (SessionOpened.forward_seconds), the latest
        figures replacing older ones. They give the shape of V(n) at the sizes this tuner has not
        measured, scaled to its own level (`estimates`), instead of the fixed share's guess of how a
        forward grows with its positions: on a pair whose forward hardly grows, that guess sent γ down
        and back up over a new tuner's first rounds (docs/runs/benchmarks-history.md)."""
        self._server_costs.update({n: s for n, s in seconds.items() if n > 0 and s > 0})

    def observe_guess(self, draft_tokens: int, right: bool) -> None:
        """A proposal of `draft_tokens` all accepted, and its pipelined successor's guess of the bonus
        token `right` or not: draft position `draft_tokens` judged (the guess is the draft's token there),
        which the round itself never judges and q(γ) needs."""
        self._acceptance.judge(draft_tokens, right)

    def observe_draft(self, tokens: int, seconds: float, ahead: bool = False) -> None:
        """One drafter call that drafted `tokens` (the guessed bonus included); `ahead`: while a proposal
        it builds on was in flight (pipelined), so beside the verifier's forward."""
        (self.draft_ahead if ahead else self.draft).observe(tokens, seconds)

    def observe_verify(self, draft_tokens: int, seconds: float, beside: float = 0.0) -> None:
        """The verifier's forward for a proposal of `draft_tokens` (over draft_tokens + 1 positions);
        `beside`: the share of it the drafter spent drafting (pipelined), 0 in turn. The costs are kept
        at the two ends, in turn and beside drafting all through, and a forward beside a share of
        drafting tells both, moved to each by the gap between them (BesideFit): pipelined, a forward
        beside one short draft costs about what one in turn does, and one beside drafts all through,
        as at the pipeline's start, up to 1.3 times as much (docs/runs/benchmarks-history.md)."""
        if seconds <= 0:
            return
        positions = draft_tokens + 1
        keep = 1 - self.config.smoothing
        self._timed = {n: keep * w for n, w in self._timed.items()}
        self._timed[positions] = self._timed.get(positions, 0.0) + 1
        self.beside.observe(positions, beside, seconds)
        if beside <= 0:
            self.turn_forwards += 1
            self.verify.observe(positions, seconds)
            return
        level = self.verify(positions) if self.verify.seen else seconds / (1 + beside * self.beside.prior)
        gap = self.beside.gap(positions, level)
        self.verify.observe(positions, max(seconds - beside * gap, seconds / 2))
        self.verify_ahead.observe(positions, seconds + (1 - beside) * gap)

    def observe_progress(self, tokens: int, seconds: float) -> None:
        """Speculation committed `tokens` in `seconds` of wall time (from the verdict before, in one
        generation): against the model's rate at the current setting, once settled."""
        if seconds <= 0 or self.choice[0] == 0 or not self.settled():
            return
        promised = tokens_per_second(self.estimates(), *self.choice)
        keep = 1 - self.config.progress_smoothing
        self._measured_s = keep * self._measured_s + seconds
        self._modelled_s = keep * self._modelled_s + tokens / promised
        self._progress_weight = keep * self._progress_weight + 1

    def shortfall(self) -> float:
        """Measured speculative tokens/s over the model's (1 where within `shortfall_tolerance`, or
        measured over fewer than `off_window` verdicts): what the fallback scales the model's
        speculative rates by."""
        if self._progress_weight < self.config.off_window:
            return 1.0
        ratio = self._modelled_s / self._measured_s
        return ratio if ratio < 1 - self.config.shortfall_tolerance else 1.0

    def step_s(self) -> float:
        """V(1), the target's one-step time as measured (0 before any forward)."""
        return self.estimates().verify(0)

    def observe_round(self, round_s: float, verify_s: float, queued: bool) -> None:
        """Send to verdict of a verified proposal; `queued`: others were in flight when it was sent, so
        it may have waited behind them, and its figure only bounds the round trip from above."""
        sample = max(0.0, round_s - verify_s)
        if self.rtt_s is None:
            self.rtt_s = sample
        elif not queued or sample < self.rtt_s:
            self.rtt_s += self.config.smoothing * (sample - self.rtt_s)

    # --- what follows from it ---

    def acceptance(self) -> tuple[float, ...]:
        """α_i for every position: each position's decayed counts, shrunk towards the pooled rate."""
        return self._acceptance.rates()

    def estimates(self) -> Estimates:
        """The model's inputs. A way of running not yet measured borrows the other's costs, and a size
        verified one way but not the other borrows that figure, scaled by the two ways' ratio at the sizes
        both measured (Tuner.choose tries depth 0 once where it might pay, so that both are measured). A
        size verified neither way takes the verifier's figure (observe_server_costs), scaled likewise by
        the ratio of this tuner's figures to the verifier's at the sizes both have, most those timed
        lately: the verifier gives the shape, this edge's own measures the level (its rounds may run
        beside its drafter); a size timed only long ago leans on the verifier's figure (_with_server)."""
        draft = self.draft if self.draft.seen else self.draft_ahead
        draft_ahead = self.draft_ahead if self.draft_ahead.seen else draft
        verify = self.verify if self.verify.seen else self.verify_ahead
        verify_ahead = self.verify_ahead if self.verify_ahead.seen else verify
        in_turn, beside = self.verify.sizes(), self.verify_ahead.sizes()
        both = in_turn.keys() & beside.keys()
        turn_figures, beside_figures = self.verify.figures(), self.verify_ahead.figures()
        weights = {n: min(turn_figures[n], beside_figures[n]) for n in both}
        ratio = 1.0
        if weights:
            ratio = sum(w * beside[n] for n, w in weights.items())
            ratio /= sum(w * in_turn[n] for n, w in weights.items())
        in_turn, beside = (
            {**{n: s / ratio for n, s in beside.items()}, **in_turn},
            {**{n: s * ratio for n, s in in_turn.items()}, **beside},
        )
        in_turn = _with_server(in_turn, self._timed, self._server_costs)
        beside = _with_server(beside, self._timed, self._server_costs)
        return Estimates(
            **vars(_costs(draft, verify, in_turn)),
            acceptance=self.acceptance(),
            rtt_s=self.rtt_s or 0.0,
            ahead=_costs(draft_ahead, verify_ahead, beside),
        )

    def choose(
        self,
        gamma: int | None = None,
        depth: int | None = None,
        max_gamma: int = 0,
        plain: bool = True,
        server: bool = False,
    ) -> tuple[int, int]:
        """The (γ, depth) to use now; `gamma` or `depth` given fixes that one and the other is tuned.
        `max_gamma`: the verifier's cap (0: none); `plain`: whether the verifier takes plain steps (an
        older one does not); `server`: whether speculation off can hand decoding to the verifier.
        Moves the current choice only as the hysteresis allows; with γ tuned (and the config's
        `plain`), turns speculation off and probes it as the module's docstring says."""
        chosen = self._choose(gamma, depth, max_gamma, plain, server)
        if chosen != self.path[-1][1:]:
            self.path.append((self.rounds, *chosen))
            del self.path[:-PATH_LENGTH]
        return chosen

    def _choose(
        self, gamma: int | None, depth: int | None, max_gamma: int, plain: bool, server: bool
    ) -> tuple[int, int]:
        c = self.config
        top = min(c.max_gamma, max_gamma) if max_gamma else c.max_gamma
        plain = c.plain and plain and not gamma
        self._server = plain and server and c.hand_off
        if not plain and self.choice[0] == 0:  # a fixed γ, or plain steps not allowed: speculate
            self.choice = (1, self.choice[1])
        gammas = range(gamma, gamma + 1) if gamma else range(1, top + 1)
        depths = range(depth, depth + 1) if depth is not None else range(0, c.max_depth + 1)
        if self.choice[0] == 0:
            self.choice = self._probe(gammas, depths[0]) if self._plain_since >= self._probe_after else (0, 0)
            return self.choice
        current = (
            min(max(self.choice[0], gammas[0]), gammas[-1]),
            min(max(self.choice[1], depths[0]), depths[-1]),
        )
        if self.settled():
            if plain and self._off(self.estimates(), gammas, depths, current):
                self.choice = (0, 0)
                return self.choice
            if self._probing:  # the probe found speculation paying: on again
                self._probing, self._probe_after = False, c.probe_after
                self.reason = "speculation on: a probe found it paying"
        if not self._probing:  # a probe holds its setting
            current = self.rule.choose(self, gammas, depths, current)
        self.choice = current
        return current

    def settled(self) -> bool:
        """Whether the estimates may move the choice now: `warmup` verified rounds seen, something
        drafted and a round trip timed, and `dwell` rounds since the last move."""
        c = self.config
        drafted = self.draft.seen or self.draft_ahead.seen
        ready = self.rounds >= c.warmup and drafted and self.rtt_s is not None
        return ready and self.rounds - self.last_move >= c.dwell

    def moved(self) -> None:
        """The rule moved the choice: the hysteresis counts from here."""
        self.last_move = self.rounds
        self.moves += 1

    def _off(self, est: Estimates, gammas: range, depths: range, current: tuple[int, int]) -> bool:
        """Whether to turn speculation off now: plain steps promise `off_margin` more tokens/s than the best
        speculative setting on the whole grid, after at least `off_window` rounds since the last move
        (a probe's rounds are enough to turn it off again). Says why in `reason`."""
        c = self.config
        if not self._probing and self.rounds - self.last_move < c.off_window:
            return False
        plain = off_tokens_per_second(est, self._probe_after if self._server else None)
        measured = self.shortfall()
        if plain <= (1 + c.off_margin) * measured * tokens_per_second(est, *current):
            return False  # the current setting pays: one evaluation instead of the whole grid's
        best = best_setting(est, gammas, depths)
        speculative = measured * tokens_per_second(est, *best)
        if plain <= (1 + c.off_margin) * speculative:
            return False
        if self._probing:
            self._probe_after = min(2 * self._probe_after, c.max_probe_after)
        self._probing, self._plain_since = False, 0
        self.last_move = self.rounds
        self.offs += 1
        self.moves += 1
        how = "decoding on the verifier promises" if self._server else "plain steps promise"
        self.reason = (
            f"speculation off: {how} {plain:.2f} tokens/s, the best speculative setting "
            f"(γ {best[0]}, depth {best[1]}) {speculative:.2f} at acceptance {est.acceptance[0]:.2f}"
        )
        if measured < 1:
            self.reason += f", speculation measured at {measured:.2f} of the model's rate"
        return True

    def _probe(self, gammas: range, depth: int) -> tuple[int, int]:
        """Speculation again for `dwell` rounds, at the γ the model likes best and the shallowest depth
        allowed (unpipelined unless the request fixed a depth)."""
        self._probing, self._plain_since = True, 0
        self.last_move = self.rounds
        self.probes += 1
        self.moves += 1
        gamma, _ = best_setting(self.estimates(), gammas, range(depth, depth + 1))
        steps = "tokens decoded on the verifier" if self._server else "plain steps"
        self.reason = f"probing speculation at γ {gamma} after {self._probe_after} {steps}"
        return gamma, depth
