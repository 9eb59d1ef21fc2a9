"""Prometheus metrics of a verifier (or a pool's front), made from its ServerStats at each scrape: one
source of counts for GetStats, `draftwire top` and the metrics.

The speculative-decoding counters carry vLLM's names under the `draftwire:` prefix, so dashboards made
for vLLM's spec-decode panels map over: `draftwire:spec_decode_num_drafts_total`,
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total`
(label `position`). Served over plain HTTP by `serve` below (`serve --metrics-port`): loopback unless
`--metrics-host` names an address, optionally behind a bearer token (`--metrics-token-file`). Every name,
with its meaning: docs/metrics.md.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from draftwire.contract import BATCH_SECONDS_BUCKETS, BATCH_SIZE_BUCKETS
from draftwire.counters import STATS
from draftwire.v1 import draftwire_pb2 as pb

P = "draftwire:"


def families(stats: pb.ServerStats) -> Iterator:
    """The metric families of one ServerStats snapshot."""
    for stat in STATS:
        if stat.metric:
            family = CounterMetricFamily if stat.metric == "counter" else GaugeMetricFamily
            yield family(P + stat.name, stat.doc, value=getattr(stats, stat.field))
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


def auth_families(token_file_ok: bool | None, token_file_failures: int, revoked_sessions: int) -> Iterator:
    """Authentication's metric families: the token file's state (none when there is no token file), the
    re-reads that found it broken, and the sessions ended because their credentials were revoked."""
    if token_file_ok is not None:
        yield GaugeMetricFamily(
            P + "auth_token_file_ok",
            "1 while the token file parses; 0 while it is missing or does not parse (every client refused).",
            value=int(token_file_ok),
        )
        yield CounterMetricFamily(
            P + "auth_token_file_failures",
            "Re-reads of the token file that found it missing or unparsable.",
            value=token_file_failures,
        )
    yield CounterMetricFamily(
        P + "auth_revoked_sessions",
        "Open sessions ended because their token or certificate name was revoked (or the token file broke).",
        value=revoked_sessions,
    )


class StatsCollector(Collector):
    """A prometheus_client collector over a function that returns the current ServerStats, and one that
    returns more metric families (`extra`, when given)."""

    def __init__(self, snapshot: Callable[[], pb.ServerStats], extra: Callable[[], Iterator] | None = None):
        self.snapshot, self.extra = snapshot, extra

    def collect(self) -> Iterator:
        yield from families(self.snapshot())
        if self.extra is not None:
            yield from self.extra()


log = logging.getLogger(__name__)

EMPTY_HOST = (
    'an empty --metrics-host would listen on every interface: say "0.0.0.0" (or "::") if that is meant, '
    "and give the metrics a token (--metrics-token-file)"
)


def read_token(path: Path) -> str:
    """The bearer token in `path` (its first line). Raises OSError when unreadable, ValueError when empty."""
    token = path.read_text().strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"{path}: a metrics token file holds one token on one line")
    return token


READ_TIMEOUT_S = 10.0  # a scrape's request must arrive within this (slow-loris), else its connection closes


def host_allowed(header: str | None, bound_host: str) -> bool:
    """Whether a scrape's Host header names this server as a DNS-rebinding page cannot: a loopback
    name, an IP address (a rebound page's Host is its own name), or the host the server was bound to."""
    if not header:
        return False
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.split(":")[0]
    if name in ("localhost", "localhost.") or name.endswith(".localhost") or name == bound_host.lower():
        return bool(name)
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def serve(registry: CollectorRegistry, host: str, port: int, token_file: Path | None = None) -> int:
    """Serves `registry` in Prometheus' text format over HTTP at host:port (any path; 0 picks a free
    port) on a daemon thread; returns the bound port. With `token_file`, a scrape without
    `Authorization: Bearer T` (T the file's token, re-read at each scrape) gets 401, and 503 while the
    file cannot be read; without one, a scrape whose Host is not an address or a loopback name gets 403
    (host_allowed: a DNS-rebinding page cannot read the metrics). A connection that does not send its
    request within READ_TIMEOUT_S is closed. Raises OSError when it cannot bind."""

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # on the socket: a slow-loris request is dropped

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if token_file is None and not host_allowed(self.headers.get("Host"), host):
                return self._reply(403, b"the Host header must be an address or a loopback name\n")
            if token_file is not None:
                try:
                    token = read_token(token_file)
                except (OSError, ValueError) as e:
                    log.error("metrics token file %s cannot be read: %s; scrapes refused", token_file, e)
                    return self._reply(503, b"the metrics token file cannot be read\n")
                sent = self.headers.get("Authorization", "")
                if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                    return self._reply(401, b"send Authorization: Bearer <the metrics token>\n", bearer=True)
            self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _reply(self, code: int, body: bytes, content_type="text/plain; charset=utf-8", bearer=False):
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if bearer:
                self.send_header("WWW-Authenticate", 'Bearer realm="draftwire metrics"')
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # no line per scrape on stderr
            pass

    server_class = type("MetricsServer", (ThreadingHTTPServer,), {"daemon_threads": True})
    if ":" in host:
        import socket

        server_class.address_family = socket.AF_INET6
    httpd = server_class((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd.server_address[1]
