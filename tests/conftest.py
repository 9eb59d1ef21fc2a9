"""Shared fixtures: a small model pair built from local data, and a real verifier on a loopback port."""

import os

# Nothing in the tests may reach a model hub; fail loudly instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import re  # noqa: E402
import select  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
import pytest  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from draftwire.modelkit import TestPair, build_test_pair  # noqa: E402

DRAFTWIRE = str(Path(sys.executable).parent / "draftwire")


@pytest.fixture(scope="session")
def test_pair(tmp_path_factory) -> TestPair:
    return build_test_pair(tmp_path_factory.mktemp("pair"))


class ServerProcess:
    """`draftwire serve` in a subprocess on a free loopback port, ready once health says SERVING."""

    def __init__(self, target: Path, *extra: str):
        self.proc = subprocess.Popen(
            [DRAFTWIRE, "serve", "--target", str(target), "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.address = self._wait_for_address(timeout=120)
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
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

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


@pytest.fixture(scope="session")
def server(test_pair):
    srv = ServerProcess(test_pair.target_dir, "--max-gamma", "8")
    yield srv
    srv.stop()
