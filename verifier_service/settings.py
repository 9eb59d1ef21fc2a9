"""The verifier's settings, torch-free: what `draftwire serve` builds from its flags, whose defaults are
these fields' (draftwire_cli.flags.default_of), so each is written once."""

from __future__ import annotations

from dataclasses import dataclass

SERVE_PREFIX_CACHE_BYTES = 1 << 30  # `serve` keeps finished caches in 1 GiB; a bare engine keeps none


@dataclass(frozen=True)
class VerifierLimits:
    max_gamma: int = 16  # most draft tokens per proposal
    # A proposal of no draft token is a plain step (the target's next token): the edge's fallback where
    # speculation does not pay (edge_client.adaptive), and the thin sessions' and reference's rounds.
    min_gamma: int = 0
    max_stop_token_ids: int = 256  # stop ids an open may name (every other repeated field is bounded too)
    # A thin session is decoded at most this many tokens (plus one round) past what its edge has read
    # (its last Read): one whose edge reads nothing costs the engine a bounded share, then waits.
    read_ahead: int = 64
    # Thin sessions at all: an operator may keep the engine for edges that draft (each thin token is a
    # forward); edges then speculate, and fall back to plain steps where speculation does not pay.
    thin_sessions: bool = True


@dataclass(frozen=True)
class BatchConfig:
    max_batch: int = 32  # most sessions in one forward pass
    # Before a batch starts, wait for the open sessions that have no forward queued yet, at most
    # window_s and at most window_fraction of the last batch's duration; 0 batches only what queued.
    window_s: float = 0.01
    window_fraction: float = 0.5
    # Prefill positions one batch runs, all sessions together; a longer prefill runs in chunks over
    # the next batches, so that other sessions' rounds never wait behind it. 0: whole prefills.
    max_prefill_positions: int = 256
    # While other sessions play rounds, prefill rides with their rounds, and a batch with a prefill chunk
    # aims to take at most (1 + prefill_share) × the rounds' time alone: the chunk is what the share of
    # the rounds' time pays for at a prefill position's cost measured in the batch before (`_resize`;
    # on average at least min_prefill_positions, so a prompt always advances). Measured afresh each
    # batch, since a position's cost grows with its context (its attention): a rate learned early in a
    # long prompt would overshoot late in it. 0: off.
    prefill_share: float = 0.5
    # The least prefill a batch of rounds carries on average, so that a prompt always advances. Under 1,
    # a position rides with some batches and not others: where one position costs more than the share of
    # a round pays for (at 5,000 of context on a CPU, half a round to a whole one), the rounds pay the
    # share on average, and most of them carry no prefill at all. 0.125: a position every 8 batches.
    min_prefill_positions: float = 0.125
    # While no session plays rounds, a batch of prefill alone aims to take at most this long, so that a
    # session opening meanwhile waits about that long for its own prefill, not for a chunk of
    # max_prefill_positions at long context (seconds on a CPU). Sized like the share above, up to
    # max_prefill_positions. 0: positions only.
    max_prefill_s: float = 0.5
    # A verifier times a forward of every size a round can have as it starts (Batcher.calibrate), so that
    # its first sessions' edges learn its costs from the open (SessionOpened.forward_seconds).
    calibrate: bool = True
    # Where those timings are kept between starts, by target, numerics, torch threads and CPU (a
    # directory; "": timed at every start). A later start, on a busy machine too, reads them instead,
    # and the rounds it serves correct them as they go.
    calibration_dir: str = ""


@dataclass(frozen=True)
class PrefixCacheConfig:
    """How long finished sessions' caches are kept for new sessions that extend them."""

    budget_bytes: int = 0  # most memory the kept caches hold together; 0 keeps none
    ttl_s: float = 600.0  # a kept cache unused this long is dropped
