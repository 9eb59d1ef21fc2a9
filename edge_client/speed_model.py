"""The model of adaptive speculation (edge_client.adaptive): the committed tokens per second a (γ, depth)
promises, from numbers (Estimates: acceptance, drafting and verifying costs, round trip). Pure: no clock,
no I/O, no state.

The model, for γ draft tokens a proposal and depth d (proposals sent ahead of their verdicts):
  E(γ)   = Σ_{k=0..γ} Π_{i<k} α_i          committed tokens a verified round (accepted + 1)
  q(γ)   = Π_{i<γ} α_i · α_γ                a pipelined proposal's successor stays live: all γ
                                            accepted, and the guessed bonus (the draft's token γ) right
  L(γ)   = D(γ) + R + V(γ+1)               a round from committed tokens: draft, wire, verify
  d = 0:  tokens/s = E / L
  d ≥ 1:  τ = max(D(γ+1), V(γ+1), (D(γ+1) + R + V(γ+1)) / (d+1))  a verdict's period while live
          (the draft, the verifier, or d+1 proposals cycling through one round trip), V at the share
          min(1, D(γ+1) / V(γ+1)) side by side (one draft a verdict), and the restart's at
          min(1, d·D(γ+1) / V(γ+1)) (d drafts back to back after its send)
          tokens/s = E / ((1-q)·(L + b) + q·τ)
          (a run restarts from committed tokens with probability 1-q, after the drafter finishes the
          now-stale draft under way: b. The drafter drafts back to back after a send, and a verdict
          comes R + V(γ+1) after its proposal's send, so b = D(γ+1) - ((R + V) mod D(γ+1)), or 0 once
          d drafts fill the pipeline first; averaged over ±10 % jitter in R + V. Where the verifier is
          the bottleneck the drafter waits on it in a live run, so only a run's first verdict finds
          it busy: b is weighted by 1-q there.)

The model is tested against the planner itself on a virtual clock (tools/testkit/timeline.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from draftwire.speculation import expected_tokens

PHASE_JITTER = 0.1


@dataclass(frozen=True, kw_only=True)
class Costs:
    """D(n) and V(n) in one way of running: lines, and V at the sizes measured, where it need not lie on
    its line (draftwire.speculation.CostLine)."""

    draft_fixed_s: float  # D(n) = draft_fixed_s + draft_token_s · n
    draft_token_s: float
    verify_fixed_s: float  # V(n) = verify_fixed_s + verify_position_s · n, n positions (γ + 1) ...
    verify_position_s: float
    verify_measured: Mapping[int, float] = field(default_factory=dict)  # ... but this where measured

    def draft(self, tokens: int) -> float:
        return self.draft_fixed_s + self.draft_token_s * tokens

    def verify(self, gamma: int) -> float:
        positions = gamma + 1
        measured = self.verify_measured.get(positions)
        return measured if measured is not None else self.verify_fixed_s + self.verify_position_s * positions


@dataclass(frozen=True, kw_only=True)
class Estimates(Costs):
    """What the model needs, as numbers: the tuner's current view, or a hand-built case in a test. The
    costs it holds itself are those of drafting and verifying in turn (depth 0); `ahead`, those while the
    drafter drafts alongside the verifier (depth ≥ 1), which on machines that share memory bandwidth
    (the two-core rig: docs/runs/benchmarks-history.md) cost more. None: the same."""

    acceptance: tuple[float, ...] = ()  # [max_gamma + 1]: α_i, conditional acceptance of draft position i
    rtt_s: float = 0.0  # R
    ahead: Costs | None = None

    def costs(self, ahead: bool) -> Costs:
        return self.ahead if ahead and self.ahead is not None else self

    def draft(self, tokens: int, ahead: bool = False) -> float:
        return Costs.draft(self.costs(ahead), tokens)

    def verify(self, gamma: int, ahead: bool = False) -> float:
        return Costs.verify(self.costs(ahead), gamma)


def off_tokens_per_second(est: Estimates, leg: int | None = None) -> float:
    """The model's tokens per second with speculation off: plain steps (`leg` None), or decoding on the
    verifier in legs of `leg` tokens, each a round trip to open and then one forward a token."""
    step = est.verify(0) + (est.rtt_s if leg is None else est.rtt_s / leg)
    return 1 / step if step > 0 else float("inf")


def tokens_per_second(est: Estimates, gamma: int, depth: int) -> float:
    """The model's committed tokens per second at (γ, depth) (see the module's docstring); γ 0 is a
    plain step (no drafting, nothing to pipeline)."""
    if gamma == 0:
        return off_tokens_per_second(est)
    tokens = expected_tokens(est.acceptance, gamma)
    if depth == 0:
        fresh = est.draft(gamma) + est.rtt_s + est.verify(gamma)
        return tokens / fresh if fresh > 0 else float("inf")
    # Pipelined, the drafter drafts while the verifier verifies, each slowed while the other runs: a
    # forward in proportion to the share of it spent beside drafting (beside_share).
    ahead = est.draft(gamma + 1, ahead=True)  # a pipelined proposal drafts the guessed bonus and γ tokens
    turn = est.verify(gamma)
    verify = _verify_beside(est, gamma, turn, beside_share(ahead, turn, 1))
    fresh = est.draft(gamma) + est.rtt_s + _verify_beside(est, gamma, turn, beside_share(ahead, turn, depth))
    period = max(ahead, verify, (ahead + est.rtt_s + verify) / (depth + 1))
    live = 1.0
    for i in range(gamma + 1):
        live *= est.acceptance[i]
    # The drafter's time left on a now-stale draft when a verdict breaks the run: where the drafter is
    # the bottleneck, at any break; where the verifier is, only at a run's first verdict (the drafter
    # refills the pipeline after a break, then waits on the verifier).
    busy = _busy(ahead, est.rtt_s + verify, depth) * (1.0 if period <= ahead else 1 - live)
    cost = (1 - live) * (fresh + busy) + live * period
    return tokens / cost if cost > 0 else float("inf")


def beside_share(draft_s: float, verify_s: float, drafts: int) -> float:
    """The share of a forward of `verify_s` spent beside the drafter when it drafts `drafts` proposals of
    `draft_s` each meanwhile: one a verdict while a pipelined run lives (a verdict frees the slot the
    next draft fills), the depth's worth back to back after a restart's send."""
    return min(1.0, drafts * draft_s / verify_s) if verify_s > 0 else 1.0


def _verify_beside(est: Estimates, gamma: int, turn: float, share: float) -> float:
    """V(γ + 1) with the drafter drafting through `share` of it: between the costs in turn (`turn`,
    est.verify(γ)) and side by side all through (Tuner.observe_verify)."""
    return turn + share * (est.verify(gamma, ahead=True) - turn)


def _busy(draft_s: float, back_s: float, depth: int) -> float:
    """The drafter's time left on a draft when a verdict comes, while it drafts back to back: each
    verdict comes `back_s` (R + V) after its proposal's send, which is where the next draft began, so
    the draft under way then has draft_s - (back_s mod draft_s) left; none once `depth` drafts fill
    the pipeline before the verdict (back_s >= depth · draft_s). That is a saw in back_s; real costs
    jitter, so it is averaged over back_s ± PHASE_JITTER of itself."""
    if draft_s <= 0:
        return 0.0
    width, points = PHASE_JITTER * back_s, 9
    total = 0.0
    for k in range(points):
        x = max(0.0, back_s + width * (2 * k / (points - 1) - 1))
        total += (draft_s - x % draft_s) % draft_s if x < depth * draft_s else 0.0
    return total / points


def best_setting(
    est: Estimates, gammas: range, depths: range, current: tuple[int, int] | None = None
) -> tuple[int, int]:
    """argmax of tokens_per_second over the grid; ties (within 1e-9) keep `current`, then the smaller."""
    scored = [(tokens_per_second(est, g, d), -g, -d) for g in gammas for d in depths]
    best = max(scored)
    if current is not None and current[0] in gammas and current[1] in depths:
        if tokens_per_second(est, *current) >= best[0] * (1 - 1e-9):
            return current
    return -best[1], -best[2]
