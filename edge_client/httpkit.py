"""The edge app's HTTP server around aiohttp's: every error it answers itself is OpenAI-shaped JSON, and
connections that are slow to send a request are closed (slow-loris).

aiohttp answers a request it cannot parse (no Host header in HTTP/1.1, a bad request line) before any
handler or middleware sees it, in plain text, and logs a traceback; here it gets the API's error body,
logged in one line. A connection whose request (its head) has not arrived within `read_timeout_s`, or that
stays idle that long between requests, is closed (aiohttp's keep-alive timer, which also covers a
request's head arriving); a body that does not arrive in time is refused by read_json (408). The `errors`
middleware answers the app's own failures the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from edge_client.inbox import VerifierError
from edge_client.metrics import METRICS
from edge_client.openai_api import ApiError, BadRequest
from edge_client.responses import HTTP_STATUS, error_body
from edge_client.store import NotFound

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a request's head (and its body: read_json) must arrive within this
MAX_BODY = web.AppKey("max_body", int)  # the app's limit on a request body, said in its 413


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


async def read_json(request: web.Request) -> dict:
    """The request's body as a JSON object; raises ApiError 408 (it did not arrive in time) or BadRequest."""
    try:  # at most client_max_size (413 past it), within the read timeout (a slow-loris body: 408)
        async with asyncio.timeout(READ_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        message = f"the request body did not arrive within {READ_TIMEOUT_S:g} s"
        raise ApiError(408, message, code="request_timeout") from None
    try:
        body = json.loads(raw, parse_constant=_not_json)
        # A \ud800 escape parses to a lone surrogate, which no text can hold (SQLite, the tokenizer).
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest(
            "the request body is not valid JSON (UTF-8 text, no NaN or lone surrogates)"
        ) from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


@web.middleware
async def errors(request: web.Request, handler):
    """OpenAI-shaped errors with the right status: 400 for bad input (the verifier's INVALID_ARGUMENT with
    its message), 404 for an unknown conversation, 503 when the verifier cannot be reached."""
    response = await _answer_errors(request, handler)
    if response.status >= 400:
        request.app[METRICS].errors.labels(str(response.status)).inc()
    return response


async def _answer_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response(error_body(str(e), 400, e.param, e.code), status=400)
    except ApiError as e:
        return web.json_response(
            error_body(str(e), e.status, e.param, e.code), status=e.status, headers=e.headers
        )
    except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 ...; answered as JSON too
        if e.status < 400:
            raise
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"the request body is larger than the limit of {request.app[MAX_BODY]} bytes",
        }.get(e.status, e.reason)
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return web.json_response(error_body(message, e.status, code=code), status=e.status, headers=headers)
    except NotFound as e:
        return web.json_response(
            error_body(f"no conversation {e.args[0]}", 404, code="not_found"), status=404
        )
    except VerifierError as e:
        status = HTTP_STATUS.get(e.code, 502)
        message = e.details
        if status == 503:
            message = f"the verifier is unavailable: {e.details}"
        return web.json_response(error_body(message, status, code=e.code.name.lower()), status=status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # a bug: logged with its traceback, and still an OpenAI-shaped answer
        log.exception("unexpected failure on %s %s", request.method, request.path)
        return web.json_response(error_body("internal error (logged by the edge)", 500), status=500)
