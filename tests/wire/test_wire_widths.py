"""Ids are uint32 on the wire; a larger varint is refused before protobuf would keep its low 32 bits
(draftwire/widths.py), and a verifier refuses a port another server holds (draftwire/ports.py)."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from google.protobuf.message import DecodeError

from draftwire import widths
from draftwire.ports import PortInUse
from draftwire.v1 import draftwire_pb2 as pb
from tools.testkit.fakes import FakeEngine
from verifier_service.servicer import ServerConfig, start_server

WIDE = (1 << 32) + 5  # read as 5 by a plain parse


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a submessage, or packed ids)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def wide_open() -> bytes:
    """An EdgeMessage whose open's prompt_token_ids (packed) hold 1, 2**32 + 5, 7."""
    return field(1, field(1, varint(1) + varint(WIDE) + varint(7)))


def wide_proposal() -> bytes:
    """An EdgeMessage whose proposal's draft_token_ids hold 2**32 + 5, unpacked."""
    return field(2, varint(3 << 3 | 0) + varint(WIDE))


def test_a_plain_parse_truncates_and_the_strict_one_refuses():
    assert list(pb.EdgeMessage.FromString(wide_open()).open.prompt_token_ids) == [1, 5, 7]
    strict = widths.strict_parser(pb.EdgeMessage.FromString)
    for data, where in (
        (wide_open(), "open.prompt_token_ids"),
        (wide_proposal(), "proposal.draft_token_ids"),
    ):
        with pytest.raises(DecodeError, match=f"{where} is {WIDE}"):
            strict(data)
    # Nested uint32 fields too: the stop ids and top_k.
    stop = field(1, field(3, field(2, varint(WIDE))))
    top_k = field(1, field(2, varint(2 << 3 | 0) + varint(WIDE)))
    for data in (stop, top_k):
        with pytest.raises(DecodeError, match="a uint32 holds at most"):
            strict(data)


def test_honest_messages_pass_unchanged_wide_uint64_fields_included():
    strict = widths.strict_parser(pb.EdgeMessage.FromString)
    honest = pb.EdgeMessage(
        open=pb.OpenSession(
            prompt_token_ids=[0, 1, (1 << 32) - 1],
            sampling=pb.SamplingParams(temperature=0.7, top_k=40, seed=(1 << 64) - 1),
            stop=pb.StopConditions(max_new_tokens=64, stop_token_ids=[4_000_000_000]),
        )
    )
    assert strict(honest.SerializeToString()) == honest
    proposal = pb.EdgeMessage(
        proposal=pb.Proposal(round=1 << 40, start_position=1 << 50, draft_token_ids=[9])
    )
    assert strict(proposal.SerializeToString()) == proposal
    with pytest.raises(DecodeError):  # bytes that are no message stay the parser's to refuse
        strict(b"\xff\xff\xff\xff\xff\xff")
    assert widths.strict_parser(len) is len  # not a draftwire.v1 parser: left alone


def test_a_verifier_refuses_wide_ids_and_a_port_in_use_and_tells_its_metrics_port():
    async def run():
        server, port = await start_server(FakeEngine(), ServerConfig("127.0.0.1", 0, metrics_port=0))
        try:
            assert server.metrics_port  # --metrics-port 0: the bound port, which `serve` prints
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            metrics = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            assert b"draftwire" in metrics
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                session = channel.stream_stream(
                    "/draftwire.v1.Verifier/Session",
                    request_serializer=lambda b: b,
                    response_deserializer=pb.VerifierMessage.FromString,
                )
                for data in (wide_open(),):
                    call = session(iter([data]))
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for _ in call:
                            pass
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "uint32" in refused.value.details()
            # One process per port: no SO_REUSEPORT sharing, said in one line.
            with pytest.raises(PortInUse, match=f"port {port} is already in use"):
                await start_server(FakeEngine(), ServerConfig("127.0.0.1", port))
        finally:
            await server.server.stop(None)

    asyncio.run(run())
