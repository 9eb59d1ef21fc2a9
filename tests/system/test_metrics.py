"""Prometheus metrics and `draftwire top` of a live verifier, checked against a known run: the counters
equal what the edge saw, with vLLM's spec-decode names."""

import asyncio
import json
import socket
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import DRAFTWIRE, ServerProcess, listening

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
GAMMA, NEW = 4, 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture(scope="module")
def run():
    port = _free_port()
    with ServerProcess(DEMO / "target", "--metrics-port", str(port)) as server:
        drafter = LlamaDrafter(DrafterConfig(DEMO / "draft-q8_0.gguf"))
        request = GenerationRequest(
            tuple(range(40, 60)), max_new_tokens=NEW, gamma=GAMMA, ignore_eos=True, pipeline=2
        )

        async def go():
            async with grpc.aio.insecure_channel(server.address) as channel:
                ids, stats = await EdgeSession(channel, drafter).run(request)
                bad = pb_grpc.VerifierStub(channel).Session()
                await bad.write(pb.EdgeMessage(open=pb.OpenSession()))  # an empty prompt
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await bad.read()
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            return ids, stats

        ids, stats = asyncio.run(go())
        metrics = _scrape(f"http://127.0.0.1:{port}/metrics")
        top = subprocess.run(
            [DRAFTWIRE, "top", server.address, "--once"], capture_output=True, text=True, timeout=60
        )
        yield ids, stats, metrics, top


def test_the_spec_decode_counters_equal_the_edges_run(run):
    ids, stats, m, _ = run
    value = lambda name, **labels: m[("draftwire:" + name, tuple(sorted(labels.items())))]  # noqa: E731
    assert len(ids) == NEW
    # The verifier does not verify draft tokens past the budget: a last round whose budget is one token
    # verifies no draft (the edge counts it, the verifier's drafts do not), and it may count a few fewer
    # draft tokens.
    assert stats.rounds - 1 <= value("spec_decode_num_drafts_total") <= stats.rounds
    assert value("spec_decode_num_accepted_tokens_total") == stats.accepted_tokens
    assert stats.draft_tokens - GAMMA <= value("spec_decode_num_draft_tokens_total") <= stats.draft_tokens
    per_position = [
        value("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(GAMMA)
    ]
    assert sum(per_position) == stats.accepted_tokens
    assert per_position == sorted(per_position, reverse=True)  # accepting position i needs i - 1 accepted
    assert value("stale_proposals_total") == stats.stale_rounds
    assert value("generated_tokens_total") == NEW
    assert value("sessions_total") == 1
    assert value("refusals_total", code="INVALID_ARGUMENT") == 1
    assert value("active_sessions") == 0
    batches = value("engine_batch_size_count")
    assert batches == value("engine_batch_seconds_count") >= stats.rounds
    assert value("engine_batch_size_bucket", le="+Inf") == batches
    assert value("engine_batch_size_sum") >= batches
    # Each verdict says how long its forward pass took and how many sessions shared it.
    assert stats.verify_s > 0 and stats.batched_with == stats.rounds  # alone on the server
    # The γ cap the verdicts advertised: the gauge holds the last one (nothing ran after it).
    assert 1 <= stats.min_gamma_cap <= stats.gamma_cap == value("spec_decode_gamma_cap") <= 16


def test_top_shows_the_same_figures(run):
    _, stats, _, top = run
    assert top.returncode == 0, top.stderr
    figures = json.loads(top.stdout)
    assert figures["sessions_opened"] == 1 and figures["refusals"] == {"INVALID_ARGUMENT": 1}
    assert figures["active_sessions"] == 0 and figures["prefill_computed"] == 19
    assert figures["gamma_cap"] == stats.gamma_cap


def test_metrics_listen_on_loopback_even_when_the_service_listens_everywhere():
    """Plain HTTP with no authentication: `serve --host 0.0.0.0` keeps its metrics on 127.0.0.1 unless
    --metrics-host says otherwise."""
    port = _free_port()
    with ServerProcess(DEMO / "target", "--host", "0.0.0.0", "--metrics-port", str(port)) as server:
        everywhere = listening(int(server.address.rsplit(":", 1)[1]))
        assert everywhere and everywhere <= {"00000000", "0" * 32}  # the service: 0.0.0.0 or [::]
        assert listening(port) == {"0100007F"}  # 127.0.0.1
        assert (
            "draftwire:"
            in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        )


def test_the_numerics_gauge_names_the_path_the_session_ran_on(run):
    _, stats, m, _ = run
    infos = [dict(labels) for name, labels in m if name == "draftwire:numerics_info"]
    assert len(infos) == 1 and infos[0]["exact"] == "true"
    n = infos[0]
    assert stats.numerics == f"{n['dtype']}/{n['kernels']}/{n['device']}/exact"  # the edge's SessionOpened
