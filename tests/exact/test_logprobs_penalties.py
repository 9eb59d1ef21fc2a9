"""Logprobs, penalties and logit bias under speculation, on real parts: a `draftwire serve` subprocess,
llama.cpp drafts, transformers as the independent oracle.

- Speculative output and logprobs equal `reference`'s (the target alone, one token per round) at every
  position, greedy and seeded, across drafts, gamma, pipelining and thin sessions, bit for bit.
- On the SmolLM2 pair, greedy output with penalties equals transformers' `generate` with its
  RepetitionPenaltyLogitsProcessor and OpenAI's frequency/presence formula written out below; and the
  logprobs equal transformers' own float32 forward within float tolerance.
"""

import asyncio

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
)

from draftwire import wire
from draftwire.contract import Drafting, SamplingParams, SessionSpec
from draftwire_cli.models import smollm2
from draftwire_cli.models.prompts import chat_turns, heldout_prompts
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import ServerProcess
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

NEW = 24
PENALIZED = dict(
    repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, logit_bias=((13, -5.0),)
)


def serve(address, drafter, requests):
    """Each request through one EdgeSession: [(ids, logprobs, stats)]."""

    async def run():
        async with wire.insecure_channel(address) as channel:
            session = EdgeSession(channel, drafter)
            out = []
            for r in requests:
                logprobs = []
                ids, stats = await session.run(r, logprobs)
                out.append((ids, logprobs, stats))
            return out

    return asyncio.run(run())


def reference(engine, prompt, params, new, top):
    logprobs = []
    ids = reference_decode(
        engine, SessionSpec(tuple(prompt), params, new, ignore_eos=True, top_logprobs=top), logprobs
    )
    return ids, logprobs


