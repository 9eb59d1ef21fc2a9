"""Revocation that takes effect, on in-process verifiers over TLS on loopback (the fake engine): a revoked
token's or certificate name's open stream ends with UNAUTHENTICATED within seconds; a token file that
breaks or goes missing fails closed (UNAVAILABLE, health NOT_SERVING, a metric) and admission resumes once
it is fixed; a certificate is admitted only when its name is listed. That kept caches serve their own
client only, on the demo target: tests/system/test_kept_caches.py."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwire import wire
from draftwire.contract import Proposal, SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from tools.rig.certs import make_certs
from tools.testkit.fakes import FakeEngine, successor
from verifier_service.auth import AuthConfig, TlsConfig
from verifier_service.lifecycle import LifetimeConfig
from verifier_service.servicer import ServerConfig, start_server

RECHECK_S = 0.2  # the servers here recheck credentials this often (default 1 s)
TOKENS = "alice alice-token\nbob bob-token\nops ops-token admin\ncarol -\n"
SPEC = SessionSpec((5, 17, 42), SamplingParams(), 200, ignore_eos=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("alice", "carol", "dave"))


def config(certs, tokens: Path, mtls=False, **kw) -> ServerConfig:
    tls = TlsConfig.from_files(certs.cert("server"), certs.key("server"), certs.ca() if mtls else None)
    return ServerConfig(
        "127.0.0.1",
        0,
        tls=tls,
        auth=AuthConfig(tokens_file=tokens),
        lifetime=LifetimeConfig(recheck_s=RECHECK_S),
        **kw,
    )


def creds(certs, token=None, client=None) -> wire.ClientCredentials:
    cert, key = (certs.cert(client), certs.key(client)) if client else (None, None)
    return wire.ClientCredentials.from_files(certs.ca(), cert, key, token)


def rewrite(path: Path, text: str) -> None:
    """Replaces the file as an operator should: a new file renamed over the old one."""
    new = path.with_suffix(".new")
    new.write_text(text)
    new.replace(path)


class Stream:
    """One Session stream, opened; `play()` sends the next proposal (the fake target's own tokens)."""

    def __init__(self, channel, spec=SPEC):
        self.call = pb_grpc.VerifierStub(channel).Session()
        self.spec, self.round, self.committed = spec, 0, list(spec.prompt_token_ids)

    async def open(self) -> pb.SessionOpened:
        await self.call.write(pb.EdgeMessage(open=wire.spec_to_proto(self.spec)))
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF, await self.call.details()
        return reply.opened

    async def play(self) -> pb.Verdict:
        self.round += 1
        draft = (successor(self.committed[-1]),)
        proposal = Proposal(self.round, len(self.committed), draft)
        await self.call.write(pb.EdgeMessage(proposal=wire.proposal_to_proto(proposal)))
        reply = await self.call.read()
        assert reply is not grpc.aio.EOF, await self.call.code()
        self.committed += [draft[0], successor(draft[0])]
        return reply.verdict

    async def ending(self, timeout: float = 5.0) -> tuple[grpc.StatusCode, str, float]:
        """Waits, sending nothing, for the verifier to end the stream: its status, details, seconds."""
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(self.call.read(), timeout)
        return e.value.code(), e.value.details(), time.monotonic() - start


async def refused(address: str, credentials) -> tuple[grpc.StatusCode, str]:
    async with wire.channel(address, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        return e.value.code(), e.value.details()


async def admitted(address: str, credentials) -> bool:
    async with wire.channel(address, credentials) as channel:
        await pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        return True


async def health(address: str, credentials) -> int:
    async with wire.channel(address, credentials) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        return reply.status


def connection(address: str, credentials) -> grpc.aio.Channel:
    """A channel on a TCP connection of its own (channels of one process share connections otherwise)."""
    options = [*credentials.options(), ("grpc.use_local_subchannel_pool", 1)]
    if credentials.tls:
        return grpc.aio.secure_channel(address, credentials.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_a_revoked_tokens_open_stream_ends_within_seconds_and_others_go_on(certs, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)

    async def run():
        server, port = await start_server(FakeEngine(), config(certs, tokens, metrics_port=0))
        address = f"127.0.0.1:{port}"
        try:
            async with (
                wire.channel(address, creds(certs, "alice-token")) as a,
                wire.channel(address, creds(certs, "bob-token")) as b,
            ):
                alice, bob = Stream(a), Stream(b)
                await alice.open()
                await bob.open()
                assert (await alice.play()).accepted == 1
                rewrite(tokens, TOKENS.replace("alice alice-token\n", ""))
                code, details, seconds = await alice.ending()  # alice sends nothing: idle, yet ended
                assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
                assert seconds < 3 * RECHECK_S + 1.0
                assert (await bob.play()).accepted == 1  # bob's session goes on
                code, details = await refused(address, creds(certs, "alice-token"))
                assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
            assert "draftwire:auth_revoked_sessions_total 1.0" in scrape(server.metrics_port)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_a_broken_or_missing_token_file_fails_closed_loudly_and_admission_resumes(certs, tmp_path, caplog):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)

    async def run():
        server, port = await start_server(FakeEngine(), config(certs, tokens, metrics_port=0))
        address = f"127.0.0.1:{port}"
        alice_creds = creds(certs, "alice-token")
        try:
            assert "draftwire:auth_token_file_ok 1.0" in scrape(server.metrics_port)
            async with wire.channel(address, alice_creds) as channel:
                alice = Stream(channel)
                await alice.open()
                # Alice is revoked by an edit that also breaks the file: nothing of the old file stays.
                rewrite(tokens, TOKENS.replace("alice alice-token\n", "alice\n"))
                code, details, _ = await alice.ending()
                assert code == grpc.StatusCode.UNAVAILABLE and "token file" in details
            for who in (alice_creds, creds(certs, "bob-token")):
                code, details = await refused(address, who)
                assert code == grpc.StatusCode.UNAVAILABLE and "token file cannot be read" in details
            await asyncio.sleep(3 * RECHECK_S)
            assert await health(address, alice_creds) == health_pb2.HealthCheckResponse.NOT_SERVING
            text = scrape(server.metrics_port)
            assert "draftwire:auth_token_file_ok 0.0" in text
            assert "draftwire:auth_token_file_failures_total 1.0" in text

            rewrite(tokens, TOKENS)  # fixed: admission resumes
            assert await admitted(address, creds(certs, "bob-token"))
            await asyncio.sleep(3 * RECHECK_S)
            assert await health(address, alice_creds) == health_pb2.HealthCheckResponse.SERVING
            assert "draftwire:auth_token_file_ok 1.0" in scrape(server.metrics_port)

            tokens.unlink()  # missing: closed again
            code, details = await refused(address, creds(certs, "bob-token"))
            assert code == grpc.StatusCode.UNAVAILABLE and "token file" in details
            tokens.write_text(TOKENS.replace("bob bob-token\n", ""))
            code, _ = await refused(address, creds(certs, "bob-token"))
            assert code == grpc.StatusCode.UNAUTHENTICATED  # bob was revoked while it was missing
            assert await admitted(address, alice_creds)
        finally:
            await server.stop(None)

    with caplog.at_level("ERROR", logger="verifier_service.auth"):
        asyncio.run(run())
    assert any("every client is refused" in r.getMessage() for r in caplog.records)


def test_a_certificate_is_admitted_only_while_its_name_is_listed(certs, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)  # lists alice (with a token) and carol (certificate only), not dave

    async def run():
        server, port = await start_server(FakeEngine(), config(certs, tokens, mtls=True))
        address = f"127.0.0.1:{port}"
        try:
            assert await admitted(address, creds(certs, client="alice"))
            code, details = await refused(address, creds(certs, client="dave"))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "'dave'" in details
            async with wire.channel(address, creds(certs, client="carol")) as channel:
                carol = Stream(channel)
                await carol.open()
                assert (await carol.play()).accepted == 1
                rewrite(tokens, TOKENS.replace("carol -\n", ""))
                code, details, seconds = await carol.ending()
                assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
                assert seconds < 3 * RECHECK_S + 1.0
            code, _ = await refused(address, creds(certs, client="carol"))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(None)

    asyncio.run(run())
