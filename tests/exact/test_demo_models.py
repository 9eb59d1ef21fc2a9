"""The committed demo pair: both sides load it, tokenize alike, and its card is not stale."""

import json
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftwire_cli.models.demopair.card import (
    GGUF_KINDS,
    STALENESS_POSITIONS,
    gguf_agreement,
    target_argmax_and_loss,
)
from draftwire_cli.models.demopair.corpus import CHAT_TEMPLATE, WINDOW, corpus_files, heldout_windows
from draftwire_cli.models.demopair.files import DEFAULT_OUT, PairFiles
from draftwire_cli.models.find import DEMO_DRAFT
from edge_client.llama_runtime import Llama
from tools.rig.serverproc import DRAFTWIRE

FILES = PairFiles(DEFAULT_OUT)


@pytest.fixture(scope="module")
def card() -> dict:
    return json.loads(FILES.card_json.read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(FILES.target)


@pytest.fixture(scope="module")
def llama_vocab():
    return Llama(model_path=str(FILES.gguf("q8_0")), vocab_only=True, verbose=False)


def test_the_pair_is_small_and_complete(card):
    assert card["evaluation"]["total_bytes"] < 40e6
    total = sum(p.stat().st_size for p in FILES.root.rglob("*") if p.is_file())
    assert total < 40e6
    for kind in GGUF_KINDS:
        assert FILES.gguf(kind).is_file()
    assert (FILES.draft_hf / "config.json").is_file()


def test_both_sides_load_it(tokenizer):
    target = AutoModelForCausalLM.from_pretrained(FILES.target, dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(FILES.draft_hf, dtype=torch.float32)
    assert sum(p.numel() for p in target.parameters()) >= 5_000_000
    assert draft.config.vocab_size == target.config.vocab_size == len(tokenizer)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    for kind in GGUF_KINDS:
        llm = Llama(model_path=str(FILES.gguf(kind)), n_ctx=64, verbose=False)
        llm.eval(tokenizer("def main():")["input_ids"])
        llm.close()


def test_llama_cpp_tokenizes_heldout_code_like_transformers(tokenizer, llama_vocab):
    texts = [f.text[:4000] for f in corpus_files(heldout=True)]
    assert len(texts) >= 10
    for text in texts:
        expected = tokenizer(text)["input_ids"]
        assert llama_vocab.tokenize(text.encode(), add_bos=True, special=False) == expected
        assert llama_vocab.detokenize(expected).decode() == text


def test_chat_template_tokenizes_alike(tokenizer, llama_vocab):
    messages = [
        {"role": "user", "content": "Return the number of items in the queue."},
        {"role": "assistant", "content": "def qsize(self):\n    return len(self.queue)"},
        {"role": "user", "content": "Now an empty check."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert llama_vocab.tokenize(text.encode(), add_bos=False, special=True) == list(expected)
    assert tokenizer.convert_tokens_to_ids("<|assistant|>") in expected


def test_card_agreement_is_not_stale_and_meets_its_target(card, tokenizer):
    """Recomputes teacher-forced agreement of the q8_0 draft on the card's first held-out positions."""
    windows = heldout_windows(tokenizer, STALENESS_POSITIONS // WINDOW)
    target = AutoModelForCausalLM.from_pretrained(FILES.target, dtype=torch.float32).eval()
    argmax, _ = target_argmax_and_loss(target, windows)
    fresh = gguf_agreement(FILES.gguf("q8_0"), windows, argmax)
    recorded = card["evaluation"]["teacher_forced_agreement_first_512"]["q8_0"]
    assert abs(fresh - recorded) <= 0.02, (fresh, recorded)
    # The pair's target, measured now rather than read from the card: the q8_0 draft agrees with the
    # target's greedy choice at 60 % of held-out positions or more (the demo's acceptance rests on it).
    assert fresh >= 0.60


def test_demo_answers_once():
    proc = subprocess.run(
        [
            DRAFTWIRE,
            "demo",
            "--models",
            str(DEFAULT_OUT),
            "--prompt",
            "Return the number of items in the queue.",
        ]
        + ["--max-new-tokens", "40"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(chat template)" in proc.stdout
    assert "draftwire> " in proc.stdout and "tokens/s]" in proc.stdout


def test_greedy_speculation_with_the_demo_pair_equals_transformers(tokenizer):
    from edge_client.drafter import DrafterConfig, LlamaDrafter
    from edge_client.session import GenerationRequest
    from tools.rig.serverproc import ServerProcess
    from tools.testkit.edge import run_requests
    from tools.testkit.oracle import transformers_greedy

    prompts = [w[:40] for w in heldout_windows(tokenizer, 4)]
    expected = transformers_greedy(FILES.target, prompts, 32)
    drafter = LlamaDrafter(DrafterConfig(FILES.gguf(DEMO_DRAFT)))

    requests = [GenerationRequest(tuple(p), max_new_tokens=32, gamma=4) for p in prompts]
    with ServerProcess(FILES.target, "--dtype", "float32") as server:  # transformers' float32 generate
        results = run_requests(server.address, drafter, requests)
    assert [ids for ids, _ in results] == expected
    assert sum(s.accepted_tokens for _, s in results) / sum(s.draft_tokens for _, s in results) > 0.3
