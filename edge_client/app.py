"""`draftwire edge`: the device's local HTTP server (aiohttp). It holds one drafter and one gRPC channel
to the verifier and serves an OpenAI-compatible API (server-sent events when streaming), the web chat page
at `/`, and the conversations kept in SQLite (`edge_client.store`).

The rooms: the settings (`edge_client.config`), the link to the verifier (`link`), the routes (`routes`,
`conversations`), the requests' shapes (`openai_api`) and the responses' (`responses`), the replies'
generation (`replier`) and streaming (`replies`), the HTTP errors (`httpkit`) and metrics (`metrics`).
This module puts them together and serves them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import sys
from dataclasses import replace

from aiohttp import web

from edge_client import guard as guards
from edge_client import httpkit
from edge_client.config import EdgeConfig, default_store
from edge_client.conversations import Conversations
from edge_client.link import VerifierLink
from edge_client.metrics import METRICS, EdgeMetrics
from edge_client.replier import Replier
from edge_client.routes import Routes
from edge_client.store import Store
from edge_client.trust import UntrustedVerifier

__all__ = ["EdgeApp", "EdgeConfig", "default_store", "serve"]

log = logging.getLogger(__name__)


class EdgeApp:
    """The edge app's parts, built from one config, and the aiohttp application over them."""

    def __init__(self, config: EdgeConfig, drafter, draft_name: str = ""):
        """`drafter`: a LlamaDrafter, or for a thin device (config.drafting not EDGE) a VocabOnly."""
        self.config = config
        self.store = Store(config.store_path)
        self.metrics = EdgeMetrics()
        self.link = VerifierLink(config, drafter)
        self.replier = Replier(config, drafter, self.link, self.metrics)
        conversations = Conversations(self.store, config.defaults, self.replier)
        self.routes = Routes(config, draft_name, self.link, self.replier, self.metrics, conversations)

    @property
    def waiting(self) -> int:
        """Generations admitted and not finished (one runs, the rest wait their turn)."""
        return self.replier.waiting

    def web_app(self) -> web.Application:
        guard = self.config.guard
        app = web.Application(
            client_max_size=self.config.max_body, middlewares=[httpkit.errors, guards.middleware(guard)]
        )
        app[METRICS] = self.metrics
        app[httpkit.MAX_BODY] = self.config.max_body
        app.on_response_prepare.append(
            lambda request, response: guards.cors_headers(guard, request, response)
        )
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.add_routes(self.routes.table())
        return app

    async def _start(self, _app) -> None:
        self.link.start()

    async def _stop(self, _app) -> None:
        await self.link.close()
        self.store.close()
        self.replier.close()

    async def connect(self, timeout_s: float = 5.0):
        """Asks the verifier what it serves and checks the answer; returns its ModelInfo, or None when the
        verifier cannot be reached yet (checked then at the first request). Raises UntrustedVerifier."""
        return await self.link.connect(timeout_s)


async def serve(config: EdgeConfig, drafter, host: str, port: int, draft_name: str = "", ready=None) -> None:
    """Runs the edge server until cancelled; `ready(url, model)` is called once it listens (`model`: the
    target's name, None while the verifier cannot be reached).

    Raises draftwire.ports.PortInUse when something listens on host:port, guard.UnsafeBind for a
    non-loopback address without an API key (unless config.public_without_key), and
    trust.UntrustedVerifier when the verifier's ModelInfo does not hold up."""
    from draftwire.ports import PortInUse, check_free

    if not guards.is_loopback(host) and config.guard.api_key is None:
        if not config.public_without_key:
            raise guards.UnsafeBind(
                f"refusing to listen on {host} without an API key: any machine that reaches it could read "
                f"the conversations and use the verifier. Give --api-key-file FILE (or "
                f"${guards.API_KEY_ENV}), or --public-without-key to do it anyway"
            )
        log.warning("listening on %s WITHOUT an API key: anyone who can reach it can use it", host)
        print(
            f"draftwire edge: WARNING: listening on {host} without an API key; anyone who reaches this "
            "address can read the conversations and use the verifier",
            file=sys.stderr,
            flush=True,
        )
    config = replace(config, guard=replace(config.guard, bound_host=host))
    check_free(host, port)  # one process per port (no SO_REUSEPORT here either)
    edge = EdgeApp(config, drafter, draft_name)
    runner = httpkit.Runner(edge.web_app(), handle_signals=False)  # OpenAI-shaped errors, read timeouts
    await runner.setup()
    try:
        info = await edge.connect()  # a verifier whose ModelInfo does not hold up is refused here
    except UntrustedVerifier:
        await runner.cleanup()
        raise
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(port) from None
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}/"
    if ready is not None:
        ready(url, info.target.target_id if info is not None else None)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
