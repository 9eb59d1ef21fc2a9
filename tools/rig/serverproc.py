"""`draftwire serve` in a child process on a free loopback port, ready once health says SERVING; and
`draftwire edge` (the device's HTTP app) likewise, ready once it prints its URL."""

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

from draftwire import wire

DRAFTWIRE = str(Path(sys.executable).parent / "draftwire")


class ServerProcess:
    def __init__(
        self,
        target: Path,
        *extra: str,
        timeout: float = 120,
        executable: str = DRAFTWIRE,
        cpus: tuple[int, ...] = (),
        credentials: wire.ClientCredentials = wire.PLAINTEXT,
        env: dict[str, str] | None = None,
    ):
        """Starts `executable serve` (by default this environment's `draftwire`), pinned to `cpus` when
        given, with the environment `env` (None: this process's); `credentials`: how to reach it when its
        `extra` asks for TLS (health needs no token). Raises RuntimeError with its output when it does not
        come up."""
        self.credentials = credentials
        self.proc = subprocess.Popen(
            [executable, "serve", "--target", str(target), "--port", "0", *extra],
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.address = _wait_for(self, r"serving .* on (\S+:\d+)", timeout)
        self._wait_until_serving(timeout=30)

    def _channel(self) -> grpc.Channel:
        """A blocking channel for health checks (open to anyone, TLS where the server serves it)."""
        return blocking_channel(self.address, getattr(self, "credentials", wire.PLAINTEXT))

    def _wait_until_serving(self, timeout: float) -> None:
        with self._channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout, wait_for_ready=True
            )
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise RuntimeError(f"server at {self.address} reports {reply.status}")

    def healthy(self) -> bool:
        with self._channel() as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return self.proc.poll() is None and reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ChildProcess(ServerProcess):
    def __init__(
        self,
        argv: list[str],
        pattern: str,
        timeout: float = 120,
        cpus: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
    ):
        """Starts `argv`, pinned to `cpus` when given; ready once a line of its output matches
        `pattern`, whose first group is `found`. Raises RuntimeError when it does not come up."""
        self.proc = subprocess.Popen(
            argv,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.found = _wait_for(self, pattern, timeout)


class EdgeProcess(ChildProcess):
    def __init__(
        self,
        server: str,
        draft: Path | None,
        *extra: str,
        db: Path,
        timeout: float = 120,
        executable: str = DRAFTWIRE,
        cpus: tuple[int, ...] = (),
    ):
        """`executable edge` against the verifier at `server` on a free loopback port, keeping
        conversations in `db` (draft None: a thin device, `extra` gives its --vocab); `url` is its base
        URL."""
        argv = [executable, "edge", "--server", server, "--port", "0", "--db", str(db)]
        argv += ["--draft", str(draft)] if draft is not None else []
        super().__init__([*argv, *extra], r"draftwire edge: (http://\S+/)", timeout, cpus)
        self.url = self.found


def blocking_channel(address: str, credentials: wire.ClientCredentials) -> grpc.Channel:
    """A blocking (not asyncio) channel to `address` with `credentials`: plaintext, or TLS with any
    token and client certificate they carry."""
    if not credentials.tls:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials.channel_credentials(), credentials.options())


def _wait_for(server: ServerProcess, pattern: str, timeout: float) -> str:
    """The first group of `pattern` in the process's first lines of output; stops it and raises
    RuntimeError with what it printed when it exits or the time runs out first.

    Reads the pipe's bytes as they come: a buffered readline after select may take the next lines into
    its buffer, where select no longer sees them, and the line looked for would wait there unread."""
    deadline, seen, partial = time.monotonic() + timeout, [], b""
    fd = server.proc.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            *lines, partial = (partial + os.read(fd, 1 << 16)).split(b"\n")
            for line in lines:
                seen.append(line.decode(errors="replace") + "\n")
                m = re.search(pattern, seen[-1])
                if m:
                    return m.group(1)
        if server.proc.poll() is not None:
            seen.append(partial.decode(errors="replace"))
            seen.extend(server.proc.stdout)  # what it printed last: often why it exited
            break
    server.stop()
    raise RuntimeError("did not start:\n" + "".join(seen))


def listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) with a socket listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found
