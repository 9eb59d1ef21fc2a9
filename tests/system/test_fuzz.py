"""The fuzz campaign (tools/stress/fuzz.py), short and seeded: on a real `serve`, no crash, no hang, no
INTERNAL, health SERVING and a bystander session reproducing its output throughout; and the two fixes it
led to."""

import grpc
import pytest
from grpc_health.v1 import health_pb2

from draftwire.v1 import draftwire_pb2 as pb
from tools.rig.serverproc import ServerProcess
from tools.stress.fuzz import DEEP, FuzzConfig, raw_call, run_campaign, start_secured

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CORRUPT = b"\xff\xff"  # a varint that never ends: no protobuf message parses from it


@pytest.fixture(scope="module")
def fuzzed(test_pair):
    with ServerProcess(test_pair.target_dir, "--max-gamma", "8", *DEEP) as server:
        yield server


def test_a_seeded_campaign_finds_no_crash_hang_or_internal(fuzzed):
    figures = run_campaign(
        fuzzed.address,
        FuzzConfig(examples=250, seed=15, deadline_s=20.0, bystander_tokens=16),
        alive=lambda: fuzzed.proc.poll() is None,
        log=lambda _: None,
    )
    report = figures.report()
    assert figures.sessions > 100 and figures.messages > 200, report
    # Deep: the live cases open valid sessions and follow their state. In a fresh clone (no example
    # database), seeds 1 to 4 and 15 opened 114 to 159 sessions and verified 442 to 1,009 rounds.
    assert figures.opened >= 50 and figures.verified >= 150, report
    assert figures.crashes == 0 and figures.hangs == 0, report
    assert figures.internal == 0 and figures.server_internal == 0, report
    assert figures.bystander_runs > 0 and figures.bystander_mismatches == 0, report
    assert figures.bystander_errors == 0 and figures.serving, report
    assert fuzzed.healthy()


@pytest.fixture(scope="module")
def secured(test_pair, tmp_path_factory):
    # No fair-share caps: the campaign's fuzzed opens run under one token, whose refusals and sessions
    # would otherwise count against the known token's own calls (tests/wire/test_fair_share.py has those).
    server, secured = start_secured(
        test_pair.target_dir,
        tmp_path_factory.mktemp("secured"),
        "--max-gamma",
        "8",
        "--max-refused-opens-per-s",
        "0",
        "--max-sessions-per-client",
        "0",
    )
    with server:
        yield server, secured


def test_a_seeded_campaign_with_tls_and_tokens_lets_in_only_known_tokens(secured):
    """Fuzzed `authorization` metadata (random, empty, oversize, near-miss and non-ASCII tokens, other
    schemes, repeated headers, a front's headers; what grpc's client refuses to send goes by hand) is
    refused with UNAUTHENTICATED (past gRPC's 16 KiB metadata limit, RESOURCE_EXHAUSTED), a known token's
    calls work, and the rest of the campaign runs behind the token."""
    server, how = secured
    figures = run_campaign(
        server.address,
        FuzzConfig(examples=200, seed=15, deadline_s=20.0, bystander_tokens=16),
        alive=lambda: server.proc.poll() is None,
        log=lambda _: None,
        secured=how,
    )
    report = figures.report()
    # Fresh HOME, seeds 1 to 4 and 15: 133 to 163 auth cases, 54 to 103 refused, 27 to 51 admitted, 29
    # to 95 UNAUTHENTICATED statuses, 36 to 53 sessions opened.
    assert figures.auth_cases >= 80 and figures.auth_refused >= 30 and figures.auth_admitted >= 12, report
    assert figures.auth_wrong == 0, figures.findings
    assert figures.statuses["UNAUTHENTICATED"] >= 15 and figures.opened >= 18, report
    assert figures.crashes == 0 and figures.hangs == 0, report
    assert figures.internal == 0 and figures.server_internal == 0, report
    assert figures.bystander_runs > 0 and figures.bystander_mismatches == 0, report
    assert figures.bystander_errors == 0 and figures.serving, report
    assert server.healthy()


def test_bytes_that_are_no_edge_message_are_invalid_argument(fuzzed):
    with grpc.insecure_channel(fuzzed.address) as channel:
        session = channel.stream_stream("/draftwire.v1.Verifier/Session")
        with pytest.raises(grpc.RpcError) as refused:
            list(session(iter([CORRUPT]), timeout=20))
    assert refused.value.code() == INVALID, refused.value.details()
    assert "not an EdgeMessage" in refused.value.details()


@pytest.mark.parametrize("method", ["GetModelInfo", "GetStats"])
def test_unary_requests_that_do_not_parse_are_invalid_argument(fuzzed, method):
    with grpc.insecure_channel(fuzzed.address) as channel:
        call = channel.unary_unary(f"/draftwire.v1.Verifier/{method}")
        with pytest.raises(grpc.RpcError) as refused:
            call(CORRUPT, timeout=20)
        assert refused.value.code() == INVALID, refused.value.details()
        assert f"not a {method} request" in refused.value.details()
        pb.ModelInfo.FromString(channel.unary_unary("/draftwire.v1.Verifier/GetModelInfo")(b"", timeout=20))


def test_a_health_watch_whose_request_does_not_parse_is_invalid_argument(fuzzed):
    """It got UNKNOWN (grpc's "Unexpected DecodeError"); a name it does not know is answered, not refused."""
    with grpc.insecure_channel(fuzzed.address) as channel:
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(watch(CORRUPT, timeout=20)))
        assert refused.value.code() == INVALID, refused.value.details()
        assert "not a Watch request" in refused.value.details()
        unknown = watch(
            health_pb2.HealthCheckRequest(service="\u00e9" * 1000).SerializeToString(), timeout=20
        )
        first = health_pb2.HealthCheckResponse.FromString(next(iter(unknown)))
        assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()


@pytest.mark.parametrize(
    "value", ["Bearer tökén".encode(), b"Bearer \xff\xfe", b"Bearer a\r\nb", b"Bearer \x00"]
)
def test_an_authorization_value_grpc_clients_refuse_to_send_is_unauthenticated(secured, value):
    """Sent by hand on HTTP/2 (grpc's client refuses such values): still UNAUTHENTICATED."""
    server, how = secured
    status, details = raw_call(
        server.address, how.ca, "/draftwire.v1.Verifier/GetModelInfo", [(b"authorization", value)], b"", 20
    )
    assert status == grpc.StatusCode.UNAUTHENTICATED.value[0], (status, details)
    token = [(b"authorization", f"Bearer {how.token}".encode())]
    assert raw_call(server.address, how.ca, "/draftwire.v1.Verifier/GetModelInfo", token, b"", 20)[0] == 0
