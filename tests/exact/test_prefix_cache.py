"""Conversation caches on the verifier: a finished session's KV cache is kept (memory budget, least recently
used first, time limit) and a new session whose tokens extend it starts from it; the output is unchanged.
The edge's draft keeps its llama.cpp cache across turns likewise.
"""

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from draftwire.contract import SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from verifier_service.engine import PrefixCacheConfig, TargetEngine
from verifier_service.kv import GrowingLayer, PrefixCache, SessionCache
from verifier_service.servicer import ServerConfig, start_server
from verifier_service.session import reference_decode

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def _cache(tokens: list[int], layers: int = 2) -> SessionCache:
    cache = SessionCache([GrowingLayer() for _ in range(layers)])
    for layer in cache.layers:
        states = torch.zeros(1, 1, len(tokens), 4)
        layer.append(states, states)
    cache.tokens = list(tokens)
    return cache


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_longest_shared_prefix_is_taken_and_moves_out():
    kept = PrefixCache(PrefixCacheConfig(budget_bytes=1 << 20))
    kept.put(_cache([1, 2, 3, 4]))
    kept.put(_cache([1, 2, 9]))
    kept.put(_cache([7, 7]))
    cache, n = kept.take([1, 2, 3, 5, 6])
    assert n == 3 and cache.tokens == [1, 2, 3, 4]
    assert len(kept) == 2  # taken: a session owns it now
    assert kept.take([8]) == (None, 0)
    cache, n = kept.take([1, 2])  # at most the tokens asked for
    assert n == 2 and cache.tokens == [1, 2, 9]


def test_the_budget_drops_the_least_recently_kept_and_the_ttl_drops_old_ones():
    one = _cache([1] * 64).nbytes  # each cache of 64 positions has the same size
    clock = Clock()
    kept = PrefixCache(PrefixCacheConfig(budget_bytes=2 * one, ttl_s=10), clock)
    for first in (1, 2, 3):
        kept.put(_cache([first] * 64))
        clock.now += 1
    assert len(kept) == 2 and kept.bytes == 2 * one
    assert kept.take([1])[0] is None  # the oldest went to make room
    assert kept.take([3])[1] == 1
    clock.now += 10
    assert kept.take([2]) == (None, 0) and kept.bytes == 0  # older than the time limit
    kept.put(_cache([5] * 200))  # larger than the whole budget: not kept at all
    assert len(kept) == 0
    off = PrefixCache(PrefixCacheConfig())  # the engine's default keeps nothing
    off.put(_cache([1]))
    assert len(off) == 0


@pytest.fixture(scope="module")
def demo_server():
    async def start():
        engine = TargetEngine.load(DEMO / "target")
        server, port = await start_server(engine, ServerConfig(port=0))
        return server, f"127.0.0.1:{port}"

    loop = asyncio.new_event_loop()
    server, address = loop.run_until_complete(start())
    yield loop, address
    loop.run_until_complete(server.stop(None))
    loop.close()


def test_a_five_turn_conversation_equals_each_turn_from_scratch(demo_server):
    """Each turn's prompt is the last one's prompt and reply plus the user's new tokens; the verifier
    computes only those, and every turn equals the target alone from an empty cache."""
    loop, address = demo_server
    drafter = LlamaDrafter(DrafterConfig(DEMO / "draft-q8_0.gguf"))
    evals, run_eval = [], drafter._eval

    def counted_eval(tokens):  # the sizes of the draft's llama.cpp evaluations
        evals.append(len(tokens))
        run_eval(tokens)

    drafter._eval = counted_eval
    turns = [drafter.tokenize(f" turn {i}: say more about lists and sums") for i in range(5)]
    sampling = [SamplingParams(), SamplingParams(temperature=0.8, seed=7)]

    async def conversation(params: SamplingParams):
        async with grpc.aio.insecure_channel(address) as channel:
            session = EdgeSession(channel, drafter)
            context, out = [], []
            for user in turns:
                prompt = context + user
                request = GenerationRequest(tuple(prompt), params, 24, gamma=3, ignore_eos=True, pipeline=1)
                evals.clear()
                generated, stats = await session.run(request)
                stats.first_draft_eval = evals[0]
                out.append((prompt, generated, stats))
                context = prompt + generated
            # The last session's handler keeps its cache as it ends, just after its last verdict left.
            stub = pb_grpc.VerifierStub(channel)
            for _ in range(100):
                if (server_stats := await stub.GetStats(pb.StatsRequest())).active_sessions == 0:
                    break
                await asyncio.sleep(0.05)
        return out, server_stats

    scratch = TargetEngine.load(DEMO / "target")  # keeps nothing
    for params in sampling:
        out, server_stats = loop.run_until_complete(conversation(params))
        for i, (prompt, generated, stats) in enumerate(out):
            spec = SessionSpec(tuple(prompt), params, 24, ignore_eos=True)
            assert generated == reference_decode(scratch, spec)
            if i == 0:
                continue
            # The last turn's prompt and reply, but for its final token, came from the kept cache.
            previous = len(out[i - 1][0]) + len(out[i - 1][1])
            assert stats.reused_positions >= previous - 1
            prefill = len(prompt) - 1 - stats.reused_positions
            assert prefill <= len(turns[i])
            # The draft's llama.cpp cache kept the history too: a turn's first draft evaluates the new
            # turn's tokens and the end of the last reply that its cache holds otherwise (the target's
            # last token, drafts it rejected: at most gamma + 1), not the conversation again.
            assert stats.first_draft_eval <= len(turns[i]) + 3 + 1 < len(prompt) // 2
        assert server_stats.reused_positions > 0 and server_stats.kept_caches >= 1
        assert server_stats.cache_bytes > 0
