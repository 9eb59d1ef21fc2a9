"""Bad input gets a clear status; the server, other sessions and committed tokens survive it."""

import asyncio
from pathlib import Path

import grpc
import pytest

from draftwire.contract import SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire.vocab import vocabulary_from_llama
from draftwire_cli.models.kit import llama_cpp_source_dir
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.llama_runtime import Llama
from edge_client.session import EdgeSession, GenerationRequest, VerifierError
from tests.bad_input_cases import (
    CASES,
    INVALID,
    PRECONDITION,
    PROMPT,
    START,
    exchange,
    open_msg,
    proposal,
    refused,
)
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode


@pytest.fixture(scope="module")
def info(server) -> pb.ModelInfo:
    with grpc.insecure_channel(server.address) as channel:
        return pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())


def test_assumed_tokens_decide_staleness_even_after_a_finish(server, info):
    """A pipelined proposal is verified only if the committed tokens before it are the ones it assumed;
    one that a finish made obsolete is answered stale, not refused."""
    first = [1, 2, 3]
    replies, error = asyncio.run(
        exchange(server.address, [open_msg(info, max_new=40), proposal(1, START, first)])
    )
    assert error is None
    v = replies[-1].verdict
    committed = PROMPT + first[: v.accepted] + [v.target_token_id]
    end = len(committed)
    wrong, right = (committed[-1] + 1) % info.vocab_size, committed[-1]
    messages = [
        open_msg(info, max_new=40),
        proposal(1, START, first),
        proposal(2, end, [7], assumed=[wrong]),  # built on a token that was not committed
        proposal(3, end, [7], assumed=[committed[-2], right]),  # the committed ones: verified
    ]
    replies, error = asyncio.run(exchange(server.address, messages))
    assert error is None
    verdicts = [r.verdict for r in replies if r.WhichOneof("kind") == "verdict"]
    assert [v.stale for v in verdicts] == [False, True, False]
    assert verdicts[2].committed_length > end

    finishing = [open_msg(info, max_new=1), proposal(1, START, [1]), proposal(2, START + 2, [1])]
    replies, error = asyncio.run(exchange(server.address, finishing))
    assert error is None, error
    verdicts = [r.verdict for r in replies if r.WhichOneof("kind") == "verdict"]
    assert verdicts[0].finish_reason == pb.FINISH_REASON_LENGTH and verdicts[1].stale


@pytest.mark.parametrize("build, code, pattern", CASES)
def test_bad_input_is_refused_and_the_server_survives(server, info, build, code, pattern):
    refused(server.address, build(info), code, pattern)
    assert server.healthy()


def test_oversize_message_is_resource_exhausted(server, info):
    huge = open_msg(info, prompt=[300] * 700_000)  # 2 bytes an id: 1.4 MB, over the 1 MiB limit
    refused(server.address, [huge], grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    assert server.healthy()


def test_mismatched_vocabulary_names_both(server, info):
    """A real other vocabulary: GPT-2's, from llama.cpp's vocabulary-only GGUF."""
    gguf = llama_cpp_source_dir() / "vendor/llama.cpp/models/ggml-vocab-gpt-2.gguf"
    llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    other = vocabulary_from_llama(llm)
    message = open_msg(info, fingerprint=other.fingerprint)
    message.open.vocab_size = other.size
    refused(server.address, [message], PRECONDITION, "vocabulary mismatch")
    _, error = asyncio.run(exchange(server.address, [message]))
    details = error.details()
    assert str(other.size) in details and other.fingerprint[:16] in details
    assert str(info.vocab_size) in details and info.tokenizer_fingerprint[:16] in details


async def stats(address) -> pb.ServerStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())


