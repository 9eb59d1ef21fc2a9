"""Who may talk to the verifier: TLS (and mTLS) credentials, per-client tokens, and the caller's identity.

One server interceptor admits each call before its handler does any work: a caller names itself with a
token (`authorization: Bearer T`, looked up in a file of `client-name token` lines that is re-read when
it changes) or, under mTLS, with its certificate's subject CN. A pool's front speaks for its clients: it
holds the pool's secret and names the client it forwards. Health and reflection stay open. Handlers read
the admitted caller with `caller()`.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # method prefixes anyone may call
CLIENT_HEADER = "x-draftwire-client"  # the client a pool's front speaks for
ADMIN_HEADER = "x-draftwire-admin"  # "1" when that client is an admin


@dataclass(frozen=True)
class TlsConfig:
    """A server's TLS: its certificate chain and key (PEM), and the CA its clients' certificates must
    chain to (None: no client certificate asked for; given: mTLS)."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: Path, key: Path, client_ca: Path | None = None) -> TlsConfig:
        """Raises OSError when a file cannot be read."""
        return cls(cert.read_bytes(), key.read_bytes(), client_ca.read_bytes() if client_ca else None)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class AuthConfig:
    tokens_file: Path | None = None  # `client-name token [admin]` lines; re-read when it changes
    # A pool's replica: the front's secret. A caller holding it speaks for the client in CLIENT_HEADER.
    front_secret: str | None = None
    # Under mTLS, a client certificate's subject CN names the client when it sends no token.
    certificate_names: bool = True


@dataclass(frozen=True)
class Identity:
    name: str  # the client: sessions, kept caches and counters belong to it
    admin: bool = False  # may read the server-wide figures (GetStats)


ANYONE = Identity("", admin=True)  # every caller when authentication is off
_CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("draftwire_caller", default=ANYONE)


def caller() -> Identity:
    """The identity the interceptor admitted for the call being handled (ANYONE when auth is off)."""
    return _CALLER.get()


class BadTokenFile(ValueError):
    """A token file that cannot be read as `client-name token [admin]` lines."""


def parse_tokens(text: str) -> dict[str, Identity]:
    """sha256(token) -> identity, from the lines of a token file ('#' starts a comment).

    Raises BadTokenFile naming the first bad line, or a token given twice."""
    table: dict[str, Identity] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != "admin"):
            raise BadTokenFile(f"line {n}: expected `client-name token [admin]`")
        digest = _digest(fields[1])
        if digest in table:
            raise BadTokenFile(f"line {n}: this token is already given to {table[digest].name!r}")
        table[digest] = Identity(fields[0], admin=len(fields) == 3)
    return table


class TokenTable:
    """A token file, re-read on the first lookup after it changes (no restart needed); a change that
    does not parse is logged and the previous table kept."""

    def __init__(self, path: Path):
        """Raises OSError or BadTokenFile when the file cannot be read at start."""
        self.path = path
        self._stamp = self._stat()
        self._table = parse_tokens(path.read_text())

    def lookup(self, token: str) -> Identity | None:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self._table = parse_tokens(self.path.read_text())
                log.info("token file %s re-read: %d clients", self.path, len(self._table))
            except (OSError, BadTokenFile) as e:
                log.error("token file %s not re-read, keeping the previous tokens: %s", self.path, e)
        return self._table.get(_digest(token))

    def named(self, name: str) -> Identity:
        """A client known by name only (its certificate): admin if the file says so."""
        return next((i for i in self._table.values() if i.name == name), Identity(name))

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call or ends it with UNAUTHENTICATED before its handler runs; sets `caller()`."""

    def __init__(self, config: AuthConfig, mtls: bool):
        """Raises OSError or BadTokenFile for an unreadable token file."""
        self.tokens = TokenTable(config.tokens_file) if config.tokens_file else None
        self.front_secret = config.front_secret
        self.certificate_names = mtls and config.certificate_names

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        return _guarded(handler, self._admit)

    async def _admit(self, context) -> None:
        identity, why = self.identify(dict(context.invocation_metadata()), context.auth_context())
        if identity is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        _CALLER.set(identity)

    def identify(self, metadata: dict, auth_context: dict) -> tuple[Identity | None, str]:
        """The caller, or None and why not."""
        header = metadata.get("authorization", "")
        token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        if token and self.front_secret is not None and hmac.compare_digest(token, self.front_secret):
            return Identity(metadata.get(CLIENT_HEADER, ""), metadata.get(ADMIN_HEADER) == "1"), ""
        if token and self.tokens is not None:
            identity = self.tokens.lookup(token)
            return (identity, "") if identity else (None, "unknown token: this server does not know it")
        if self.certificate_names and (cn := auth_context.get("x509_common_name")):
            name = cn[0].decode()
            return (self.tokens.named(name) if self.tokens else Identity(name)), ""
        if token:
            return None, "this server takes no tokens from clients"
        return None, "no credentials: send a token (--token-file FILE, or DRAFTWIRE_TOKEN)"


def interceptors(auth: AuthConfig, tls: TlsConfig | None) -> list[AuthInterceptor]:
    """The server's interceptors: none when nothing asks who calls (no tokens, no mTLS, no front)."""
    mtls = tls is not None and tls.client_ca is not None
    if auth.tokens_file is None and auth.front_secret is None and not mtls:
        return []
    return [AuthInterceptor(auth, mtls)]


def _guarded(handler: grpc.RpcMethodHandler, admit) -> grpc.RpcMethodHandler:
    """The handler, its behaviour preceded by `admit(context)` (which may abort the call)."""
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(request, context):
            await admit(context)
            return await inner(request, context)

        return handler._replace(unary_unary=unary_unary)
    if handler.stream_stream and not inspect.isasyncgenfunction(handler.stream_stream):
        inner = handler.stream_stream  # writes its replies with context.write (the verifier's Session)

        async def stream_stream_writing(request_iterator, context):
            await admit(context)
            return await inner(request_iterator, context)

        return handler._replace(stream_stream=stream_stream_writing)
    if handler.stream_stream:
        inner = handler.stream_stream

        async def stream_stream(request_iterator, context):
            await admit(context)
            async for reply in inner(request_iterator, context):
                yield reply

        return handler._replace(stream_stream=stream_stream)
    if handler.unary_stream:
        inner = handler.unary_stream

        async def unary_stream(request, context):
            await admit(context)
            async for reply in inner(request, context):
                yield reply

        return handler._replace(unary_stream=unary_stream)
    inner = handler.stream_unary

    async def stream_unary(request_iterator, context):
        await admit(context)
        return await inner(request_iterator, context)

    return handler._replace(stream_unary=stream_unary)
