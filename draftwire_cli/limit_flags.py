"""`draftwire serve`'s (and the pool's) limits: admission, stale rounds, lifetimes and drain, prefill beside
other sessions' rounds, thin sessions. Each default is its config dataclass field's (default_of)."""

from __future__ import annotations

import argparse

from draftwire_cli.flags import bounded, budget_mb, count, count_or_auto, default_of, positive, seconds, share
from verifier_service.admission import AdmissionConfig
from verifier_service.lifecycle import LifetimeConfig
from verifier_service.settings import BatchConfig, VerifierLimits


def add_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits, admission and drain (0: no limit)")
    g.add_argument(
        "--max-sessions",
        type=count,
        default=default_of(AdmissionConfig, "max_sessions"),
        help="sessions open at once",
    )
    g.add_argument(
        "--max-sessions-per-client",
        type=count_or_auto,
        default="auto",
        help="sessions one client (a token, a certificate or a peer address) holds at once; "
        "auto: a quarter of --max-sessions",
    )
    g.add_argument(
        "--sessions-per-minute",
        type=count,
        default=default_of(AdmissionConfig, "sessions_per_minute"),
        help="new sessions per client per minute",
    )
    g.add_argument(
        "--kv-budget-mb",
        type=budget_mb,
        default="auto",
        help="KV memory open sessions reserve (prompt + max new tokens each) and kept caches fill; "
        "auto: half the memory available at start",
    )
    g.add_argument(
        "--client-kv-share",
        type=share,
        default=default_of(AdmissionConfig, "client_kv_share"),
        help="of the KV budget, the most one client (a token, a certificate or a peer address) reserves",
    )
    _add_prefill_limits(g)
    _add_thin_limits(g)
    _add_stale_limits(g)
    _add_lifetimes(g)


def _add_stale_limits(g) -> None:
    """Stale proposals and refused opens: what one client may waste before it is cut off."""
    g.add_argument(
        "--max-stale-in-a-row",
        type=count,
        default=default_of(AdmissionConfig, "max_stale_in_a_row"),
        help="stale proposals in a row that end a session",
    )
    g.add_argument(
        "--max-stale-per-s",
        type=count,
        default=default_of(AdmissionConfig, "max_stale_per_s"),
        help="stale proposals per session per second",
    )
    g.add_argument(
        "--max-refused-opens-per-s",
        type=count,
        default=default_of(AdmissionConfig, "max_refused_opens_per_s"),
        help="opens of one client refused in a second before its next ones are refused unread (0: no limit)",
    )


def _add_lifetimes(g) -> None:
    """How long a session may stay silent or open, and how long a drain waits for it."""
    g.add_argument(
        "--idle-timeout-s",
        type=seconds,
        default=default_of(LifetimeConfig, "idle_timeout_s"),
        help="a session silent this long ends",
    )
    g.add_argument(
        "--max-session-age-s",
        type=seconds,
        default=default_of(LifetimeConfig, "max_age_s"),
        help="a session open this long ends",
    )
    g.add_argument(
        "--drain-timeout-s",
        type=seconds,
        default=default_of(LifetimeConfig, "drain_timeout_s"),
        help="on SIGTERM, running sessions may finish this long",
    )


def _add_prefill_limits(g) -> None:
    """Prefill bounded beside other sessions' rounds (verifier_service.batcher.BatchConfig)."""
    g.add_argument(
        "--max-prefill-positions",
        type=positive,
        default=default_of(BatchConfig, "max_prefill_positions"),
        help="prefill positions per engine batch; longer prefills run in chunks beside other rounds",
    )
    g.add_argument(
        "--prefill-share",
        type=bounded(float, 0, what="0 (off) or more"),
        default=default_of(BatchConfig, "prefill_share"),
        help="while other sessions are open, a batch's prefill takes at most this share of a round's "
        "time (measured), so rounds are not stuck behind long prompts",
    )
    g.add_argument(
        "--min-prefill-positions",
        type=bounded(float, 0, low_open=True, what="over 0"),
        default=default_of(BatchConfig, "min_prefill_positions"),
        help="while other sessions play rounds, the least prefill a batch of rounds carries on average, so "
        "a long prompt always advances; under 1, a position dearer than the share rides with some "
        "batches only (0.125: one in 8)",
    )
    g.add_argument(
        "--max-prefill-s",
        type=bounded(float, 0, what="0 (off) or more"),
        default=default_of(BatchConfig, "max_prefill_s"),
        help="while no session plays rounds, a batch of prefill takes about this long at most (measured), "
        "so a session that opens beside a long prompt waits about that long for its turn",
    )


def _add_thin_limits(g) -> None:
    """Thin sessions (the verifier decoding alone): whether at all, and how far ahead of the reader."""
    g.add_argument(
        "--no-thin-sessions",
        dest="thin_sessions",
        action="store_false",
        help="refuse thin sessions (the verifier decoding alone, a token a forward): thin clients, and "
        "edges that hand a session over where speculation does not pay (they send plain steps instead)",
    )
    g.add_argument(
        "--thin-read-ahead",
        type=positive,
        default=default_of(VerifierLimits, "read_ahead"),
        help="a thin session is decoded at most this many tokens past what its edge has read",
    )
