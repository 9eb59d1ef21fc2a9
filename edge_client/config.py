"""The edge app's settings (`draftwire edge`), built once at the entry point and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from draftwire import wire
from draftwire.contract import Drafting
from edge_client import guard as guards
from edge_client.openai_api import Settings

# A reply that has shown nothing: the verifier connected, and the session opened, within this (else 503).
CONNECT_WITHIN_S = 1.5


def default_store() -> Path:
    """Where `draftwire edge` keeps conversations: $XDG_DATA_HOME/draftwire/edge.sqlite3."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "draftwire" / "edge.sqlite3"


@dataclass(frozen=True)
class EdgeConfig:
    server: str  # the verifier's HOST:PORT
    gamma: int | None = None  # draft tokens per round; None: chosen online (edge_client.adaptive)
    pipeline: int | None = None  # proposals sent ahead of their verdicts; None: chosen online
    defaults: Settings = Settings()
    store_path: Path | str = ":memory:"
    # EDGE: the device drafts. NONE or NGRAM: a thin device (no draft model, only its vocabulary): the
    # verifier decodes, alone or with its prompt-lookup drafts.
    drafting: Drafting = Drafting.EDGE
    credentials: wire.ClientCredentials = wire.PLAINTEXT  # TLS, client certificate, token to the verifier
    guard: guards.Guard = guards.Guard()  # Host, Origin and API key checks (edge_client.guard)
    max_body: int = 1 << 20  # bytes of a request body
    max_waiting: int = 8  # generations waiting behind the running one; more get 429
    model_aliases: tuple[str, ...] = ()  # names a request's `model` may give besides the target's own
    template_time_s: float = 2.0  # a chat template's render
    public_without_key: bool = False  # listen on a non-loopback address without an API key (warned)
