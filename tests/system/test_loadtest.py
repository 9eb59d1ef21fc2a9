"""`draftwire loadtest` at small scale against `draftwire serve --ray` (a private local Ray cluster, two
replicas), both through the real CLI."""

import json
import subprocess

import grpc
import pytest

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.loadtest import report_text
from tools.rig.serverproc import DRAFTWIRE, ServerProcess

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pool_server(test_pair):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")  # a private loopback cluster; see docs/cluster.md
        env.delenv("RAY_ADDRESS", raising=False)  # no --address and no RAY_ADDRESS: a local cluster
        flags = ["--ray", "--replicas", "2", "--replica-cpus", "0.5", "--replica-host", "127.0.0.1"]
        server = ServerProcess(test_pair.target_dir, *flags, "--max-gamma", "8", timeout=240)
    yield server
    server.stop()


def test_loadtest_drives_concurrent_sessions_through_the_pool(pool_server):
    command = [DRAFTWIRE, "loadtest", "--server", pool_server.address, "--sessions", "4", "--duration", "3"]
    command += ["--new-tokens", "16", "--prompts", "4", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == {} and report["mismatches"] == 0 and report["resumes"] == 0
    assert report["generations"] >= 4 and report["tokens"] == 16 * report["generations"]
    assert 0 < report["p50_round_ms"] <= report["p99_round_ms"]
    assert 0 < report["acceptance_rate"] < 1 and report["tokens_per_s"] > 0
    assert "p99" in report_text(report)
    with grpc.insecure_channel(pool_server.address) as channel:
        stats = pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())
    # Over both replicas: the load's rounds plus the recording's (one per distinct prompt).
    assert stats.rounds >= report["rounds"] and stats.sessions_opened >= report["generations"] + 4
    assert pool_server.healthy()


def test_loadtest_mixes_thin_and_edge_sessions(server):
    """--drafting mix: a third of the sessions each edge, none and ngram, all exact, reported per kind."""
    command = [DRAFTWIRE, "loadtest", "--server", server.address, "--sessions", "6", "--duration", "2"]
    command += ["--new-tokens", "12", "--prompts", "3", "--drafting", "mix", "--json"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["drafting"] == "mix" and report["errors"] == {} and report["mismatches"] == 0
    kinds = report["by_kind"]
    assert sorted(kinds) == ["edge", "ngram", "none"]
    for kind in kinds.values():
        assert kind["sessions"] == 2 and kind["generations"] >= 2 and kind["mismatches"] == 0
        assert kind["tokens"] == 12 * kind["generations"] and kind["ttft_ms_p50"] > 0
    assert sum(k["tokens"] for k in kinds.values()) == report["tokens"]
    assert kinds["none"]["tokens_per_round"] == 1.0 and kinds["none"]["acceptance_rate"] is None
    assert kinds["edge"]["tokens_per_round"] > 1.0  # replayed drafts, 80 % of them on script
    text = report_text(report)
    assert "  none: 2 sessions" in text and "  edge: 2 sessions" in text
