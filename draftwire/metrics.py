"""Prometheus metrics of a verifier (or a pool's front), made from its ServerStats at each scrape: one
source of counts for GetStats, `draftwire top` and the metrics.

The speculative-decoding counters carry vLLM's names under the `draftwire:` prefix, so dashboards made
for vLLM's spec-decode panels map over: `draftwire:spec_decode_num_drafts_total`,
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total`
(label `position`). Served by prometheus_client's HTTP server (`serve --metrics-port`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from draftwire.contract import BATCH_SECONDS_BUCKETS, BATCH_SIZE_BUCKETS
from draftwire.v1 import draftwire_pb2 as pb

P = "draftwire:"

_COUNTERS = (
    ("spec_decode_num_drafts", "drafts", "Verified proposals with at least one draft token."),
    ("spec_decode_num_draft_tokens", "draft_tokens", "Draft tokens the target verified."),
    ("spec_decode_num_accepted_tokens", "accepted_tokens", "Draft tokens accepted."),
    ("sessions", "sessions_opened", "Sessions opened (thin ones included)."),
    ("thin_sessions", "thin_sessions", "Sessions the verifier decoded itself (no edge draft)."),
    ("rounds", "rounds", "Rounds verified (stale proposals excluded)."),
    ("generated_tokens", "generated_tokens", "Tokens committed by verdicts."),
    ("round_positions", "round_positions", "Positions the target computed in rounds."),
    ("prefill_positions", "prefill_positions", "Positions the target computed to prefill prompts."),
    ("prefill_reused_positions", "reused_positions", "Prefill positions taken from kept caches."),
    ("stale_proposals", "stale_proposals", "Proposals answered stale."),
)
_GAUGES = (
    ("active_sessions", "active_sessions", "Sessions whose KV cache is held now."),
    ("kept_caches", "kept_caches", "Finished sessions' caches kept for a next turn."),
    ("kv_cache_bytes", "cache_bytes", "Memory held by KV caches, live and kept."),
    ("spec_decode_gamma_cap", "gamma_cap", "Most draft tokens a proposal should carry (lowered under load)."),
)


def families(stats: pb.ServerStats) -> Iterator:
    """The metric families of one ServerStats snapshot."""
    for name, field, doc in _COUNTERS:
        yield CounterMetricFamily(P + name, doc, value=getattr(stats, field))
    per_position = CounterMetricFamily(
        P + "spec_decode_num_accepted_tokens_per_pos",
        "Verified proposals whose draft token at this position (0-based) was accepted.",
        labels=["position"],
    )
    for position, count in enumerate(stats.accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position
    refusals = CounterMetricFamily(
        P + "refusals", "Sessions ended with a status other than OK, by status code.", labels=["code"]
    )
    for code, count in sorted(stats.refusals.items()):
        refusals.add_metric([code], count)
    yield refusals
    for name, field, doc in _GAUGES:
        yield GaugeMetricFamily(P + name, doc, value=getattr(stats, field))
    numerics = GaugeMetricFamily(
        P + "numerics_info",
        "1 for each numerics the verifier (or a pool's replicas) computes the target's logits with: dtype, "
        "kernel class, device, and whether the kernels are bit-exact (invariant).",
        labels=["dtype", "kernels", "device", "exact"],
    )
    for n in stats.numerics:
        numerics.add_metric([n.dtype, n.kernels, n.device, str(n.exact).lower()], 1)
    yield numerics
    yield _histogram(
        "engine_batch_seconds",
        "Duration of the target's forward passes (one per batch of sessions).",
        BATCH_SECONDS_BUCKETS,
        stats.batch_seconds_counts,
        stats.engine_seconds,
    )
    yield _histogram(
        "engine_batch_size",
        "Sessions verified together in one forward pass.",
        BATCH_SIZE_BUCKETS,
        stats.batch_size_counts,
        stats.engine_forwards,
    )


def _histogram(name: str, doc: str, bounds, counts, total: float) -> HistogramMetricFamily:
    counts = list(counts) or [0] * (len(bounds) + 1)
    cumulative, running = [], 0
    for bound, count in zip([*map(str, map(float, bounds)), "+Inf"], counts, strict=True):
        running += count
        cumulative.append((bound, running))
    return HistogramMetricFamily(P + name, doc, buckets=cumulative, sum_value=total)


class StatsCollector(Collector):
    """A prometheus_client collector over a function that returns the current ServerStats."""

    def __init__(self, snapshot: Callable[[], pb.ServerStats]):
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        yield from families(self.snapshot())
