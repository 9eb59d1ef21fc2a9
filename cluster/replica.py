"""One verifier replica: the body of a Ray actor that loads the target and runs the verifier's gRPC server.

A thin shim: the verifier is `verifier_service.servicer.start_server`, unchanged. The class holds no
Ray handle, so it also runs without Ray (call its methods directly).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass

from cluster.config import ReplicaConfig


@dataclass(frozen=True)
class ReplicaInfo:
    address: str  # host:port of this incarnation's verifier server
    pid: int  # the process serving it (Ray's worker process for an actor)
    target_id: str
    numerics: str = ""  # the engine's Numerics.identity: the pool routes a session to its own only
    gpus: tuple[int, ...] = ()  # the GPUs Ray gave this replica (its CUDA_VISIBLE_DEVICES), none on CPU


class VerifierReplica:
    def __init__(self, config: ReplicaConfig):
        self.config = config
        self._info: ReplicaInfo | None = None
        self._server = None
        self._starting: asyncio.Lock | None = None
        self._stopped: asyncio.Event | None = None

    async def start(self) -> ReplicaInfo:
        """Loads the target and starts serving; later calls return the same info at once.

        Raises what TargetEngine.load raises for a bad model directory, RuntimeError when the port
        cannot be bound.
        """
        from verifier_service.engine import TargetEngine
        from verifier_service.servicer import start_server

        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._info is None:
                config = self.config
                engine = await asyncio.to_thread(
                    TargetEngine.load,
                    config.target_dir,
                    config.device,
                    dtype=config.dtype,
                    invariant=config.invariant,
                    kernels=config.kernels,
                )
                host = self.config.server.host or _node_ip()
                server_config = dataclasses.replace(self.config.server, host=host, port=0)
                self._server, port = await start_server(engine, server_config)
                self._info = ReplicaInfo(
                    _join(host, port),
                    os.getpid(),
                    engine.info.target_id,
                    engine.numerics.identity,
                    _gpu_ids(),
                )
        return self._info

    async def until_stopped(self) -> None:
        """Returns when `stop` ran. The pool keeps one call pending: if the process dies, Ray fails
        the call at once, which is how the pool learns of the death."""
        self._stopped = self._stopped or asyncio.Event()
        await self._stopped.wait()

    async def drain(self, timeout_s: float = 0.0) -> None:
        """Drains the server (VerifierServer.drain): no new sessions, running ones may finish within
        `timeout_s`, the rest end with UNAVAILABLE, so their edges resume elsewhere; then stops."""
        if self._server is not None:
            await self._server.drain(timeout_s)
        self._stopped = self._stopped or asyncio.Event()
        self._stopped.set()

    async def stop(self, grace: float = 1.0) -> None:
        """Stops the server, giving open streams `grace` seconds."""
        if self._server is not None:
            await self._server.stop(grace)
        self._stopped = self._stopped or asyncio.Event()
        self._stopped.set()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _gpu_ids() -> tuple[int, ...]:
    """The GPUs Ray assigned this actor (none outside Ray)."""
    import ray

    return tuple(int(g) for g in ray.get_gpu_ids()) if ray.is_initialized() else ()


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
