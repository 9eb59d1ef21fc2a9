"""Exactness with a real pretrained pair: SmolLM2-135M-Instruct (float32) as the target, its shipped and
requantized GGUF files as drafts, over a real `draftwire serve`.

Greedy output equals transformers' own `generate(do_sample=False)` (an independent oracle) for 20 chat
prompts of up to 128 new tokens; seeded sampling equals `reference` across gamma, drafts and pipelining
(invariance). If a float32 position ever differed from transformers at a near-tie, the comparison is not
to be loosened: bit-exact verification is where that is fixed.
"""

import pytest

from draftwire.contract import SamplingParams, SessionSpec
from draftwire_cli.models import smollm2
from draftwire_cli.models.prompts import chat_turns
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import GenerationRequest
from tools.rig.serverproc import ServerProcess
from tools.testkit.edge import run_requests
from tools.testkit.oracle import cached_references, transformers_greedy
from verifier_service.engine import TargetEngine

QUESTIONS = [
    "What is the boiling point of water at sea level?",
    "Name three primary colors.",
    "Write a Python function that returns the largest number in a list.",
    "How many legs does a spider have?",
    "Give me two reasons to learn a second language.",
    "What is the square root of 144?",
    "Describe a cat in one sentence.",
    "What language is spoken in Brazil?",
    "Explain what a variable is in programming.",
    "Suggest a title for a story about a lost dog.",
    "What is the chemical symbol for gold?",
    "Write a limerick about a frog.",
    "Why is exercise good for you?",
    "What is the largest planet in the solar system?",
    "How do you make a cup of tea?",
    "What does CPU stand for?",
    "List the days of the week.",
    "Write one sentence about the moon.",
    "What is 9 times 8?",
    "Who painted the Mona Lisa?",
]
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def pair(smollm2_pair):
    return smollm2_pair


@pytest.fixture(scope="module")
def prompts(pair):
    return chat_turns(pair / smollm2.TARGET, QUESTIONS)


@pytest.fixture(scope="module")
def server(pair):
    with ServerProcess(pair / smollm2.TARGET, "--max-gamma", "8", "--dtype", "float32") as srv:
        yield srv


def speculate(address: str, draft, requests: list[GenerationRequest]) -> list[list[int]]:
    drafter = LlamaDrafter(DrafterConfig(draft, n_threads=1))
    return [ids for ids, _ in run_requests(address, drafter, requests)]


def test_greedy_equals_transformers_generate(pair, prompts, server):
    expected = transformers_greedy(pair / smollm2.TARGET, prompts, NEW_TOKENS)
    requests = [GenerationRequest(p, max_new_tokens=NEW_TOKENS, gamma=6, pipeline=1) for p in prompts]
    got = speculate(server.address, smollm2.draft_path(pair), requests)
    for question, ids, want in zip(QUESTIONS, got, expected, strict=True):
        assert ids == want, question


def test_seeded_sampling_equals_reference_across_gamma_drafts_and_pipelining(pair, prompts, server):
    engine = TargetEngine.load(pair / smollm2.TARGET, dtype="float32")
    for i, prompt in enumerate(prompts[:3]):
        params = SamplingParams(temperature=0.7, seed=100 + i)
        [expected] = cached_references(pair / smollm2.TARGET, engine, [SessionSpec(prompt, params, 48)])
        for kind, gamma, pipeline in (("q4_1", 1, 0), ("q4_1", 4, 2), ("q8_0", 8, 0), ("q4_0", 3, 1)):
            [ids] = speculate(
                server.address,
                smollm2.draft_path(pair, kind),
                [GenerationRequest(prompt, params, 48, gamma, pipeline=pipeline)],
            )
            assert ids == expected, f"prompt {i}, draft {kind}, gamma {gamma}, pipeline {pipeline}"
