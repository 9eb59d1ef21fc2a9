"""The edge app's link to its verifier: the channel and the EdgeSession over it, the verifier's ModelInfo
as checked (edge_client.trust), whether it connects, and its health, cached."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwire import wire
from draftwire.aio import within
from draftwire.contract import Drafting
from edge_client.config import CONNECT_WITHIN_S, EdgeConfig
from edge_client.openai_api import ApiError
from edge_client.session import EdgeSession, Timeouts, VerifierError
from edge_client.trust import UntrustedVerifier, check_model_info

log = logging.getLogger(__name__)
HEALTH_TTL_S = 1.0


class VerifierLink:
    """One verifier, as the edge app reaches it."""

    def __init__(self, config: EdgeConfig, drafter):
        """`drafter`: a LlamaDrafter, or for a thin device (config.drafting not EDGE) a VocabOnly."""
        self.server = config.server
        self.config = config
        self.drafter = drafter
        self.channel: grpc.aio.Channel | None = None
        self.session: EdgeSession | None = None
        self._checked_info = None
        self._health: tuple | None = None  # (when, body, status) of the last check
        self._health_lock = asyncio.Lock()
        self._health_task: asyncio.Task | None = None  # a check running in the background

    def start(self) -> None:
        """Opens the channel and the session, and starts the first health check."""
        self.channel = wire.channel(self.server, self.config.credentials)
        drafter = self.drafter if self.config.drafting is Drafting.EDGE else None
        # A reply that has shown nothing gets its 503 at once (as connected's), not after the resume
        # budget: the channel may still read READY a moment after its verifier went away.
        timeouts = Timeouts(start_s=CONNECT_WITHIN_S)
        self.session = EdgeSession(self.channel, drafter, timeouts, vocabulary=self.drafter.vocabulary)
        self._health_task = asyncio.get_running_loop().create_task(self._refresh_health())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.channel.close()

    async def connect(self, timeout_s: float = 5.0):
        """Asks the verifier what it serves and checks the answer; returns its ModelInfo, or None when the
        verifier cannot be reached yet (checked then at the first request). Raises UntrustedVerifier."""
        try:
            return await within(self.info(log_refusal=False), timeout_s)  # the caller says a refusal
        except (VerifierError, TimeoutError):
            return None
        except ApiError as e:
            raise UntrustedVerifier(str(e)) from None

    def vocab_size(self) -> int | None:
        """The draft's vocabulary size (None: the drafter has none)."""
        vocabulary = getattr(self.drafter, "vocabulary", None)
        return vocabulary.size if vocabulary is not None else None

    async def info(self, log_refusal: bool = True):
        """The verifier's ModelInfo, checked (edge_client.trust): one that does not hold up is refused
        (502, with the reason; logged unless `log_refusal` is false), and nothing of it is used."""
        try:
            info = await self.session.model_info()
        except grpc.aio.AioRpcError as e:
            raise VerifierError(e.code(), e.details() or "") from None
        if info is not self._checked_info:
            try:
                check_model_info(info, self.vocab_size())
            except UntrustedVerifier as e:
                self.session.forget_model_info()  # asked again next time (the verifier may be replaced)
                if log_refusal:
                    log.error("refusing the verifier %s: %s", self.server, e)
                raise ApiError(
                    502, f"refusing the verifier {self.server}: {e}", code="bad_verifier"
                ) from None
            self._checked_info = info
        return info

    async def connected(self, within_s: float = CONNECT_WITHIN_S) -> None:
        """Raises VerifierError(UNAVAILABLE) unless the channel is (or gets, within `within_s`) connected:
        a request that would commit nothing gets its 503 at once, not after the resume budget, which is
        for replies already under way."""
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        state = self.channel.get_state(try_to_connect=True)
        while state != ready:
            left = deadline - loop.time()
            if state in (failed, grpc.ChannelConnectivity.SHUTDOWN) or left <= 0:
                raise VerifierError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot connect to the verifier {self.server} ({state.name.lower()})",
                )
            with contextlib.suppress(TimeoutError):
                await within(self.channel.wait_for_state_change(state), left)
            state = self.channel.get_state(try_to_connect=True)

    async def health(self) -> tuple[dict, int]:
        """The body and status of /health: 200 while the verifier says SERVING, else 503 with the reason.
        Answered from the last check of the verifier, which runs at start and again, in the background,
        when a probe finds it older than HEALTH_TTL_S: a probe never waits on a verifier busy with load
        (only the very first, before any check has ended)."""
        loop = asyncio.get_running_loop()
        if self._health is None:
            if self._health_task is not None and not self._health_task.done():
                await asyncio.shield(self._health_task)
            else:
                await self._refresh_health()
        elif loop.time() - self._health[0] >= HEALTH_TTL_S and (
            self._health_task is None or self._health_task.done()
        ):
            self._health_task = loop.create_task(self._refresh_health())
        return self._health[1:]

    async def _refresh_health(self) -> None:
        async with self._health_lock:
            checked = asyncio.get_running_loop().time()
            self._health = (checked, *(await self._check_health()))

    async def _check_health(self) -> tuple[dict, int]:
        try:
            stub = health_pb2_grpc.HealthStub(self.channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = (
                ""
                if serving
                else f"the verifier reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            )
        except grpc.aio.AioRpcError as e:
            serving, reason = False, f"verifier {self.server} unreachable: {e.code().name}"
        body = {"status": "ok" if serving else "unavailable", "verifier": self.server}
        return (body if serving else {**body, "reason": reason}), 200 if serving else 503
