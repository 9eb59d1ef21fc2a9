"""Golden tests of whole generations: speculative output over real gRPC against the target alone.

Greedy output is compared with transformers' own `generate`: an independent oracle. Seeded output is
compared with `reference` (the target alone, one token per round, through our own engine and rules):
that shows invariance, not independent correctness: gamma, the draft, pipelining and batching do not
change a sampled output. That the keyed draws follow the target's distribution is shown separately,
against transformers' own logits warpers (chi-square, below and in test_rules). The server is
`draftwire serve` in a subprocess, the draft real llama.cpp.
"""

import asyncio
import json
import subprocess

import grpc
import numpy as np
import pytest
from scipy import stats
from transformers import AutoTokenizer

from draftwire.contract import SamplingParams, SessionSpec
from draftwire.rules import adjusted_logits, choose_tokens
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.models.kit import stdlib_texts
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import DRAFTWIRE
from tools.testkit.edge import run_requests as speculate
from tools.testkit.oracle import cached_references, transformers_greedy
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tokenizer(test_pair):
    return AutoTokenizer.from_pretrained(test_pair.target_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """20 prompts of 1 to 40 tokens from standard-library text the tokenizer was not trained on."""
    text = "".join(stdlib_texts(40_000, skip_chars=2_000_000))
    ids = tokenizer(text)["input_ids"]
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 40, 7, 4, 9, 17, 25, 30, 11, 6, 15, 19, 28]
    return [ids[i * 97 : i * 97 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def drafters(test_pair) -> dict[str, LlamaDrafter]:
    paths = {"f16": test_pair.draft_f16, "q4_0": test_pair.draft_q4_0, "other": test_pair.other_draft_f16}
    return {name: LlamaDrafter(DrafterConfig(path, n_ctx=512)) for name, path in paths.items()}


@pytest.fixture(scope="module")
def engine(test_pair) -> TargetEngine:
    return TargetEngine.load(test_pair.target_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf_greedy(test_pair, prompts) -> list[list[int]]:
    """transformers' own greedy decoding: the independent reference."""
    return transformers_greedy(test_pair.target_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("draft", ["f16", "q4_0"])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_greedy_equals_transformers_generate(server, drafters, prompts, hf_greedy, draft, gamma):
    requests = [GenerationRequest(tuple(p), max_new_tokens=NEW_TOKENS, gamma=gamma) for p in prompts]
    results = speculate(server.address, drafters[draft], requests)
    for prompt, expected, (ids, _) in zip(prompts, hf_greedy, results, strict=True):
        assert ids == expected, f"prompt {prompt}"
    accepted = sum(s.accepted_tokens for _, s in results)
    proposed = sum(s.draft_tokens for _, s in results)
    rate = accepted / proposed
    # The f16 draft is the target itself and is accepted nearly always, so rounds commit several
    # tokens; q4_0 of a random-weight model drifts a lot, so corrections are exercised too.
    assert rate > 0.9 if draft == "f16" else 0.1 < rate < 0.9


@pytest.mark.parametrize("draft", ["f16", "q4_0"])
@pytest.mark.parametrize("pipeline", [1, 3])
def test_pipelined_greedy_equals_transformers_generate(server, drafters, prompts, hf_greedy, draft, pipeline):
    """Proposals sent ahead of their verdicts change nothing in the output."""
    requests = [
        GenerationRequest(tuple(p), max_new_tokens=NEW_TOKENS, gamma=3, pipeline=pipeline) for p in prompts
    ]
    results = speculate(server.address, drafters[draft], requests)
    for prompt, expected, (ids, _) in zip(prompts, hf_greedy, results, strict=True):
        assert ids == expected, f"prompt {prompt}"
    ahead = sum(s.sent_ahead for _, s in results)
    stale = sum(s.stale_rounds for _, s in results)
    # How many leave early depends on timing (a verdict that lands first makes the next proposal a
    # plain one), so the bounds are loose.
    if draft == "f16":  # nearly always right: many proposals leave early, and few of those are stale
        assert ahead >= sum(s.rounds for _, s in results) / 5 and stale <= ahead / 4
    else:  # often wrong: the stale path is exercised
        assert ahead > 0 and stale > 0


SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95)


def test_seeded_sampling_equals_reference_whatever_gamma_and_draft(
    server, drafters, prompts, engine, test_pair
):
    """Invariance: the same seed gives the same output whatever gamma, draft and pipeline depth."""
    prompt = tuple(prompts[6])
    seeds = range(1000, 1020)
    for seed in seeds:
        params = SamplingParams(seed=seed, **SAMPLING)
        [expected] = cached_references(
            test_pair.target_dir, engine, [SessionSpec(prompt, params, NEW_TOKENS)]
        )
        for draft, gamma, pipeline in [
            ("f16", 4, 0),
            ("f16", 1, 0),
            ("f16", 8, 0),
            ("other", 4, 0),
            ("q4_0", 3, 0),
            ("f16", 3, 2),
            ("q4_0", 2, 1),
        ]:
            request = GenerationRequest(prompt, params, NEW_TOKENS, gamma, pipeline=pipeline)
            [(ids, _)] = speculate(server.address, drafters[draft], [request])
            assert ids == expected, f"seed {seed}, draft {draft}, gamma {gamma}, pipeline {pipeline}"


def test_the_same_draft_agrees_with_the_targets_draws(server, drafters, prompts):
    """Under sampling the draft draws with the verifier's keyed noise, so a faithful draft is accepted."""
    requests = [
        GenerationRequest(tuple(prompts[6]), SamplingParams(seed=s, **SAMPLING), NEW_TOKENS, 4)
        for s in range(5)
    ]
    results = speculate(server.address, drafters["f16"], requests)
    rate = sum(s.accepted_tokens for _, s in results) / sum(s.draft_tokens for _, s in results)
    assert rate > 0.9


def test_first_sampled_token_follows_the_targets_filtered_softmax(engine, prompts):
    """The rules' keyed draw over the target's real logits (one engine forward), for 2,000 seeds, follows
    transformers' own warpers' distribution. That `reference` and every speculative path draw this same
    token for a seed is the invariance above (and tests/unit/test_rules over hand-made logits)."""
    from tests.unit.test_rules import chi_square_p, hf_probs

    prompt = tuple(prompts[7])
    logits = engine.forward("probe", 0, list(prompt))[-1]
    engine.release("probe")
    temperature, top_k, top_p = 1.2, 50, 0.9
    probs = hf_probs(logits, temperature, top_k, top_p)
    firsts = []
    for seed in range(2000):  # the draw a session makes at the prompt's end (VerifierSession.complete)
        params = SamplingParams(temperature, top_k, top_p, seed)
        scores = adjusted_logits(logits[None].numpy(), params, list(prompt), len(prompt), ())
        firsts.append(int(choose_tokens(scores, len(prompt), params)[0]))
    first = reference_decode(engine, SessionSpec(prompt, SamplingParams(temperature, top_k, top_p, 7), 1))
    assert first == [firsts[7]]  # the reference draws what the rules draw
    assert chi_square_p(firsts, probs) > 0.001
    assert stats.entropy(np.bincount(firsts)) > 0.5  # the check is not vacuous: many tokens are drawn


def run_cli(*args: str) -> dict:
    out = subprocess.run(
        [DRAFTWIRE, *args, "--json"], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout)


def test_cli_generate_and_reference_agree(server, test_pair, prompts):
    ids = ",".join(map(str, prompts[10]))
    flags = ["--prompt-ids", ids, "--max-new-tokens", "20", "--ignore-eos"]
    sampled = ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--seed", "77"]
    for extra, ahead in (([], ["--pipeline", "0"]), (sampled, ["--pipeline", "0"]), (sampled, [])):
        draft = ["--draft", str(test_pair.draft_q4_0)]
        spec = run_cli("generate", "--server", server.address, *draft, *flags, *extra, *ahead)
        # The server fixture runs the demo pair in float32.
        target = ["--target", str(test_pair.target_dir), "--dtype", "float32"]
        ref = run_cli("reference", *target, *flags, *extra)
        assert spec["token_ids"] == ref["token_ids"]
        assert len(spec["token_ids"]) == 20
        assert set(spec["stats"]) == {
            "rounds",
            "stale_rounds",
            "sent_ahead",
            "draft_tokens",
            "accepted_tokens",
            "forced_tokens",
            "acceptance_rate",
            "tokens_per_round",
            "wall_s",
            "gamma_cap",
            "min_gamma_cap",
            "plain_steps",
            "server_tokens",
            "handoffs",
            "speculation_gain",
            "speculation",
            "speculation_reason",
        }
        assert spec["stats"]["tokens_per_round"] > 1.0 and spec["stats"]["speculation"] == "on"
        assert spec["stats"]["speculation_gain"] > 0  # against the target's one-step time
        assert 1 <= spec["stats"]["min_gamma_cap"] <= spec["stats"]["gamma_cap"] <= 8  # serve --max-gamma 8
        assert spec["text"] == ref["text"]


def test_concurrent_sessions_are_batched_and_stay_exact(
    server, drafters, prompts, hf_greedy, engine, test_pair
):
    """Twelve sessions at once: the verifier runs their rounds in shared forward passes, and every
    output still equals its reference (greedy: transformers; seeded: `reference`)."""
    greedy = [GenerationRequest(tuple(p), max_new_tokens=NEW_TOKENS, gamma=4) for p in prompts[:6]]
    seeded = [
        GenerationRequest(tuple(prompts[6]), SamplingParams(seed=s, **SAMPLING), NEW_TOKENS, 3)
        for s in range(6)
    ]
    specs = [SessionSpec(r.prompt_token_ids, r.sampling, NEW_TOKENS) for r in seeded]
    expected = hf_greedy[:6] + cached_references(test_pair.target_dir, engine, specs)

    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            before = await stub.GetStats(pb.StatsRequest())
            # One drafter per session: llama.cpp contexts are not shared between threads.
            sessions = [EdgeSession(channel, drafter) for drafter in concurrent_drafters]
            results = await asyncio.gather(
                *(s.run(r) for s, r in zip(sessions, greedy + seeded, strict=True))
            )
            after = await stub.GetStats(pb.StatsRequest())
        return results, before, after

    concurrent_drafters = [
        LlamaDrafter(DrafterConfig(drafters["f16"].config.model_path, n_ctx=256)) for _ in range(12)
    ]
    results, before, after = asyncio.run(run())
    for i, ((ids, _), want) in enumerate(zip(results, expected, strict=True)):
        assert ids == want, f"session {i}"
    forwards = after.engine_forwards - before.engine_forwards
    batches = after.engine_batches - before.engine_batches
    assert forwards > batches, "no two sessions ever shared a forward pass"
