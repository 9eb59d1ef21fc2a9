"""The wire contract and the server's bookkeeping: generated code, reflection, model info, KV reuse."""

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from draftwire import wire
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire.vocab import vocabulary_from_hf
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from verifier_service.engine import model_name

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path):
    out = [f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    proto = str(ROOT / "proto/draftwire/v1/draftwire.proto")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", *out, proto], check=True
    )
    for name in ("draftwire_pb2.py", "draftwire_pb2.pyi", "draftwire_pb2_grpc.py"):
        fresh = (tmp_path / "draftwire/v1" / name).read_text()
        assert fresh == (ROOT / "draftwire/v1" / name).read_text(), (
            f"{name} is stale: run scripts/gen_proto.sh"
        )


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in reply.list_services_response.service}
    assert {"draftwire.v1.Verifier", "grpc.health.v1.Health"} <= names


def test_model_info_describes_the_target(server, test_pair):
    tokenizer = AutoTokenizer.from_pretrained(test_pair.target_dir)
    with grpc.insecure_channel(server.address) as channel:
        info = pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())
    expected = vocabulary_from_hf(tokenizer)
    assert info.target_id == model_name(test_pair.target_dir) != "target"
    assert (info.vocab_size, info.tokenizer_fingerprint) == (expected.size, expected.fingerprint)
    assert info.max_gamma == 8 and info.max_context == 512
    assert list(info.special_tokens.eos_token_ids) == [tokenizer.eos_token_id]
    assert info.special_tokens.bos_token_id == tokenizer.bos_token_id
    assert info.max_message_bytes == wire.message_bytes_for(512)  # what the context needs (serve's default)


def test_draft_and_target_fingerprints_agree(test_pair):
    drafter = LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=64))
    tokenizer = AutoTokenizer.from_pretrained(test_pair.target_dir)
    assert drafter.vocabulary == vocabulary_from_hf(tokenizer)


async def _stats(address) -> pb.ServerStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())


@pytest.mark.parametrize("gamma", [2, 5])
def test_kv_caches_are_reused_not_recomputed(server, test_pair, gamma):
    """Each round costs the target gamma + 1 positions and the draft only its new tokens: neither side
    runs the prefix again. The verifier's count comes back in every verdict and in GetStats."""
    drafter = LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=512))
    prompt = tuple(range(40, 70))
    request = GenerationRequest(prompt, max_new_tokens=60, gamma=gamma, ignore_eos=True)

    async def run():
        before = await _stats(server.address)
        async with grpc.aio.insecure_channel(server.address) as channel:
            ids, stats = await EdgeSession(channel, drafter).run(request)
        return before, await _stats(server.address), ids, stats

    before, after, ids, stats = asyncio.run(run())
    assert len(ids) == 60
    # The prefill: the prompt but its last token, less what a kept cache of an earlier session with this
    # prompt (the other gamma's run) held.
    prefill = len(prompt) - 1 - stats.reused_positions
    assert after.reused_positions - before.reused_positions == stats.reused_positions
    # Rounds near the end may carry fewer draft tokens than gamma (the budget), never more.
    assert stats.target_positions <= prefill + stats.rounds * (gamma + 1)
    assert stats.target_positions >= prefill + stats.draft_tokens + stats.rounds
    assert after.rounds - before.rounds == stats.rounds
    assert after.generated_tokens - before.generated_tokens == 60
    assert after.prefill_positions - before.prefill_positions == prefill
    assert after.round_positions - before.round_positions == stats.target_positions - prefill
    assert after.target_positions_per_token > 0
    # The draft evaluates the prompt once, then per round its own draft tokens and the new commits.
    assert drafter.evaluated_positions <= len(prompt) + stats.draft_tokens + 2 * stats.rounds
