"""A delaying TCP proxy on loopback: emulates network round-trip time in user space (no netem here).

Every chunk read from one side is written to the other side half an RTT later, in order, so latency
is added without capping bandwidth. `drop()` cuts every open connection, to emulate a network loss;
`stall()` holds every byte (both directions, connections stay open) until `resume()`, to emulate a
network that stops delivering without saying so; `corrupt()` flips one bit of the next chunk toward the
client, as a broken link or middlebox would (TLS then fails its record's check).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DelayConfig:
    upstream_host: str  # where the proxy forwards to
    upstream_port: int
    rtt_s: float  # added round-trip time; each direction gets half
    host: str = "127.0.0.1"  # where the proxy listens
    port: int = 0  # 0 picks a free port


class DelayProxy:
    def __init__(self, config: DelayConfig):
        self.config = config
        self.port = 0
        self.bytes_up = 0  # client to upstream
        self.bytes_down = 0  # upstream to client
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()  # cleared while stalled
        self._flowing.set()
        self._corrupt_next = False

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._serve, self.config.host, self.config.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def __aenter__(self) -> DelayProxy:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def drop(self) -> None:
        """Cuts every open connection, both sides."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def stall(self) -> None:
        """Holds every byte from now on, in both directions, without closing anything."""
        self._flowing.clear()

    def resume(self) -> None:
        """Delivers what was held, in order, and flows again."""
        self._flowing.set()

    def corrupt(self) -> None:
        """Flips a bit in the middle of the next chunk sent toward the client."""
        self._corrupt_next = True

    async def _serve(self, client_reader, client_writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.config.upstream_host, self.config.upstream_port
            )
        except OSError:
            client_writer.transport.abort()
            return
        self._writers.update((client_writer, up_writer))
        half = self.config.rtt_s / 2
        try:
            await asyncio.gather(
                self._pipe(client_reader, up_writer, half, "up"),
                self._pipe(up_reader, client_writer, half, "down"),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            pass  # the proxy is shutting down
        finally:
            for writer in (client_writer, up_writer):
                self._writers.discard(writer)
                writer.transport.abort()

    async def _pipe(self, reader, writer, delay: float, direction: str) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                if direction == "down" and self._corrupt_next and data:
                    self._corrupt_next = False
                    middle = len(data) // 2
                    data = data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :]
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                queue.put_nowait((time.monotonic() + delay, data))
        finally:
            queue.put_nowait((0.0, b""))
            await asyncio.gather(sender, return_exceptions=True)
            writer.transport.abort()
