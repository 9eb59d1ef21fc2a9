"""The adaptive policy's one choice while speculation is on (γ and the pipeline depth), behind one small
interface, Rule: told each verdict, asked for (γ, depth). The Tuner (edge_client.adaptive) around it
measures the costs and the acceptance, feeds the speed model, and turns speculation off and on (the
fallback), whichever rule it holds (TunerConfig.rule). Pure: no clock, no I/O.

Two rules: ModelRule, the setting the speed model (edge_client.speed_model) promises the most tokens/s,
and StepRule, Hugging Face's heuristic schedule (+2 on γ after a round all accepted, -1 after one not)
at a fixed depth. How they compare on the Qwen pair: docs/adaptive.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from edge_client.speed_model import Estimates, best_setting, tokens_per_second

Setting = tuple[int, int]  # (γ, pipeline depth)


class Tuning(Protocol):
    """What a rule reads and tells of the Tuner that holds it."""

    config: Any  # the TunerConfig: max_step, margin, explore_margin
    turn_forwards: int  # forwards timed with no drafting beside them
    moves: int  # times the choice changed

    def settled(self) -> bool:
        """Whether the estimates may move the choice now (warm-up and dwell past)."""

    def estimates(self) -> Estimates:
        """The speed model's inputs as measured."""

    def moved(self) -> None:
        """A move that holds the choice for the dwell."""


class Rule(Protocol):
    """The policy's one choice while speculation is on: told each verdict, asked for (γ, depth). The
    Tuner around it measures, feeds the speed model and turns speculation off and on (the fallback)."""

    def observe(self, draft_tokens: int, accepted: int, cut: bool) -> None:
        """A verified round of `draft_tokens` (at least 1), the first `accepted` accepted; `cut`: ended by
        a finish, so the position after the accepted ones was not judged."""

    def choose(self, tuner: Tuning, gammas: range, depths: range, current: Setting) -> Setting:
        """The (γ, depth) to plan with, within `gammas` and `depths`; `current`: the choice so far.
        Calls tuner.moved() where a move should hold the choice for the hysteresis' dwell."""


@dataclass
class ModelRule:
    """The setting the speed model promises the most tokens/s, moved only as the hysteresis allows
    (warm-up, dwell, `margin`, `max_step`); depth 0 tried once, for `dwell` rounds, where the model puts
    it within `explore_margin` of staying and no forward in turn has been timed."""

    trial: tuple[int, int] | None = None  # the setting left to try depth 0, while trying it

    def observe(self, draft_tokens: int, accepted: int, cut: bool) -> None:
        pass  # the model reads the tuner's acceptance counts

    def choose(self, tuner: Tuning, gammas: range, depths: range, current: Setting) -> Setting:
        if not tuner.settled():
            return current
        c, est = tuner.config, tuner.estimates()
        step = range(max(gammas[0], current[0] - c.max_step), min(gammas[-1], current[0] + c.max_step) + 1)
        target = best_setting(est, step, depths, current)
        staying = tokens_per_second(est, *current)
        trial, self.trial = self.trial, None
        if trial is not None and staying <= (1 + c.margin) * tokens_per_second(est, *trial):
            # Depth 0 was a trial: it stays only where it proved itself by the margin, else the best
            # other setting takes over with no margin to beat.
            others = [(g, d) for g in step for d in depths if (g, d) != current]
            target, staying = max(others, key=lambda s: tokens_per_second(est, *s)), 0.0
        elif not tuner.turn_forwards and current[1] > 0 and depths[0] == 0:  # none seen in turn
            in_turn = best_setting(est, step, range(0, 1))
            if tokens_per_second(est, *in_turn) >= (1 - c.explore_margin) * staying:
                target, staying, self.trial = in_turn, 0.0, current
        if target != current and tokens_per_second(est, *target) > (1 + c.margin) * staying:
            tuner.moved()
            return target
        return current


@dataclass
class StepRule:
    """Hugging Face's heuristic schedule for an assistant model: γ + 2 after a round whose every draft
    token was accepted, γ - 1 (not below 1) after one that was not, at a fixed pipeline depth. No
    estimate and no hysteresis: γ follows the verdicts as they come."""

    gamma: int = 4
    depth: int = 2

    def observe(self, draft_tokens: int, accepted: int, cut: bool) -> None:
        if accepted == draft_tokens:
            self.gamma += 2
        elif not cut:  # a finish, not a rejection, ended a cut round short
            self.gamma = max(1, self.gamma - 1)

    def choose(self, tuner: Tuning, gammas: range, depths: range, current: Setting) -> Setting:
        self.gamma = min(max(self.gamma, gammas[0]), gammas[-1])  # the cap holds γ, as the verifier's does
        chosen = (self.gamma, min(max(self.depth, depths[0]), depths[-1]))
        if chosen != current:
            tuner.moves += 1
        return chosen
