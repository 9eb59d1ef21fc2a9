"""The edge app's Prometheus metrics at /metrics: its replies, as the edge sees them (the verifier's own
are on its --metrics-port). The speculation counters carry vLLM's names, like the verifier's."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from edge_client.replies import Outcome


class EdgeMetrics:
    """The app's counters and its time-to-first-token histogram, in a registry of their own."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        r, p = self.registry, "draftwire:"
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verified proposals.", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.generated = Counter(p + "edge_generated_tokens", "Tokens of the replies.", registry=r)
        self.replies = Counter(p + "edge_replies", "Replies by finish reason.", ["finish_reason"], registry=r)
        self.errors = Counter(
            p + "edge_errors", "Requests answered with an error, by HTTP status.", ["status"], registry=r
        )
        self.ttft = Histogram(
            p + "edge_time_to_first_token_seconds",
            "From a reply's start to its first verified token.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )

    def reply(self, outcome: Outcome) -> None:
        stats = outcome.stats
        self.drafts.inc(stats.rounds)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.generated.inc(len(outcome.generated))
        self.replies.labels(outcome.finish_reason).inc()
        if stats.first_token_s is not None:
            self.ttft.observe(stats.first_token_s)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


METRICS = web.AppKey("metrics", EdgeMetrics)