def test_cancel_mid_stream_frees_the_kv_cache(server, info):
    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(info, max_new=64))
            await call.write(proposal(1, START, [1, 2]))
            assert (await call.read()).WhichOneof("kind") == "opened"
            assert (await call.read()).WhichOneof("kind") == "verdict"
            during = (await stats(server.address)).active_sessions
            call.cancel()
        for _ in range(100):
            if (await stats(server.address)).active_sessions == 0:
                return during, 0
            await asyncio.sleep(0.05)
        return during, (await stats(server.address)).active_sessions

    during, after = asyncio.run(scenario())
    assert during >= 1
    assert after == 0


@pytest.fixture(scope="module")
def drafter(test_pair):
    return LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=512))


@pytest.fixture(scope="module")
def expected(test_pair) -> list[int]:
    engine = TargetEngine.load(Path(test_pair.target_dir), dtype="float32")
    return reference_decode(engine, SessionSpec(tuple(PROMPT), max_new_tokens=40, ignore_eos=True))


def test_other_sessions_survive_bad_neighbours(server, info, drafter, expected):
    """A good session runs while bad ones are refused beside it, and its output is untouched."""

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            session = EdgeSession(channel, drafter)
            good = asyncio.create_task(
                session.run(GenerationRequest(tuple(PROMPT), max_new_tokens=40, gamma=3, ignore_eos=True))
            )
            errors = []
            for build, _, _ in (c.values for c in CASES):
                _, error = await exchange(server.address, build(info))
                errors.append(error)
            return await good, errors

    (ids, _), errors = asyncio.run(scenario())
    assert all(e is not None for e in errors)
    assert ids == expected


def test_committed_tokens_survive_a_refused_proposal_and_resume(server, info, drafter, expected):
    """Three good rounds, then an out-of-order proposal ends the stream; resuming with the committed
    tokens finishes with exactly the undisturbed output."""

    async def scenario():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(open_msg(info, max_new=40))
            committed: list[int] = []
            for round_no in (1, 2, 3):
                draft = drafter.propose(PROMPT + committed, 3, SamplingParams())
                await call.write(proposal(round_no, len(PROMPT) + len(committed), draft))
                reply = await call.read()
                while reply.WhichOneof("kind") != "verdict":
                    reply = await call.read()
                v = reply.verdict
                committed += draft[: v.accepted] + (
                    [v.target_token_id] if v.HasField("target_token_id") else []
                )
            await call.write(proposal(7, len(PROMPT) + len(committed), [1]))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call.read()
            assert error.value.code() == INVALID
            before_resume = list(committed)
            session = EdgeSession(channel, drafter)
            # The resumed stream pipelines: its first proposals build on the resumed committed tokens.
            request = GenerationRequest(
                tuple(PROMPT), max_new_tokens=40, gamma=3, ignore_eos=True, pipeline=2
            )
            async for _ in session.generate(request, generated=committed):
                pass
            return before_resume, committed

    before, final = asyncio.run(scenario())
    assert len(before) >= 3
    assert final[: len(before)] == before == expected[: len(before)]
    assert final == expected


def test_verifier_error_carries_the_status(server, drafter):
    """The first proposal leaves right behind the open and races the refusal of a bad open (the gRPC
    core then reports a bare INTERNAL): the edge still reports the verifier's status, every time."""

    async def scenario() -> list[grpc.StatusCode]:
        codes = []
        # A connection of its own each time, and at most 10 refusals a second: one client's opens
        # refused more than --max-refused-opens-per-s (20) in a second are refused unread
        # (tests/wire), and every connection from this host is one anonymous client.
        own = [("grpc.use_local_subchannel_pool", 1)]
        await asyncio.sleep(1.0)  # past the refusals of the tests before, on the same server
        for _ in range(30):
            await asyncio.sleep(0.1)
            async with grpc.aio.insecure_channel(server.address, options=own) as channel:
                try:
                    await EdgeSession(channel, drafter).run(
                        GenerationRequest(tuple(PROMPT), max_new_tokens=600)
                    )
                except VerifierError as e:
                    codes.append(e.code)
        return codes

    assert asyncio.run(scenario()) == [INVALID] * 30
