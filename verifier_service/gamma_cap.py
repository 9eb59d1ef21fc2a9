"""The verifier's γ cap under load: the most draft tokens a proposal should carry, which every verdict
advertises (Verdict.gamma_cap) and the edge's planner obeys. Pure: the batcher passes the figures in.

An edge chooses γ for its own tokens per second. A replica whose engine is busy all the time pays for
every drafted position in every batch, and serves, with B sessions a batch at γ,

    S(γ) = B · E(γ) / (F + s · B · (γ + 1))       tokens per second of engine time

E(γ) the tokens a round commits at the acceptance its edges' rounds show, position by position (pooled
over every session), and F + s·P the engine's seconds for a batch of P positions (a line fitted over
its batches); a thin session's round adds one position and one token, whatever γ. On a GPU,
s·B·(γ + 1) stays small beside F to large batches and the best γ, γ*, stays high; on a CPU the forward
costs what its positions cost from a few rows on, and γ* falls as B grows.

The cap moves smoothly, and never turns speculation off (vLLM's batch-size threshold does, and drops
throughput by up to 10× at it: vLLM issue 49548). The engine's busy share and its rows a batch are
averaged over time (`memory_s`: an idle spell counts as idle, whatever the batches before it). The
pressure p rises linearly from 0, at a busy share `calm`, to 1 at `busy`; the cap's goal is
max_gamma − p · (max_gamma − γ*); the cap moves one step towards it at most once every `dwell` batches
(every batch while it climbs back with no pressure left), never below 1. A cap above every γ the edges
send binds nobody, so it comes down to the largest of them at once; below that it steps. Idle or
lightly loaded, the cap is max_gamma: no limit.

A lone session is never capped. The cap trades a session's own speed for what the engine serves the
others; with nobody else open, the busy share is that session's own verify time (one session in turn on
the Qwen pair keeps a CPU engine 75-80 % busy), and its own tuner, which weighs its drafting and round
trip as the cap cannot, chooses its γ best. So the pressure counts only while two or more sessions are
open (docs/runs/benchmarks-history.md: at haiku's acceptance a cap of 3 held the fixed γ 4 rows of a
lone session below 4 in 59-62 % of their rounds).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from draftwire.speculation import AcceptanceCounts, CostLine, expected_tokens


@dataclass(frozen=True)
class CapConfig:
    enabled: bool = True  # False: every verdict advertises max_gamma
    calm: float = 0.5  # the engine's busy share below which nothing is capped
    busy: float = 0.9  # the busy share at which the cap's goal is γ*
    dwell: int = 4  # batches between steps of the cap
    memory_s: float = 2.0  # time constant of the busy share and the rows a batch
    smoothing: float = 0.1  # weight of a new figure in the cost line
    acceptance_decay: float = 0.02  # decay of the acceptance counts a round (rounds of every session)
    recent_rounds: int = 64  # rounds over which "the largest γ the edges send" is taken


class GammaCap:
    def __init__(self, max_gamma: int, config: CapConfig = CapConfig()):
        self.max_gamma = max_gamma
        self.config = config
        self.value = max_gamma  # the cap advertised now
        self.busy_share = 0.0
        self.rows = 0.0  # rounds a batch, thin sessions' included
        self.edge_rows = 0.0  # of which edges' (the only ones γ changes)
        self.sessions = 0  # sessions open at the last batch (at least its rows)
        self._edge_rounds = 0  # edge rounds completed since the last batch: that batch's edge rows
        self.cost = CostLine(config.smoothing, fixed_share=0.5)
        self._acceptance = AcceptanceCounts(max_gamma, config.acceptance_decay, prior=0.6, prior_weight=2.0)
        self._sent: collections.deque[int] = collections.deque(maxlen=config.recent_rounds)
        self._batches = 0
        self._last_move = 0

    def observe_round(self, draft_tokens: int, accepted: int, cut: bool = False) -> None:
        """An edge's verified round (not a thin session's: the server's own drafts are not the edges')."""
        self._acceptance.round(draft_tokens, accepted, cut)
        self._sent.append(draft_tokens)
        self._edge_rounds += 1

    def observe_batch(
        self, rows: int, positions: int, seconds: float, interval_s: float | None, sessions: int = 0
    ) -> None:
        """An engine batch of `rows` rounds and `positions` positions that took `seconds`, ending
        `interval_s` after the batch before it ended (None for the first), with `sessions` open (taken as
        at least the batch's rows); then moves the cap as the rules allow."""
        self.sessions = max(sessions, rows)
        # The edge rounds completed since the last batch were that batch's (their verdicts follow it).
        edge, self._edge_rounds = self._edge_rounds, 0
        if interval_s is None:  # nothing to measure the busy share against yet
            self.rows, self.edge_rows = rows, edge
        else:
            interval_s = max(interval_s, seconds)
            w = 1 - math.exp(-interval_s / self.config.memory_s) if interval_s > 0 else 0.0
            share = seconds / interval_s if interval_s > 0 else 0.0
            self.busy_share += w * (share - self.busy_share)
            self.rows += w * (rows - self.rows)
            self.edge_rows += w * (edge - self.edge_rows)
        self.cost.observe(positions, seconds)
        self._batches += 1
        if self.config.enabled:
            self._move()

    def best_gamma(self) -> int:
        """γ*: the γ that serves the most tokens per second of engine time at the current rows (a thin
        session's round is one position and one token whatever γ); max_gamma while no edge drafts."""
        if self.edge_rows < 0.5:
            return self.max_gamma
        fixed, per_position = self.cost.line()
        rates = self._acceptance.rates()
        edge, thin = self.edge_rows, max(0.0, self.rows - self.edge_rows)

        def served(gamma: int) -> float:
            seconds = fixed + per_position * (edge * (gamma + 1) + thin)
            tokens = edge * expected_tokens(rates, gamma) + thin
            return tokens / seconds if seconds > 0 else float("inf")

        return max(range(1, self.max_gamma + 1), key=lambda g: (served(g), -g))

    @property
    def pressure(self) -> float:
        c = self.config
        if self.sessions < 2:  # a lone session: nobody to serve by slowing it
            return 0.0
        return min(1.0, max(0.0, (self.busy_share - c.calm) / (c.busy - c.calm)))

    def goal(self) -> int:
        """Where the cap is heading: max_gamma without pressure, γ* at full pressure."""
        if self.pressure == 0:
            return self.max_gamma
        return max(1, round(self.max_gamma - self.pressure * (self.max_gamma - self.best_gamma())))

    def _move(self) -> None:
        goal = self.goal()
        if goal < self.value and self._sent and max(self._sent) < self.value:
            self.value = max(goal, max(self._sent))  # binding nobody: down to what the edges send
        dwell = 1 if self.pressure == 0 else self.config.dwell
        if goal != self.value and self._batches - self._last_move >= dwell:
            self.value += 1 if goal > self.value else -1
            self._last_move = self._batches
