"""Half-open connections to the verifier (slow-loris): one that does not finish its HTTP/2 handshake
within the server's handshake timeout is closed (the probe held 800 such connections open for 25 s)."""

from __future__ import annotations

import socket
import time

import pytest

from tools.testkit.fakes import FakeEngine
from tools.testkit.inprocess import InProcessServer
from verifier_service.servicer import ServerConfig

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.mark.parametrize("sent", [b"", PREFACE[:10]], ids=["nothing", "half a preface"])
def test_a_connection_that_does_not_finish_its_handshake_is_closed(sent):
    with InProcessServer(FakeEngine(), ServerConfig(port=0, handshake_timeout_s=0.5)) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(sent)
            start = time.monotonic()
            data = s.recv(65536)
            while data:  # the server's own preface and settings may come first
                data = s.recv(65536)
            took = time.monotonic() - start
        assert srv.healthy()
    assert took < 20  # closed by the server (generous for a busy machine); it stayed open before


def test_the_default_handshake_timeout_is_ten_seconds():
    assert ServerConfig().handshake_timeout_s == 10.0
