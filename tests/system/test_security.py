"""Transport security and identity on real servers on loopback (the demo pair): TLS and mTLS, per-client
tokens reloaded without a restart, sessions and kept caches that belong to their client, GetStats for
admins only, and the Ray pool with TLS and tokens, its replicas closed to anyone but the front.
"""

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from draftwire import wire
from draftwire.contract import SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, VerifierError
from tools.rig.certs import make_certs
from tools.rig.serverproc import DRAFTWIRE, EdgeProcess, ServerProcess
from verifier_service.auth import AuthConfig, BadTokenFile, TlsConfig, parse_tokens, read_clients
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
DRAFT = DEMO / "draft-q8_0.gguf"
PROMPT = (5, 17, 42, 99, 7, 13, 250, 31)
TOKENS = "alice alice-token\nbob bob-token  # a comment\nops ops-token admin\n"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("alice", "bob"))


@pytest.fixture(scope="module")
def reference():
    engine = TargetEngine.load(DEMO / "target")
    spec = lambda prompt, n: SessionSpec(tuple(prompt), SamplingParams(), n, ignore_eos=True)  # noqa: E731
    return lambda prompt, n=24: reference_decode(engine, spec(prompt, n))


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(TOKENS)
    return path


@pytest.fixture(scope="module")
def tls_server(certs, tokens_file):
    """TLS and tokens (no client certificates)."""
    extra = [
        "--tls-cert",
        certs.cert("server"),
        "--tls-key",
        certs.key("server"),
        "--auth-tokens",
        tokens_file,
    ]
    with ServerProcess(DEMO / "target", *map(str, extra), credentials=creds(certs)) as server:
        yield server


def creds(certs, token=None, client=None) -> wire.ClientCredentials:
    cert, key = (certs.cert(client), certs.key(client)) if client else (None, None)
    return wire.ClientCredentials.from_files(certs.ca(), cert, key, token)


def generate(address: str, credentials: wire.ClientCredentials, prompt=PROMPT, n: int = 24):
    """(generated ids, reused positions) of one generation with the demo draft."""

    async def run():
        async with wire.channel(address, credentials) as channel:
            ids, stats = await EdgeSession(channel, LlamaDrafter(DrafterConfig(DRAFT))).run(
                GenerationRequest(tuple(prompt), SamplingParams(), n, gamma=3, ignore_eos=True)
            )
            return ids, stats.reused_positions

    return asyncio.run(run())


def call(address: str, credentials: wire.ClientCredentials, method: str, request):
    async def run():
        async with wire.channel(address, credentials) as channel:
            return await getattr(pb_grpc.VerifierStub(channel), method)(request, timeout=20)

    return asyncio.run(run())


def refusal(fn, *args) -> grpc.StatusCode:
    """The status a generation ends with (the edge raises GetModelInfo's as an AioRpcError)."""
    try:
        fn(*args)
    except VerifierError as e:
        return e.code
    except grpc.aio.AioRpcError as e:
        return e.code()
    raise AssertionError("not refused")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DRAFTWIRE, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def test_token_files_parse_and_refuse_bad_lines():
    table = parse_tokens(TOKENS)
    assert sorted((i.name, i.admin) for i in table.values()) == [
        ("alice", False),
        ("bob", False),
        ("ops", True),
    ]
    for bad in ("alice", "alice t extra", "a t\nb t"):
        with pytest.raises(BadTokenFile):
            parse_tokens(bad)
    listed = read_clients("carol -  # her certificate only\nops - admin\nalice t\n")
    assert sorted(listed.names) == ["alice", "carol", "ops"] and listed.names["ops"].admin
    assert [i.name for i in listed.tokens.values()] == ["alice"]
    with pytest.raises(ValueError):  # a token never leaves in clear text
        wire.ClientCredentials(token="t")


