"""Who can read a verifier's metrics: loopback unless an address is named, every interface only when
spelled out (never by an empty --metrics-host), and a bearer token checked on every scrape when one is
given (in-process verifiers over the fake engine; `serve` for its refusals). Every metric name is in the
table of docs/metrics.md."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from draftwire import metrics
from draftwire.v1 import draftwire_pb2 as pb
from tools.rig.serverproc import listening
from tools.testkit.fakes import FakeEngine
from verifier_service.servicer import ServerConfig, start_metrics, start_server

ROOT = Path(__file__).resolve().parents[2]


def scrape(port: int, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_bind_loopback_by_default_and_everywhere_only_when_spelled_out():
    async def run():
        server, _ = await start_server(FakeEngine(), ServerConfig("127.0.0.1", 0, metrics_port=0))
        try:
            assert listening(server.metrics_port) == {"0100007F"}  # 127.0.0.1
            status, text = scrape(server.metrics_port)
            assert status == 200 and "draftwire:sessions_total" in text
        finally:
            await server.stop(None)
        with pytest.raises(ValueError, match="0.0.0.0"):  # "" would mean every interface: refused
            await start_server(FakeEngine(), ServerConfig("127.0.0.1", 0, metrics_port=0, metrics_host=""))

    asyncio.run(run())
    port = start_metrics(lambda: pb.ServerStats(), "0.0.0.0", 0)
    assert listening(port) == {"00000000"}  # said explicitly: every interface


def test_a_metrics_token_is_checked_on_every_scrape(tmp_path):
    token = tmp_path / "metrics.token"
    token.write_text("first-token\n")
    token.chmod(0o600)

    async def run():
        config = ServerConfig("127.0.0.1", 0, metrics_port=0, metrics_token_file=token)
        server, _ = await start_server(FakeEngine(), config)
        try:
            port = server.metrics_port
            for sent in (None, "wrong-token", "first-token-and-more", ""):
                status, text = await asyncio.to_thread(scrape, port, sent)
                assert status == 401 and "draftwire:" not in text
            status, text = await asyncio.to_thread(scrape, port, "first-token")
            assert status == 200 and "draftwire:sessions_total" in text
            token.write_text("second-token\n")  # rotated without a restart
            assert (await asyncio.to_thread(scrape, port, "first-token"))[0] == 401
            assert (await asyncio.to_thread(scrape, port, "second-token"))[0] == 200
            token.unlink()  # no token to check against: closed, not open
            assert (await asyncio.to_thread(scrape, port, "second-token"))[0] == 503
        finally:
            await server.stop(None)

    asyncio.run(run())
    with pytest.raises(OSError):  # a token file that cannot be read is said at start
        start_metrics(lambda: pb.ServerStats(), "127.0.0.1", 0, tmp_path / "missing")


def test_serve_refuses_an_empty_metrics_host_and_an_unreadable_token_file(tmp_path):
    target = tmp_path / "target"  # holds no model: the refusals come before loading one
    target.mkdir()
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    serve = [sys.executable, "-m", "draftwire_cli", "serve", "--target", str(target), "--port", "0"]
    cases = [
        (["--metrics-port", "0", "--metrics-host", ""], "0.0.0.0"),
        (["--metrics-port", "0", "--metrics-token-file", str(tmp_path / "missing")], "--metrics-token-file"),
        (["--metrics-port", "0", "--metrics-token-file", str(empty)], "one token"),
    ]
    for argv, said in cases:
        done = subprocess.run([*serve, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("draftwire: ") and said in last, done.stderr


def test_every_metric_is_in_the_table_of_docs_metrics():
    """The names a verifier exports (with a token file, so that every family shows) are the names
    docs/metrics.md's table lists, no more and no fewer."""
    families = [
        *metrics.families(pb.ServerStats(refusals={"OK": 1}, accepted_per_position=[1])),
        *metrics.auth_families(True, 0, 0),
    ]
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    doc = (ROOT / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(draftwire:[a-z_]+)`", doc, re.M))
    assert exported == listed, (exported - listed, listed - exported)


def raw_get(port: int, host: str | None) -> int:
    """The status of GET /metrics with this Host header (None: none sent, HTTP/1.0)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = "GET /metrics HTTP/1.0\r\n" + (f"Host: {host}\r\n" if host is not None else "") + "\r\n"
        s.sendall(head.encode())
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return int(reply.split()[1])


def test_metrics_without_a_token_answer_only_a_host_that_cannot_be_rebound():
    """A DNS-rebinding page's requests carry its own name as Host: refused (403) as the edge app does;
    an address, a loopback name and no token file needed for those."""
    port = start_metrics(lambda: pb.ServerStats(), "127.0.0.1", 0)
    for host in (f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", "10.1.2.3"):
        assert raw_get(port, host) == 200, host
    for host in (f"attacker.example:{port}", "rebind.attacker.example", "", None):
        assert raw_get(port, host) == 403, host


def test_a_metrics_token_lets_any_host_scrape(tmp_path):
    token = tmp_path / "metrics.token"
    token.write_text("s3cret\n")
    port = start_metrics(lambda: pb.ServerStats(), "127.0.0.1", 0, token)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Host": "prom.internal"})
    request.add_header("Authorization", "Bearer s3cret")
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200


@pytest.mark.parametrize("partial", [b"", b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_a_slow_loris_scrape_is_dropped_after_the_read_timeout(monkeypatch, partial):
    import socket
    import time

    monkeypatch.setattr(metrics, "READ_TIMEOUT_S", 0.5)
    port = start_metrics(lambda: pb.ServerStats(), "127.0.0.1", 0)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(partial)
        start = time.monotonic()
        assert s.recv(1) == b""  # the server closed it, without an answer
        assert time.monotonic() - start < 25  # not held open as before (generous: a busy machine)
