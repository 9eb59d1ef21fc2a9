"""The verifier's figures (ServerStats), declared once: how a pool's front combines its replicas' values,
and the Prometheus name and meaning of each (draftwire.metrics). A new counter is a ServerStats field, a
row here and its increment (a VerifierStats field of the same name is copied by the servicer)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stat:
    field: str  # the ServerStats field
    # How a pool's front combines its replicas' values: "sum" (lists element by element, maps by key),
    # "min" (the lowest set), "union" (each distinct identity once), "ratio" (computed from the sums).
    pool: str
    metric: str = ""  # Prometheus: "counter" or "gauge" under `name` (draftwire: prefix), "" if not one
    name: str = ""  # the metric's name; empty: the field's
    doc: str = ""  # the metric's help


def _counter(field: str, doc: str, name: str = "") -> Stat:
    return Stat(field, "sum", "counter", name or field, doc)


def _gauge(field: str, doc: str, name: str = "", pool: str = "sum") -> Stat:
    return Stat(field, pool, "gauge", name or field, doc)


STATS = (
    _gauge("active_sessions", "Sessions whose KV cache is held now."),
    _counter("sessions_opened", "Sessions opened (thin ones included).", "sessions"),
    _counter("rounds", "Rounds verified (stale proposals excluded)."),
    _counter("generated_tokens", "Tokens committed by verdicts."),
    _counter("round_positions", "Positions the target computed in rounds."),
    _counter("prefill_positions", "Positions the target computed to prefill prompts."),
    Stat("target_positions_per_token", "ratio"),  # round_positions / generated_tokens
    Stat("engine_batches", "sum"),  # the engine_batch_* histograms' counts
    Stat("engine_forwards", "sum"),  # the engine_batch_size histogram's sum
    Stat("engine_seconds", "sum"),  # the engine_batch_seconds histogram's sum
    _counter("reused_positions", "Prefill positions taken from kept caches.", "prefill_reused_positions"),
    _gauge("kept_caches", "Finished sessions' caches kept for a next turn."),
    _gauge("cache_bytes", "Memory held by KV caches, live and kept.", "kv_cache_bytes"),
    # Speculation under vLLM's names, so that dashboards made for its spec-decode panels map over.
    _counter("drafts", "Verified proposals with at least one draft token.", "spec_decode_num_drafts"),
    _counter("draft_tokens", "Draft tokens the target verified.", "spec_decode_num_draft_tokens"),
    _counter("accepted_tokens", "Draft tokens accepted.", "spec_decode_num_accepted_tokens"),
    Stat("accepted_per_position", "sum"),  # spec_decode_num_accepted_tokens_per_pos, by position
    _counter("stale_proposals", "Proposals answered stale."),
    Stat("refusals", "sum"),  # draftwire:refusals, by status code
    Stat("batch_seconds_counts", "sum"),  # the engine_batch_seconds histogram
    Stat("batch_size_counts", "sum"),  # the engine_batch_size histogram
    _counter("thin_sessions", "Sessions the verifier decoded itself (no edge draft)."),
    _gauge(
        "gamma_cap",
        "Most draft tokens a proposal should carry (lowered under load).",
        "spec_decode_gamma_cap",
        pool="min",  # the tightest replica's
    ),
    Stat("numerics", "union"),  # draftwire:numerics_info; a pool lists each distinct identity once
    _counter("plain_steps", "Edge rounds of no draft token: speculation off where it does not pay."),
    _counter("handoffs", "Thin sessions an edge handed over: speculation off, the verifier decoding."),
    _counter("forced_tokens", "Tokens a constraint forced, committed with no draft step."),
)
