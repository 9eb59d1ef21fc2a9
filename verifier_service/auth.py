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
from collections.abc import Callable
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


NO_TOKEN = "-"  # in a token file's token column: the client is admitted by its certificate only


@dataclass(frozen=True)
class Clients:
    """What a token file admits: clients by token, and every listed name (the names a client
    certificate's CN may carry under mTLS)."""

    tokens: dict[str, Identity]  # sha256(token) -> identity
    names: dict[str, Identity]  # every listed client, admin if one of its lines says so


def read_clients(text: str) -> Clients:
    """The clients of a token file: `client-name token [admin]` lines ('#' starts a comment), where a
    token of `-` lists a client that only its certificate names (mTLS).

    Raises BadTokenFile naming the first bad line, or a token given twice."""
    tokens: dict[str, Identity] = {}
    names: dict[str, Identity] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) not in (2, 3) or (len(fields) == 3 and fields[2] != "admin"):
            raise BadTokenFile(f"line {n}: expected `client-name token [admin]`")
        identity = Identity(fields[0], admin=len(fields) == 3)
        names[identity.name] = Identity(
            identity.name, identity.admin or names.get(identity.name, identity).admin
        )
        if fields[1] == NO_TOKEN:
            continue
        digest = _digest(fields[1])
        if digest in tokens:
            raise BadTokenFile(f"line {n}: this token is already given to {tokens[digest].name!r}")
        tokens[digest] = identity
    return Clients(tokens, names)


def parse_tokens(text: str) -> dict[str, Identity]:
    """sha256(token) -> identity, from the lines of a token file (read_clients).

    Raises BadTokenFile naming the first bad line, or a token given twice."""
    return read_clients(text).tokens


class TokenTable:
    """A token file, re-read on the first lookup after it changes (no restart needed).

    Fails closed: while the file does not parse or is missing, nobody is admitted (`error` says why,
    `failures` counts the re-reads that failed) and open sessions end at their next check; once the
    file is fixed, admission resumes."""

    def __init__(self, path: Path):
        """Raises OSError or BadTokenFile when the file cannot be read at start."""
        self.path = path
        self._stamp = self._stat()
        self._clients = read_clients(path.read_text())
        self.error: str | None = None  # why nobody is admitted now (None: the file is good)
        self.failures = 0  # re-reads that found the file missing or unparsable

    def refresh(self) -> None:
        """Re-reads the file if it changed since the last read (its mtime, size or inode)."""
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            clients = read_clients(self.path.read_text())
        except (OSError, BadTokenFile) as e:
            self._clients = Clients({}, {})
            self.failures += 1
            self.error = (
                f"the verifier's token file cannot be read ({e}): it admits nobody until the file is fixed"
            )
            log.error("token file %s: %s; every client is refused until it is fixed", self.path, e)
            return
        if self.error is not None:
            log.warning("token file %s fixed: admitting clients again", self.path)
        self._clients, self.error = clients, None
        log.info("token file %s re-read: %d clients", self.path, len(clients.names))

    def lookup(self, token: str) -> Identity | None:
        """The client holding `token` (None: no client, or the file is broken)."""
        self.refresh()
        return self._clients.tokens.get(_digest(token))

    def holds(self, digest: str, name: str) -> bool:
        """Whether the token with this digest still names client `name` (no refresh)."""
        identity = self._clients.tokens.get(digest)
        return identity is not None and identity.name == name

    def listed(self, name: str) -> Identity | None:
        """A client known by name (its certificate), as the file lists it (None: not listed)."""
        self.refresh()
        return self._clients.names.get(name)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Refusal:
    """Why a caller is not, or no longer, admitted: the status it gets and what it says."""

    code: grpc.StatusCode
    message: str


REVOKED = "the credentials this session was admitted with were revoked (no longer in the token file)"

Recheck = Callable[[], Refusal | None]
_RECHECK: contextvars.ContextVar[Recheck | None] = contextvars.ContextVar("draftwire_recheck", default=None)


def recheck() -> Recheck | None:
    """For the call being handled: a function that says whether the credentials it was admitted with
    still admit it now (None: they do; a Refusal: revoked, or the token file broke). None when nothing
    can be revoked (no token file, the pool's front)."""
    return _RECHECK.get()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a call or ends it with UNAUTHENTICATED (UNAVAILABLE while the token file is broken)
    before its handler runs; sets `caller()` and `recheck()`.

    With a token file, every identity must be listed there: a token's client, and a certificate's CN
    (a `name -` line lists a client that only its certificate names), so that either can be revoked."""

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
        identity, refusal, again = self.check_in(dict(context.invocation_metadata()), context.auth_context())
        if identity is None:
            await context.abort(refusal.code, refusal.message)
        _CALLER.set(identity)
        _RECHECK.set(again)

    def check_in(
        self, metadata: dict, auth_context: dict
    ) -> tuple[Identity | None, Refusal | None, Recheck | None]:
        """The caller and how to recheck it later, or None and why it is refused."""
        header = metadata.get("authorization", "")
        token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        if token and self.front_secret is not None and hmac.compare_digest(token, self.front_secret):
            return Identity(metadata.get(CLIENT_HEADER, ""), metadata.get(ADMIN_HEADER) == "1"), None, None
        cn = auth_context.get("x509_common_name") if self.certificate_names else None
        if self.tokens is not None and (token or cn):
            self.tokens.refresh()
            if self.tokens.error is not None:
                return None, Refusal(grpc.StatusCode.UNAVAILABLE, self.tokens.error), None
        if token and self.tokens is not None:
            identity = self.tokens.lookup(token)
            if identity is None:
                why = "unknown token: this server does not know it (mistyped, or revoked)"
                return None, Refusal(grpc.StatusCode.UNAUTHENTICATED, why), None
            digest = _digest(token)
            return identity, None, lambda: self._still(lambda: self.tokens.holds(digest, identity.name))
        if cn:
            name = cn[0].decode()
            if self.tokens is None:
                return Identity(name), None, None
            identity = self.tokens.listed(name)
            if identity is None:
                why = f"certificate name {name!r} is not in the verifier's token file (unknown, or revoked)"
                return None, Refusal(grpc.StatusCode.UNAUTHENTICATED, why), None
            return identity, None, lambda: self._still(lambda: self.tokens.listed(name) is not None)
        if token:
            why = "this server takes no tokens from clients"
        else:
            why = "no credentials: send a token (--token-file FILE, or DRAFTWIRE_TOKEN)"
        return None, Refusal(grpc.StatusCode.UNAUTHENTICATED, why), None

    def _still(self, holds: Callable[[], bool]) -> Refusal | None:
        self.tokens.refresh()
        if self.tokens.error is not None:
            return Refusal(grpc.StatusCode.UNAVAILABLE, self.tokens.error)
        return None if holds() else Refusal(grpc.StatusCode.UNAUTHENTICATED, REVOKED)


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