@pytest.fixture(scope="module")
def engine(test_pair):
    return TargetEngine.load(test_pair.target_dir, dtype="float32")  # as the `server` fixture runs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(0.8, seed=7),
        SamplingParams(**PENALIZED),
        SamplingParams(0.9, 40, 0.95, 3, **PENALIZED),
        SamplingParams(1.2, seed=5, min_p=0.1),
        SamplingParams(0.9, 40, 0.95, 3, **PENALIZED, min_p=0.05),
    ],
    ids=["greedy", "seeded", "greedy-penalized", "seeded-penalized", "seeded-min-p", "seeded-all"],
)
def test_speculative_tokens_and_logprobs_equal_the_target_alone(server, test_pair, engine, params):
    """Six sessions at once (so rounds share forward passes), of three drafts, gamma and depths."""
    prompts = heldout_prompts(test_pair.target_dir, 2, 40)
    expected = [reference(engine, p, params, NEW, 5) for p in prompts]
    setups = [(test_pair.draft_f16, 4, 1), (test_pair.draft_q4_0, 3, 0), (test_pair.other_draft_f16, 6, 2)]

    async def run():
        async with wire.insecure_channel(server.address) as channel:

            async def one(draft, gamma, pipeline, prompt):
                session = EdgeSession(channel, LlamaDrafter(DrafterConfig(draft, n_ctx=256)))
                request = GenerationRequest(
                    prompt, params, NEW, gamma, ignore_eos=True, pipeline=pipeline, top_logprobs=5
                )
                logprobs = []
                ids, stats = await session.run(request, logprobs)
                return ids, logprobs, stats

            return await asyncio.gather(*(one(*setup, p) for setup in setups for p in prompts))

    results = asyncio.run(run())
    for k, (ids, logprobs, _) in enumerate(results):
        (draft, gamma, pipeline), want = setups[k // len(prompts)], expected[k % len(prompts)]
        assert (ids, logprobs) == want, f"{draft.name}, gamma {gamma}, pipeline {pipeline}"
    assert sum(stats.batched_with for _, _, stats in results) > sum(stats.rounds for _, _, stats in results)
    ids, logprobs = expected[0]
    assert len(logprobs) == NEW and all(len(t.top) == 5 and t.logprob <= 0.0 for t in logprobs)
    if params.greedy:  # the chosen token is the most likely one
        assert all(
            t.top[0][0] == token and t.top[0][1] == t.logprob for token, t in zip(ids, logprobs, strict=True)
        )


@pytest.mark.parametrize("drafting", [Drafting.NONE, Drafting.NGRAM])
def test_thin_sessions_carry_them_too(server, test_pair, engine, drafting):
    params = SamplingParams(0.7, seed=11, **PENALIZED)
    prompt = heldout_prompts(test_pair.target_dir, 1, 40)[0]
    request = GenerationRequest(prompt, params, NEW, ignore_eos=True, drafting=drafting, top_logprobs=2)
    [(ids, logprobs, _)] = serve(server.address, None, [request])
    assert (ids, logprobs) == reference(engine, prompt, params, NEW, 2)


def test_without_logprobs_the_verdicts_carry_none(server, test_pair):
    prompt = heldout_prompts(test_pair.target_dir, 1, 40)[0]
    drafter = LlamaDrafter(DrafterConfig(test_pair.draft_f16, n_ctx=256))
    plain, asked = serve(
        server.address,
        drafter,
        [
            GenerationRequest(prompt, max_new_tokens=NEW, ignore_eos=True),
            GenerationRequest(prompt, max_new_tokens=NEW, ignore_eos=True, top_logprobs=0),
        ],
    )
    assert plain[1] == [] and len(asked[1]) == NEW and all(t.top == () for t in asked[1])
    assert plain[0] == asked[0]
    # About 5 bytes per token for the chosen token's logprob alone; the plain wire is as it was.
    assert asked[2].wire_bytes - plain[2].wire_bytes == pytest.approx(7 * NEW, rel=0.3)


# --- SmolLM2: transformers as the oracle ---------------------------------------------------------------


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula: mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty,
    c[j] the times token j was sampled before the current position (the prompt not counted)."""

    def __init__(self, prompt_length, frequency, presence):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids):
            counts = torch.bincount(ids[self.prompt_length :], minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence
        return scores


class OpenAIBias(LogitsProcessor):
    """OpenAI's logit_bias: the bias is added to the token's logit before sampling."""

    def __init__(self, bias: dict[int, float]):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for token, value in self.bias.items():
            scores[:, token] += value
        return scores


@pytest.fixture(scope="module")
def smol(smollm2_pair):
    with ServerProcess(smollm2_pair / smollm2.TARGET, "--max-gamma", "8", "--dtype", "float32") as srv:
        model = AutoModelForCausalLM.from_pretrained(
            smollm2_pair / smollm2.TARGET, dtype=torch.float32
        ).eval()
        yield smollm2_pair, srv, model


QUESTIONS = [
    "Write a short poem about the sea.",
    "List five fruits and say why each is good.",
    "Explain recursion twice, in two ways.",
]


def test_penalized_greedy_equals_transformers_generate(smol):
    pair, server, model = smol
    prompts = chat_turns(pair / smollm2.TARGET, QUESTIONS)
    # A bias that changes the text: the first prompt's unpenalised greedy reply's most common token.
    alone = GenerationRequest(prompts[0], max_new_tokens=64, ignore_eos=True, drafting=Drafting.NONE)
    plain = serve(server.address, None, [alone])
    common = max(set(plain[0][0]), key=plain[0][0].count)
    bias = ((common, -3.0),)
    params = SamplingParams(
        logit_bias=bias, repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=0.25
    )
    drafter = LlamaDrafter(DrafterConfig(smollm2.draft_path(pair), n_threads=1))
    requests = [GenerationRequest(p, params, 64, 5, ignore_eos=True, pipeline=1) for p in prompts]
    for prompt, (ids, _, stats) in zip(prompts, serve(server.address, drafter, requests), strict=True):
        processors = LogitsProcessorList(
            [
                OpenAIBias(dict(bias)),
                RepetitionPenaltyLogitsProcessor(1.25),
                OpenAIPenalties(len(prompt), 0.5, 0.25),
            ]
        )
        x = torch.tensor([prompt])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=64,
            logits_processor=processors,
            min_new_tokens=64,
            eos_token_id=None,
        )
        assert ids == out[0, len(prompt) :].tolist()
        assert stats.accepted_tokens > 0


def test_logprobs_equal_transformers_forward(smol):
    pair, server, model = smol
    prompts = chat_turns(pair / smollm2.TARGET, QUESTIONS[:2])
    drafter = LlamaDrafter(DrafterConfig(smollm2.draft_path(pair), n_threads=1))
    for params in (SamplingParams(), SamplingParams(0.7, seed=3)):
        requests = [
            GenerationRequest(p, params, 32, 4, ignore_eos=True, pipeline=1, top_logprobs=5) for p in prompts
        ]
        for prompt, (ids, logprobs, _) in zip(prompts, serve(server.address, drafter, requests), strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([[*prompt, *ids]])).logits[0, len(prompt) - 1 : -1].double()
            scale = 1.0 if params.greedy else params.temperature
            want = torch.log_softmax(logits / scale, dim=-1).numpy()
            got = np.array([t.logprob for t in logprobs])
            np.testing.assert_allclose(got, want[np.arange(len(ids)), ids], atol=2e-4)
            for t, row in zip(logprobs, want, strict=True):
                ids_top = [i for i, _ in t.top]
                np.testing.assert_allclose([p for _, p in t.top], row[ids_top], atol=2e-4)
                assert sorted(row, reverse=True)[4] <= row[ids_top].min() + 1e-4  # they are the top five


def test_the_cost_benchmark_runs_its_arms_and_finds_them_exact(smollm2_pair):
    from tools.bench import controls

    config = controls.ControlsConfig(
        smollm2_pair, prompts=1, new_tokens=12, repeats=1, edge_cpus=(), verifier_cpus=()
    )
    report = asyncio.run(controls.run_all(config, log=lambda _: None))
    assert all(report["exact"].values()), report["exact"]
    rows = {r["arm"]: r for r in report["rows"]}
    assert list(rows) == list(controls.ARMS) and all(r["tokens"] == 12 for r in rows.values())
    # Logprobs travel only when asked: more bytes per token with them, and more with five alternatives.
    plain, top0, top5 = (rows[a]["wire_bytes_per_token"] for a in ("plain", "logprobs-0", "logprobs-5"))
    assert plain < top0 < top5
    assert "| penalties-blind |" in controls.markdown(report)
