"""The edge app's HTTP server (edge_client/httpkit.py) on loopback: a request aiohttp cannot parse (no Host
header) gets an OpenAI-shaped 400 and no traceback in the log; connections slow to send a request's head
are closed after the read timeout, and a body that does not arrive in time is 408 (slow-loris: the probe
held 300 such connections open for 40 s)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp import web

from edge_client import httpkit
from edge_client.httpkit import errors, read_json
from edge_client.metrics import METRICS, EdgeMetrics


async def started(read_timeout_s: float = 30.0) -> tuple[httpkit.Runner, int]:
    """An app with the edge's error middleware and one route that reads a JSON body."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response(await read_json(request))

    app = web.Application(middlewares=[errors])
    app[METRICS] = EdgeMetrics()
    app.router.add_post("/v1/echo", echo)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/v1/ok", ok)
    runner = httpkit.Runner(app, read_timeout_s=read_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def exchange(port: int, raw: bytes, timeout_s: float = 20.0, until: bytes | None = None) -> bytes:
    """What the server sends back on a connection that sent `raw`, until it closes it (or up to `until`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    try:
        read = reader.read() if until is None else reader.readuntil(until)
        return await asyncio.wait_for(read, timeout_s)
    finally:
        writer.close()


def test_a_request_without_a_host_header_gets_an_openai_error_and_no_traceback(caplog):
    async def run():
        runner, port = await started()
        try:
            return await exchange(port, b"GET /v1/ok HTTP/1.1\r\n\r\n")
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO):
        reply = asyncio.run(run())
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and b"application/json" in head
    error = json.loads(body)["error"]
    assert "Host" in error["message"] and error["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("partial", [b"", b"GET /v1/ok HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1"])
def test_a_slow_request_head_is_dropped_after_the_read_timeout(partial):
    async def run():
        runner, port = await started(read_timeout_s=0.5)
        try:
            start = asyncio.get_running_loop().time()
            reply = await exchange(port, partial, timeout_s=20)
            return reply, asyncio.get_running_loop().time() - start
        finally:
            await runner.cleanup()

    reply, took = asyncio.run(run())
    assert reply == b"" and took < 15  # closed, without an answer; generous for a busy machine


def test_a_body_that_does_not_arrive_in_time_is_408(monkeypatch):
    monkeypatch.setattr(httpkit, "READ_TIMEOUT_S", 0.5)
    head = b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"

    async def run():
        runner, port = await started()
        try:
            return await exchange(port, head + b"Content-Length: 100\r\n\r\n{", until=b"}}")
        finally:
            await runner.cleanup()

    reply = asyncio.run(run())
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.split()[1] == b"408"
    assert json.loads(body)["error"]["code"] == "request_timeout"
