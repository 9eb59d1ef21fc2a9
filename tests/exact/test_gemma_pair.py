"""A real SentencePiece pair (issue 31): Gemma 3 270M drafting for itself, its Q4_K_M file from registry
chunk wheels as the draft and the same file dequantized (float32) as the target. Its 262,144-token
vocabulary stores the whitespace runs as user-defined tokens in the GGUF and as plain pieces in
transformers, and 15 of its 18 layers attend through a 512-position sliding window.

Exact through `serve` at γ 4 and 8: greedy against transformers' own `generate`, seeded against
`reference` (the target alone, one position a forward), on plain-text prompts (the base model has no
chat template), one of them longer than the sliding window.

The tests run where `draftwire models fetch gemma-3-270m` has run (250 MB); CI fetches it and sets
DRAFTWIRE_FETCHED=required, which makes a missing pair a failure instead of a skip."""

from __future__ import annotations

import json

import pytest

from draftwire.contract import SamplingParams, SessionSpec
from draftwire_cli.models import chunks
from draftwire_cli.models.kit import stdlib_texts
from draftwire_cli.models.pairs import GEMMA
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import GenerationRequest
from tests.capability import fetched
from tools.rig.serverproc import ServerProcess
from tools.testkit.edge import run_requests
from tools.testkit.oracle import transformers_greedy

NEW = 16
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,   there lived",  # a whitespace run: a user-defined token
)
GAMMAS = (4, 8)


@pytest.fixture(scope="module")
def pair():
    return fetched(GEMMA.name)


@pytest.fixture(scope="module")
def tokenizer(pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair / chunks.TARGET)


@pytest.fixture(scope="module")
def prompts(pair, tokenizer):
    """Three short texts and one longer than the sliding window (its first layers see only the last
    512 positions), with the BOS the tokenizer adds."""
    window = json.loads((pair / chunks.TARGET / "config.json").read_text())["sliding_window"]
    short = [tuple(tokenizer(t)["input_ids"]) for t in TEXTS]
    ids = tokenizer(stdlib_texts(4000)[0])["input_ids"]
    long = tuple(ids[: window + 150])
    assert len(long) == window + 150
    return [*short, long]


@pytest.fixture(scope="module")
def server(pair):
    with ServerProcess(pair / chunks.TARGET, "--max-gamma", "8", "--dtype", "float32") as srv:
        yield srv


def _speculate(address: str, pair, prompts, params: SamplingParams, gamma: int):
    drafter = LlamaDrafter(DrafterConfig(chunks.draft_file(pair), n_ctx=1024, n_threads=1))
    return run_requests(address, drafter, [GenerationRequest(p, params, NEW, gamma=gamma) for p in prompts])


def test_the_fetched_pair_is_the_pinned_one_and_pairs(pair):
    manifest = json.loads((pair / chunks.MANIFEST).read_text())
    assert {s["sha256"] for s in manifest["sources"].values()} == {GEMMA.target.sha256}
    assert "Gemma Terms of Use" in (pair / chunks.CARD_MD).read_text()
    problems, templates = chunks.pairing(GEMMA, pair / chunks.TARGET, chunks.draft_file(pair))
    assert problems == [] and templates.startswith("neither file has a chat template")


def test_whitespace_runs_are_user_defined_in_the_draft_and_plain_in_the_target(pair, tokenizer):
    """The converters' spellings that issue 31 found refusing this pair made from one file."""
    from llama_cpp import Llama

    runs = range(138, 168)  # two to thirty-one spaces
    draft = Llama(model_path=str(chunks.draft_file(pair)), vocab_only=True, verbose=False)
    try:
        assert all(draft._model.token_get_attr(i) & 16 for i in runs)  # llama.cpp: user-defined
        assert [draft.detokenize([i]) for i in runs] == [b" " * n for n in range(2, 32)]
    finally:
        draft.close()
    assert not set(runs) & set(tokenizer.added_tokens_decoder)  # transformers: ordinary pieces
    assert [tokenizer.decode([i]) for i in runs] == [" " * n for n in range(2, 32)]


def test_greedy_equals_transformers_generate_at_gamma_4_and_8(pair, prompts, server):
    expected = transformers_greedy(pair / chunks.TARGET, prompts, NEW)
    for gamma in GAMMAS:
        results = _speculate(server.address, pair, prompts, SamplingParams(), gamma)
        for i, ((ids, stats), want) in enumerate(zip(results, expected, strict=True)):
            assert ids == want, f"prompt {i}, gamma {gamma}"
            assert stats.accepted_tokens > 0  # the Q4_K_M draft agrees with its own dequantized weights


def test_seeded_sampling_equals_reference_at_gamma_4_and_8(pair, prompts, server):
    from tools.testkit.oracle import cached_references
    from verifier_service.engine import TargetEngine

    engine = TargetEngine.load(pair / chunks.TARGET, dtype="float32")
    for i, prompt in enumerate(prompts[1:3]):  # code, and the whitespace run
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=31 + i)
        [expected] = cached_references(pair / chunks.TARGET, engine, [SessionSpec(prompt, params, NEW)])
        for gamma in GAMMAS:
            [(ids, _)] = _speculate(server.address, pair, [prompt], params, gamma)
            assert ids == expected, f"prompt {i}, gamma {gamma}"
