"""Who may talk to the edge app. It runs on a person's machine, holds their conversations and the device's
verifier credentials, and a browser will send it whatever any web page asks, so by default:

- the Host header must name this machine: a loopback name or address, the address the connection came in
  on, or one of `allowed_hosts` (a DNS-rebinding page's Host is its own name, and is refused, 403);
- a request carrying an Origin must come from the page's own origin or one of `allowed_origins` (403),
  and only those get CORS headers and an answered preflight;
- a JSON route takes only a JSON body (`Content-Type: application/json`, else 415), so no "simple"
  cross-origin form or text/plain request reaches a handler;
- with an API key, every route but the page, its static files and /health needs
  `Authorization: Bearer KEY` (401), as OpenAI's API does.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from edge_client.openai_api import ApiError

API_KEY_ENV = "DRAFTWIRE_EDGE_API_KEY"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "127.0.0.1", "::1"})
OPEN_PATHS = ("/", "/favicon.ico", "/health")  # and /static/...: the page, its icon, the liveness probe
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"


class UnsafeBind(Exception):
    """Listening beyond loopback without an API key, and not asked to."""


@dataclass(frozen=True)
class Guard:
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # "*": any
    allowed_origins: tuple[str, ...] = ()  # "*": any
    api_key: str | None = None

    def host_allowed(self, request: web.Request) -> bool:
        if "*" in self.allowed_hosts:
            return True
        host = _hostname(request.host)
        if host is None:
            return False
        if host in LOOPBACK_NAMES or host.endswith(".localhost") or host == self.bound_host.lower():
            return True
        if host in (h.lower() for h in self.allowed_hosts):
            return True
        with _suppress_value():  # an address literal: loopback, or the one the connection came in on
            address = ipaddress.ip_address(host)
            if address.is_loopback:
                return True
            sockname = request.transport.get_extra_info("sockname") if request.transport else None
            if sockname and ipaddress.ip_address(sockname[0].split("%")[0]) == address:
                return True
        return False

    def origin_allowed(self, request: web.Request, origin: str) -> bool:
        own = f"{request.scheme}://{request.host}"
        return origin.lower() == own.lower() or self.cross_origin_allowed(origin)

    def cross_origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin.lower().rstrip("/") in (
            o.lower().rstrip("/") for o in self.allowed_origins
        )

    def key_ok(self, request: web.Request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given = given.strip().encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.api_key.encode())


class _suppress_value:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, ValueError)


def _hostname(host: str | None) -> str | None:
    """The name in a Host header, without its port; None when there is none."""
    if not host:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    if host.count(":") == 1:
        host = host.split(":")[0]
    return host or None


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_api_key(path: Path | None, environ=os.environ) -> str | None:
    """The API key from a file (its first line) or $DRAFTWIRE_EDGE_API_KEY; None when neither gives one.
    Never from the command line, where `ps` shows it to every user of the machine."""
    if path is not None:
        key = Path(path).read_text(encoding="utf-8").strip().splitlines()
        if not key or not key[0].strip():
            raise ValueError(f"{path} holds no API key")
        return key[0].strip()
    return environ.get(API_KEY_ENV) or None


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or (
        content_type.startswith("application/") and content_type.endswith("+json")
    )


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith("/static/")


def middleware(guard: Guard, json_routes: Iterable[str] = ("/v1/", "/api/")):
    prefixes = tuple(json_routes)

    @web.middleware
    async def guarded(request: web.Request, handler):
        if not guard.host_allowed(request):
            raise ApiError(403, f"the Host {request.host!r} is not allowed", code="host_not_allowed")
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS":  # a CORS preflight: answered for allowed origins only
            if origin is None or not guard.origin_allowed(request, origin):
                raise ApiError(403, f"the origin {origin!r} is not allowed", code="origin_not_allowed")
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Origin": origin,
                    "Access-Control-Allow-Methods": CORS_METHODS,
                    "Access-Control-Allow-Headers": CORS_HEADERS,
                    "Access-Control-Max-Age": "600",
                    "Vary": "Origin",
                },
            )
        if origin is not None and not guard.origin_allowed(request, origin):
            raise ApiError(403, f"the origin {origin!r} is not allowed", code="origin_not_allowed")
        if (
            origin is None
            and request.method not in ("GET", "HEAD")
            and request.headers.get("Sec-Fetch-Site") in ("cross-site", "same-site")
        ):
            raise ApiError(403, "cross-site requests are not allowed", code="origin_not_allowed")
        if not _open(request.path) and not guard.key_ok(request):
            raise ApiError(
                401,
                "a valid API key is needed: Authorization: Bearer KEY",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if (
            request.method in ("POST", "PUT", "PATCH")
            and request.path.startswith(prefixes)
            and (request.can_read_body or request.content_type != "application/octet-stream")
            and not _is_json(request.content_type)
        ):
            raise ApiError(
                415, f"the body must be JSON (Content-Type: application/json), not {request.content_type}"
            )
        return await handler(request)

    return guarded


async def cors_headers(guard: Guard, request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed other origin may read the response."""
    origin = request.headers.get("Origin")
    if origin is not None and guard.cross_origin_allowed(origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")
