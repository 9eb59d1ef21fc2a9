"""Thin clients: a session opened without a draft is decoded by the verifier itself, batched with the other
sessions' rounds, with no draft (the target alone) or with its own prompt-lookup drafts; either way the
output is the target alone's, greedy and seeded."""

import asyncio
import json
import subprocess
import time

import grpc
import pytest

from draftwire.contract import Drafting, SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.models.prompts import heldout_prompts
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, VerifierError
from tools.rig.serverproc import DRAFTWIRE, ServerProcess
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


@pytest.fixture(scope="module")
def short_reads(test_pair):
    """Thin sessions decoded at most 8 tokens past what their edge has read; silent ones end after 3 s."""
    args = ["--dtype", "float32", "--thin-read-ahead", "8", "--idle-timeout-s", "3"]
    with ServerProcess(test_pair.target_dir, *args) as server:
        yield server


def _thin_open(prompt, max_new: int, drafting=pb.DRAFTING_NONE) -> pb.EdgeMessage:
    stop = pb.StopConditions(max_new_tokens=max_new, ignore_eos=True)
    return pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt, stop=stop, drafting=drafting))


class _Replies:
    """A stream's replies as they arrive, read by a task of its own (a read is never cancelled)."""

    def __init__(self, call):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._read(call))

    async def _read(self, call):
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                self.queue.put_nowait(message)
        except grpc.aio.AioRpcError as e:
            self.queue.put_nowait(e)

    async def committed_until_quiet(self, quiet_s: float = 1.0) -> int | None:
        """The committed length of the last verdict before none arrives for `quiet_s`."""
        last = None
        while True:
            try:
                message = await asyncio.wait_for(self.queue.get(), quiet_s)
            except TimeoutError:
                return last
            if isinstance(message, grpc.aio.AioRpcError):
                raise message
            if message.WhichOneof("kind") == "verdict":
                last = message.verdict.committed_length

    async def error(self, within_s: float) -> grpc.aio.AioRpcError:
        while not isinstance(
            message := await asyncio.wait_for(self.queue.get(), within_s), grpc.aio.AioRpcError
        ):
            pass
        return message


def test_a_thin_session_runs_no_further_ahead_of_its_reader_than_read_ahead(short_reads):
    async def run():
        async with grpc.aio.insecure_channel(short_reads.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(_thin_open([5, 6, 7], 400))
            replies = _Replies(call)
            opened = (await replies.queue.get()).opened
            unread = await replies.committed_until_quiet()
            await call.write(pb.EdgeMessage(read=pb.Read(committed_length=3 + 5)))
            after_read = await replies.committed_until_quiet()
            start = time.monotonic()
            silent = await replies.error(10)
            return opened, unread, after_read, silent, time.monotonic() - start

    opened, unread, after_read, silent, waited = asyncio.run(run())
    # The target alone commits one token a round: exactly read_ahead past the open, then past the Read.
    assert opened.read_ahead == 8 and opened.committed_length == 3
    assert unread == 3 + 8 and after_read == 3 + 5 + 8
    # An edge that reads no more holds nothing for long: the idle timeout ends the session.
    assert silent.code() == grpc.StatusCode.DEADLINE_EXCEEDED and waited < 3 + 2


@pytest.mark.parametrize(
    "drafting, read, refusal",
    [
        (pb.DRAFTING_NONE, 3 + 9, "read up to 12"),  # past the committed tokens
        (pb.DRAFTING_NONE, 2, "read up to 2"),  # before the open's committed length
        (pb.DRAFTING_EDGE, 3, "only a thin session"),
    ],
)
def test_a_read_out_of_bounds_or_in_an_edge_session_is_refused(short_reads, drafting, read, refusal):
    async def run():
        async with grpc.aio.insecure_channel(short_reads.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(_thin_open([5, 6, 7], 400, drafting))
            replies = _Replies(call)
            await replies.committed_until_quiet(0.5)
            await call.write(pb.EdgeMessage(read=pb.Read(committed_length=read)))
            return await replies.error(10)

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and refusal in error.details()


@pytest.mark.parametrize("drafting", [Drafting.NONE, Drafting.NGRAM])
def test_an_edge_that_reads_goes_past_read_ahead_to_the_target_alone_s_tokens(short_reads, engine, drafting):
    prompt = tuple([5, 9, 14, 20, 33, 41, 52, 60] * 3)
    expected = reference_decode(engine, SessionSpec(prompt, max_new_tokens=40, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(short_reads.address) as channel:
            request = GenerationRequest(prompt, max_new_tokens=40, ignore_eos=True, drafting=drafting)
            return await EdgeSession(channel, None).run(request)

    ids, _ = asyncio.run(run())
    assert ids == expected
