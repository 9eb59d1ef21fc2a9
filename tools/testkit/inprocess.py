"""A real verifier server in this process, over any engine (the fake one for the wire tier): the same
`address`, `healthy()` and context-manager use as serverproc.ServerProcess, started in milliseconds.

The server's event loop runs on a thread of its own, so that a test's clients (asyncio.run, or grpc's
blocking stubs) call it as they would a server in another process.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from verifier_service.servicer import ServerConfig, VerifierServer, start_server


class InProcessServer:
    def __init__(self, engine, config: ServerConfig | None = None):
        self.engine, self.config = engine, config or ServerConfig(port=0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verifier", daemon=True)
        self.thread.start()
        self.server: VerifierServer
        self.server, self.port = self.call(start_server(engine, self.config))
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 30.0):
        """Runs `coroutine` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def healthy(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        if self.loop.is_running():
            self.call(self.server.stop(None))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
