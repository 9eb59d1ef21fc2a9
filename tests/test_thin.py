"""Thin clients: a session opened without a draft is decoded by the verifier itself, batched with the other
sessions' rounds, with no draft (the target alone) or with its own prompt-lookup drafts; either way the
output is the target alone's, greedy and seeded."""

import asyncio
import json
import subprocess

import grpc
import pytest

from draftwire.contract import Drafting, SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, VerifierError
from tools.bench.prompts import heldout_prompts
from tools.testkit.serverproc import DRAFTWIRE
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

NEW = 32


@pytest.fixture(scope="module")
def prompts(test_pair):
    return heldout_prompts(test_pair.target_dir, 6, 40)


@pytest.fixture(scope="module")
def engine(test_pair):
    return TargetEngine.load(test_pair.target_dir, dtype="float32")  # as the `server` fixture runs


def _stats(address: str) -> pb.ServerStats:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest(), timeout=10)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, seed=5)], ids=["greedy", "seeded"])
def test_thin_sessions_equal_the_target_alone_batched_with_drafted_ones(
    server, test_pair, prompts, engine, params
):
    drafter = LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=512))
    modes = [Drafting.NONE, Drafting.NGRAM, Drafting.NGRAM, Drafting.NONE, Drafting.EDGE, Drafting.EDGE]
    before = _stats(server.address)

    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            thin = EdgeSession(channel, None)
            edge = EdgeSession(channel, drafter)
            runs = [
                (edge if mode is Drafting.EDGE else thin).run(
                    GenerationRequest(
                        prompt, params, NEW, gamma=4, ignore_eos=True, pipeline=1, drafting=mode
                    )
                )
                for prompt, mode in zip(prompts, modes, strict=True)
            ]
            return await asyncio.gather(*runs)

    results = asyncio.run(run())
    after = _stats(server.address)
    for prompt, mode, (ids, stats) in zip(prompts, modes, results, strict=True):
        assert ids == reference_decode(engine, SessionSpec(prompt, params, NEW, ignore_eos=True)), mode
        if mode is Drafting.NONE:
            assert stats.rounds == NEW and stats.draft_tokens == 0
    assert after.thin_sessions - before.thin_sessions == 4
    # The thin sessions' rounds shared forward passes with the others.
    assert (after.engine_forwards - before.engine_forwards) > (after.engine_batches - before.engine_batches)


def test_server_drafting_accepts_tokens_where_the_text_repeats(server, engine):
    # A prompt that repeats itself: prompt lookup proposes the repetition, the target accepts much of it.
    prompt = tuple([5, 9, 14, 20, 33, 41, 52, 60] * 6)
    expected = reference_decode(engine, SessionSpec(prompt, max_new_tokens=NEW, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            request = GenerationRequest(prompt, max_new_tokens=NEW, ignore_eos=True, drafting=Drafting.NGRAM)
            return await EdgeSession(channel, None).run(request)

    ids, stats = asyncio.run(run())
    assert ids == expected
    assert stats.draft_tokens > 0 and stats.rounds <= NEW


def test_a_proposal_in_a_thin_session_is_refused(server):
    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            open_ = pb.OpenSession(prompt_token_ids=[5, 6, 7], drafting=pb.DRAFTING_NONE)
            open_.stop.max_new_tokens = 400
            await call.write(pb.EdgeMessage(open=open_))
            await call.write(
                pb.EdgeMessage(proposal=pb.Proposal(round=1, start_position=3, draft_token_ids=[1]))
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                while True:
                    await call.read()
            return refused.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "thin session" in error.details()


def test_generate_without_a_draft(server, test_pair):
    ids = "15,27,300,102,77,5,90"
    common = ["--prompt-ids", ids, "--max-new-tokens", "20", "--ignore-eos", "--json"]
    outs = [
        subprocess.run(
            [DRAFTWIRE, "generate", "--server", server.address, *extra, *common],
            capture_output=True,
            text=True,
            timeout=300,
        )
        for extra in ([], ["--server-drafting", "none"], ["--draft", str(test_pair.draft_q4_0)])
    ]
    for out in outs:
        assert out.returncode == 0, out.stderr
    thin, alone, drafted = (json.loads(o.stdout) for o in outs)
    assert thin["token_ids"] == alone["token_ids"] == drafted["token_ids"] and len(thin["token_ids"]) == 20
    assert alone["stats"]["rounds"] == 20
    refused = subprocess.run(
        [DRAFTWIRE, "generate", "--server", server.address, "--prompt", "text needs a vocabulary"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--vocab" in refused.stderr


def test_a_thin_open_with_a_bad_prompt_is_refused(server):
    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            request = GenerationRequest((10**9,), max_new_tokens=4, drafting=Drafting.NONE)
            await EdgeSession(channel, None).run(request)

    with pytest.raises(VerifierError) as refused:
        asyncio.run(run())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