def token_file(directory: Path, token: str) -> str:
    """A file holding `token`, readable by its owner only: how a client takes a token (--token-file)."""
    path = directory / f"{token}.txt"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def test_generate_over_tls_with_a_token_equals_the_target_alone(tls_server, certs, reference, tmp_path):
    ids = ",".join(map(str, PROMPT))
    argv = ["generate", "--server", tls_server.address, "--draft", str(DRAFT), "--prompt-ids", ids]
    argv += ["--max-new-tokens", "24", "--ignore-eos", "--json", "--tls-ca", str(certs.ca())]
    done = cli(*argv, "--token-file", token_file(tmp_path, "alice-token"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == reference(PROMPT)
    by_env = cli(*argv, env={"DRAFTWIRE_TOKEN": "bob-token"})  # the token from the environment
    assert by_env.returncode == 0 and json.loads(by_env.stdout)["token_ids"] == reference(PROMPT)
    # A token on the command line is refused, and says why: any local user can read /proc/PID/cmdline.
    on_argv = cli(*argv, "--token", "alice-token")
    assert (
        on_argv.returncode == 2 and "/proc/PID/cmdline" in on_argv.stderr and "--token-file" in on_argv.stderr
    )
    assert "Traceback" not in on_argv.stderr

    plaintext = cli(
        *argv[:-2], env={"DRAFTWIRE_TOKEN": "alice-token"}
    )  # no --tls-ca: refused before dialling
    assert plaintext.returncode != 0 and "TLS" in plaintext.stderr
    no_tls = cli(*argv[:-2])  # a plaintext client against the TLS server
    assert no_tls.returncode == 1 and "UNAVAILABLE" in no_tls.stderr and "--tls-ca" in no_tls.stderr
    for token in ([], ["--token-file", token_file(tmp_path, "mallory-token")]):
        refused = cli(*argv, *token)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


def test_loadtest_top_and_the_edge_app_speak_tls_with_tokens(tls_server, certs, tmp_path):
    secure = ["--tls-ca", str(certs.ca())]
    load = [
        "loadtest",
        "--server",
        tls_server.address,
        "--sessions",
        "2",
        "--duration",
        "1",
        "--prompts",
        "1",
    ]
    done = cli(
        *load, "--new-tokens", "8", "--json", *secure, "--token-file", token_file(tmp_path, "alice-token")
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["errors"] == {}
    top = cli("top", tls_server.address, "--once", *secure, env={"DRAFTWIRE_TOKEN": "ops-token"})
    assert top.returncode == 0 and json.loads(top.stdout)["sessions_opened"] >= 1
    denied = cli(
        "top", tls_server.address, "--once", *secure, "--token-file", token_file(tmp_path, "alice-token")
    )
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr and "admin" in denied.stderr

    def models(edge) -> int:
        try:
            with urllib.request.urlopen(edge.url + "v1/models", timeout=30) as reply:
                return reply.status
        except urllib.error.HTTPError as e:
            return e.code

    bob = ("--token-file", token_file(tmp_path, "bob-token"))
    with EdgeProcess(tls_server.address, DRAFT, *secure, *bob, db=tmp_path / "a") as edge:
        assert models(edge) == 200
    nobody = ("--token-file", token_file(tmp_path, "nobody"))
    with EdgeProcess(tls_server.address, DRAFT, *secure, *nobody, db=tmp_path / "b") as edge:
        assert models(edge) == 401


def test_missing_or_wrong_tokens_are_unauthenticated_and_health_stays_open(tls_server, certs):
    for credentials in (creds(certs), creds(certs, "mallory-token")):
        for method, request in (("GetModelInfo", pb.ModelInfoRequest()), ("GetStats", pb.StatsRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                call(tls_server.address, credentials, method, request)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refusal(generate, tls_server.address, credentials) == grpc.StatusCode.UNAUTHENTICATED
    assert tls_server.healthy()  # health needs no token


def test_stats_are_for_admins_and_session_ids_are_not_guessable(tls_server, certs):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        call(tls_server.address, creds(certs, "alice-token"), "GetStats", pb.StatsRequest())
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    before = call(tls_server.address, creds(certs, "ops-token"), "GetStats", pb.StatsRequest())

    async def open_ids() -> list[str]:
        async with wire.channel(tls_server.address, creds(certs, "alice-token")) as channel:
            ids = []
            for _ in range(2):
                stream = pb_grpc.VerifierStub(channel).Session()
                spec = SessionSpec(PROMPT, SamplingParams(), 4)
                await stream.write(pb.EdgeMessage(open=wire.spec_to_proto(spec)))
                ids.append((await stream.read()).opened.session_id)
                stream.cancel()
            return ids

    first, second = asyncio.run(open_ids())
    assert first != second and len(first) >= 20 and not first.removeprefix("session-").isdigit()
    # The admin's figures are the server's: they count alice's two sessions.
    after = call(tls_server.address, creds(certs, "ops-token"), "GetStats", pb.StatsRequest())
    assert after.sessions_opened - before.sessions_opened == 2


def test_a_kept_conversation_cache_serves_only_its_own_client(tls_server, certs, reference):
    prompt = (300, 301, 302, 61, 62)  # no other test's conversation starts so
    alice, bob = creds(certs, "alice-token"), creds(certs, "bob-token")
    first, _ = generate(tls_server.address, alice, prompt)
    next_turn = (*prompt, *first, 70, 71)
    ids, reused = generate(tls_server.address, bob, next_turn)  # bob sends alice's conversation
    assert reused == 0 and ids == reference(next_turn)
    ids, reused = generate(tls_server.address, alice, next_turn)
    assert reused >= len(prompt) + len(first) - 1 and ids == reference(next_turn)


def test_the_token_file_is_reread_without_a_restart(certs, tmp_path, reference):
    path = tmp_path / "tokens"
    path.write_text("carol first-token\n")
    extra = ["--tls-cert", certs.cert("server"), "--tls-key", certs.key("server"), "--auth-tokens", path]
    with ServerProcess(DEMO / "target", *map(str, extra), credentials=creds(certs)) as server:
        assert generate(server.address, creds(certs, "first-token"))[0] == reference(PROMPT)
        path.write_text("carol the-second-token\n")
        assert (
            refusal(generate, server.address, creds(certs, "first-token")) == grpc.StatusCode.UNAUTHENTICATED
        )
        assert generate(server.address, creds(certs, "the-second-token"))[0] == reference(PROMPT)
        path.write_text("carol\n")  # a broken file fails closed: nobody is admitted until it is fixed
        with pytest.raises(grpc.aio.AioRpcError) as e:
            call(server.address, creds(certs, "the-second-token"), "GetModelInfo", pb.ModelInfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "token file" in e.value.details()
        path.write_text("carol the-second-token\n")
        assert generate(server.address, creds(certs, "the-second-token"))[0] == reference(PROMPT)


def test_mtls_needs_a_client_certificate_whose_name_stands_for_the_token(certs, tokens_file, reference):
    extra = ["--tls-cert", certs.cert("server"), "--tls-key", certs.key("server")]
    extra += ["--tls-client-ca", certs.ca(), "--auth-tokens", tokens_file]
    with ServerProcess(DEMO / "target", *map(str, extra), credentials=creds(certs, client="alice")) as server:
        no_certificate = creds(certs, "alice-token")  # TLS and a token, no certificate
        assert refusal(generate, server.address, no_certificate) == grpc.StatusCode.UNAVAILABLE
        assert generate(server.address, creds(certs, client="alice"))[0] == reference(PROMPT)
        with pytest.raises(grpc.aio.AioRpcError) as e:  # alice by her certificate: not an admin
            call(server.address, creds(certs, client="alice"), "GetStats", pb.StatsRequest())
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stats = call(server.address, creds(certs, "ops-token", client="bob"), "GetStats", pb.StatsRequest())
        assert stats.sessions_opened >= 1  # a token names the client over its certificate


def test_the_pool_with_tls_and_tokens_and_its_replicas_closed_to_strangers(certs, tmp_path, reference):
    """One replica behind the front, TLS and tokens: exact output through the front, stats for admins,
    the replica (TLS with the front's certificate) refuses a client's token and plaintext alike, and a
    token revoked at the front ends its open session there, with UNAUTHENTICATED, within seconds."""
    pytest.importorskip("ray")
    from cluster.config import PoolConfig, ReplicaConfig, ScalingConfig
    from tools.rig.localray import local_ray, running_pool
    from verifier_service.servicer import ServerConfig

    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(TOKENS)
    tls = TlsConfig.from_files(certs.cert("server"), certs.key("server"))
    front_config = ServerConfig(host="127.0.0.1", port=0, tls=tls, auth=AuthConfig(tokens_file=tokens_file))
    config = PoolConfig(
        replica=ReplicaConfig(DEMO / "target", ServerConfig(host="127.0.0.1", port=0), num_cpus=0.5),
        scaling=ScalingConfig(min_replicas=1, max_replicas=1),
        front=front_config,
    )

    async def scenario():
        async with running_pool(config) as (pool, address):
            alice = creds(certs, "alice-token")
            drafter = LlamaDrafter(DrafterConfig(DRAFT))
            async with wire.channel(address, alice) as channel:
                request = GenerationRequest(PROMPT, SamplingParams(), 24, gamma=3, ignore_eos=True)
                ids, _ = await EdgeSession(channel, drafter).run(request)
                assert ids == reference(PROMPT)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            async with wire.channel(address, creds(certs, "ops-token")) as channel:
                stats = await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())
                assert stats.sessions_opened == 1 and stats.generated_tokens == 24
            async with wire.channel(address, wire.PLAINTEXT) as channel:  # plaintext at the front
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            [replica] = [info.address for info in pool.info.values()]
            for credentials, code in (
                (alice, grpc.StatusCode.UNAUTHENTICATED),  # a client's token is not the pool's secret
                (creds(certs, client="alice"), grpc.StatusCode.UNAUTHENTICATED),  # nor is a certificate
                (wire.PLAINTEXT, grpc.StatusCode.UNAVAILABLE),  # the replica serves TLS only
            ):
                async with wire.channel(replica, credentials) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
                    assert e.value.code() == code
            async with wire.channel(address, creds(certs, "bob-token")) as channel:
                call = pb_grpc.VerifierStub(channel).Session()
                stop = pb.StopConditions(max_new_tokens=64, ignore_eos=True)
                await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=PROMPT, stop=stop)))
                assert (await call.read()).WhichOneof("kind") == "opened"
                new = tokens_file.with_suffix(".new")
                new.write_text(TOKENS.replace("bob bob-token", "# bob revoked"))
                new.replace(tokens_file)
                revoked_at = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                took = time.monotonic() - revoked_at
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in e.value.details()
                assert took < 2 * config.front.lifetime.recheck_s + 2
            async with wire.channel(address, creds(certs, "ops-token")) as channel:
                for _ in range(100):  # the replica's session ended with the front's call
                    stats = await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())
                    if stats.active_sessions == 0:
                        break
                    await asyncio.sleep(0.05)
                assert stats.active_sessions == 0

    with local_ray(num_cpus=2):
        asyncio.run(scenario())
