"""`draftwire serve` in a child process on a free loopback port, ready once health says SERVING."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DRAFTWIRE = str(Path(sys.executable).parent / "draftwire")


class ServerProcess:
    def __init__(
        self,
        target: Path,
        *extra: str,
        timeout: float = 120,
        executable: str = DRAFTWIRE,
        cpus: tuple[int, ...] = (),
    ):
        """Starts `executable serve` (by default this environment's `draftwire`), pinned to `cpus` when
        given; raises RuntimeError with its output when it does not come up."""
        self.proc = subprocess.Popen(
            [executable, "serve", "--target", str(target), "--port", "0", *extra],
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.address = self._wait_for_address(timeout)
        self._wait_until_serving(timeout=30)

    def _wait_for_address(self, timeout: float) -> str:
        deadline, seen = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                seen.append(line)
                m = re.search(r"serving .* on (\S+:\d+)", line)
                if m:
                    return m.group(1)
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError("server did not start:\n" + "".join(seen))

    def _wait_until_serving(self, timeout: float) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=True
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise RuntimeError(f"server at {self.address} reports {reply.status}")

    def healthy(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return self.proc.poll() is None and reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
