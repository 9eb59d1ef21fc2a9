"""What speculation yields and costs, as estimators both ends keep: acceptance by draft position, a
cost line, and the tokens a round commits. Pure: no clock, no I/O, no torch.

The edge's tuner (edge_client.adaptive) uses them to choose its own γ and depth; the verifier's load
cap (verifier_service.gamma_cap) to choose the γ that serves the most tokens when it is the bottleneck.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_tokens(acceptance: Sequence[float], gamma: int) -> float:
    """E(γ) = Σ_{k=0..γ} Π_{i<k} α_i: committed tokens of a verified round of γ draft tokens."""
    total, reach = 0.0, 1.0
    for k in range(gamma + 1):
        total += reach
        if k < gamma:
            reach *= acceptance[k]
    return total


class AcceptanceCounts:
    """α_i, the acceptance of draft position i given positions 0..i-1 accepted: counts per position
    that decay each round (so a position not reached lately fades back to the pooled rate), shrunk
    towards the pooled rate (so a position seldom reached borrows from the others), with a prior worth
    `prior_weight` observations at `prior` before anything is seen."""

    def __init__(self, positions: int, decay: float, prior: float, prior_weight: float):
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        self._accepted = [0.0] * positions
        self._reached = [0.0] * positions

    def round(self, draft_tokens: int, accepted: int, cut: bool = False) -> None:
        """A verified round of `draft_tokens` of which the first `accepted` were accepted; `cut`: the
        round ended by a finish, so the position after the accepted ones was not judged."""
        judged = accepted + (0 if cut or accepted >= draft_tokens else 1)
        keep = 1 - self.decay
        self._accepted = [keep * a for a in self._accepted]
        self._reached = [keep * n for n in self._reached]
        for i in range(judged):
            self.judge(i, i < accepted)

    def judge(self, position: int, accepted: bool) -> None:
        if position < len(self._reached):
            self._accepted[position] += accepted
            self._reached[position] += 1

    def rates(self) -> tuple[float, ...]:
        """α_i for every position."""
        w = self.prior_weight
        pooled = (sum(self._accepted) + self.prior * w) / (sum(self._reached) + w)
        return tuple((a + pooled * w) / (n + w) for a, n in zip(self._accepted, self._reached, strict=True))


class CostLine:
    """Seconds against a size (tokens drafted, positions verified): a running average per size seen,
    and a weighted line through them; with one size seen, a line with the given fixed share.

    A cost need not be a line: a forward over 5 positions can cost less than one over 3 (measured on the
    Qwen pair, docs/runs/benchmarks-history.md). So a size seen is estimated from its own mean, shrunk
    towards the
    line as far as the figures' noise explains its distance from it (empirical Bayes: the sizes' spread
    about the line, less what noise puts there, against the noise in this size's mean). Where the sizes
    lie on a line within noise, every estimate is the line's, which pools them all; the line serves
    alone for sizes not seen."""

    def __init__(self, smoothing: float, fixed_share: float):
        self.smoothing = smoothing
        self.fixed_share = fixed_share
        self.means: dict[int, float] = {}  # size -> smoothed seconds
        self.counts: dict[int, int] = {}  # size -> figures seen
        # The smoothed square of a figure's relative distance from its size's mean: a 10 % spread until
        # some size is seen twice.
        self.noise = 0.01
        self._residuals = 0

    def observe(self, size: int, seconds: float) -> None:
        if size <= 0 or seconds < 0:
            return
        old = self.means.get(size)
        if old:
            self._residuals += 1
            weight = max(self.smoothing, 1 / self._residuals)
            self.noise += weight * (((seconds - old) / old) ** 2 - self.noise)
        # The first figures of a size are averaged plainly, then smoothed.
        weight = max(self.smoothing, 1 / (self.counts.get(size, 0) + 1))
        self.means[size] = seconds if old is None else old + weight * (seconds - old)
        self.counts[size] = self.counts.get(size, 0) + 1

    @property
    def seen(self) -> bool:
        return bool(self.means)

    def figures(self) -> dict[int, float]:
        """The figures each size's smoothed mean stands for: its count, at most 1 / smoothing."""
        return {n: min(c, 1 / self.smoothing) for n, c in self.counts.items()}

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per unit), both >= 0; (0, 0) before any figure."""
        if not self.means:
            return 0.0, 0.0
        weights = self.figures()
        total = sum(weights.values())
        mean_n = sum(w * n for n, w in weights.items()) / total
        mean_s = sum(w * self.means[n] for n, w in weights.items()) / total
        spread = sum(w * (n - mean_n) ** 2 for n, w in weights.items())
        if spread > 0:
            slope = sum(w * (n - mean_n) * (self.means[n] - mean_s) for n, w in weights.items()) / spread
            slope = max(0.0, slope)
            fixed = mean_s - slope * mean_n
            if fixed >= 0:
                return fixed, slope
            return 0.0, mean_s / mean_n  # a line through the origin when the fit's intercept is negative
        return self.fixed_share * mean_s, (1 - self.fixed_share) * mean_s / mean_n

    def __call__(self, size: int) -> float:
        estimate = self.sizes().get(size)
        if estimate is not None:
            return estimate
        fixed, slope = self.line()
        return fixed + slope * size

    def sizes(self) -> dict[int, float]:
        """The estimate at every size seen."""
        if not self.means:
            return {}
        fixed, slope = self.line()
        on_line = {n: fixed + slope * n for n in self.means}
        figures = self.figures()  # what each size's mean stands for, and so the noise left in it
        distance = {n: self.means[n] / on_line[n] - 1 if on_line[n] > 0 else 0.0 for n in self.means}
        spread = sum(figures[n] * (distance[n] ** 2 - self.noise / figures[n]) for n in self.means)
        spread = max(0.0, spread / sum(figures.values()))
        estimates = {}
        for n in sorted(self.means):
            own = spread / (spread + self.noise / figures[n]) if spread > 0 else 0.0
            estimates[n] = on_line[n] * (1 + own * distance[n])
        return estimates


class BesideFit:
    """How much a forward costs more for the drafter drafting beside it: per size (positions), the
    seconds of a forward against the share of it spent beside drafting (0 in turn, 1 all through),
    s = V + share · G, by exponentially weighted least squares (weight `smoothing` for a new figure).

    G at a size is its own slope where its shares spread enough to tell (forwards in turn and beside,
    or beside one draft and beside several); elsewhere the pooled slowdown G / V over the sizes that
    tell, each weighted by how well it does, shrunk towards `prior` (worth `prior_weight` such sizes):
    where every forward runs beside about the same share, as at a fixed depth, the two ends cannot be
    told apart, and the prior says how far apart they are."""

    MIN_SPREAD = 0.01  # variance of a size's shares below which it does not tell its own slope

    def __init__(self, smoothing: float, prior: float, prior_weight: float = 1.0):
        self.smoothing, self.prior, self.prior_weight = smoothing, prior, prior_weight
        self._sums: dict[int, list[float]] = {}  # size -> weighted [n, Σ share, Σ s, Σ share², Σ share·s]

    def observe(self, size: int, share: float, seconds: float) -> None:
        keep = 1 - self.smoothing
        sums = [keep * x for x in self._sums.get(size, [0.0] * 5)]
        for i, x in enumerate((1.0, share, seconds, share * share, share * seconds)):
            sums[i] += x
        self._sums[size] = sums

    def _fit(self, size: int) -> tuple[float, float, float] | None:
        """(intercept, slope, weight: Σ w · variance of the shares) at `size`, where its shares spread."""
        sums = self._sums.get(size)
        if sums is None:
            return None
        n, share, seconds, square, product = sums
        spread = square / n - (share / n) ** 2
        if spread < self.MIN_SPREAD:
            return None
        slope = (product / n - share * seconds / n**2) / spread
        return seconds / n - slope * share / n, slope, n * spread

    def slowdown(self) -> float:
        """G / V pooled over the sizes that tell, shrunk towards the prior; at least 0."""
        told = [fit for fit in map(self._fit, self._sums) if fit and fit[0] > 0]
        weight = self.prior_weight + sum(w for _, _, w in told)
        pooled = self.prior * self.prior_weight + sum(w * slope / intercept for intercept, slope, w in told)
        return max(0.0, pooled / weight)

    def gap(self, size: int, level: float) -> float:
        """G at `size`, seconds, at least 0: the pooled slowdown times `level` (the forward's cost in turn
        there), and where the size's own shares spread, its own slope, each as far as its figures tell
        (the size's own shrunk towards the pooled as a line's sizes are: CostLine)."""
        pooled = self.slowdown() * level
        fit = self._fit(size)
        if fit is None:
            return pooled
        _, slope, weight = fit
        return max(0.0, (weight * slope + self.prior_weight * pooled) / (weight + self.prior_weight))
