"""The edge app's HTTP server around aiohttp's: every error it answers itself is OpenAI-shaped JSON, and
connections that are slow to send a request are closed (slow-loris).

aiohttp answers a request it cannot parse (no Host header in HTTP/1.1, a bad request line) before any
handler or middleware sees it, in plain text, and logs a traceback; here it gets the API's error body,
logged in one line. A connection whose request (its head) has not arrived within `read_timeout_s`, or that
stays idle that long between requests, is closed (aiohttp's keep-alive timer, which also covers a
request's head arriving); a body that does not arrive in time is the app's to refuse (app._json).
"""

from __future__ import annotations

import json
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from edge_client.openai_api import error_body

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a request's head (and its body: app._json) must arrive within this


class _Handler(RequestHandler):
    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        text = " ".join(str(message or exc or "bad request").split())
        log.info("bad HTTP request from %s: %s", request.remote, text)
        if request.writer.output_size > 0:
            raise ConnectionError("the response was sent already: no error body can follow")
        body = json.dumps(error_body(f"bad HTTP request: {text}", status)).encode()
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response


class _Server(web.Server):
    __slots__ = ()

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """web.AppRunner with the handler above and the read timeout (aiohttp's keepalive_timeout)."""

    def __init__(self, app: web.Application, read_timeout_s: float = READ_TIMEOUT_S, **kwargs):
        # An unread body is drained (so the client reads the answer) for at most a second, not ten.
        kwargs.setdefault("lingering_time", 1.0)
        super().__init__(app, keepalive_timeout=read_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, making connections with _Handler
        return server
