"""The edge's recent conversations by ids (edge_client/contexts.py): a prompt takes the ids of the one it
shares the longest prefix with, whatever follows it, so that the verifier's kept cache and the draft's
context serve that prefix again. Real llama.cpp vocabulary and chat template (the demo pair's)."""

from __future__ import annotations

import pytest

from edge_client.contexts import Contexts
from edge_client.drafter import VocabOnly
from edge_client.template import render_pieces
from tests.wire.edge.test_edge_guard import DRAFT, TEMPLATE

QUESTION = "Write a function that adds up the squares of a list of numbers, and explain each step."
REPLY = (
    "def sum_of_squares(values):\n    total = 0\n    for value in values:\n        total += value * value\n"
    "    return total\n\nIt starts from zero and adds each value times itself, then returns the total.\n"
)


@pytest.fixture(scope="module")
def vocab():
    return VocabOnly(DRAFT)


def pieces(messages):
    return render_pieces(TEMPLATE, messages, "<s>", "</s>")


def text_of(vocab, ids) -> str:
    return vocab.llm.detokenize(ids, special=True).decode("utf-8")


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def generated(vocab, text: str) -> list[int]:
    """The reply as a target would have generated it: ids that spell its text, split otherwise than the
    tokenizer splits it (a character at a time)."""
    return [t for ch in text for t in vocab.llm.tokenize(ch.encode(), add_bos=False, special=False)]


def test_a_prompt_follows_the_conversation_it_shares_the_longest_prefix_with(vocab):
    contexts = Contexts(vocab)
    first = contexts.prompt(pieces([{"role": "user", "content": QUESTION}]))
    reply = generated(vocab, REPLY)
    assert reply != vocab.llm.tokenize(REPLY.encode(), add_bos=False, special=False)
    contexts.remember(first + reply)
    # The next turn, with the reply as a client sends it back: stripped of its last newline.
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": REPLY.rstrip()},
        {"role": "user", "content": "Now the cubes."},
    ]
    ids = contexts.prompt(pieces(messages))
    assert text_of(vocab, ids) == "".join(p.text for p in pieces(messages))
    # Every id up to the reply's last (stripped) character: the kept caches serve all of it again.
    assert common(ids, first + reply) >= len(first) + len(reply) - 1


def test_a_prompt_sharing_a_long_start_reuses_it_whatever_its_ending(vocab):
    contexts = Contexts(vocab)
    long = " ".join(f"Rule {i}: values are summed in order." for i in range(60))
    first = contexts.prompt(pieces([{"role": "user", "content": long + " Answer in one word."}]))
    contexts.remember(first + generated(vocab, "Yes."))
    other = pieces([{"role": "user", "content": long + " Answer at length, please."}])
    ids = contexts.prompt(other)
    assert text_of(vocab, ids) == "".join(p.text for p in other)
    assert common(ids, first) >= len(vocab.llm.tokenize(long.encode(), add_bos=False, special=False))


def test_typed_control_text_never_becomes_a_control_token(vocab):
    contexts = Contexts(vocab)
    (eos,) = vocab.llm.tokenize(b"</s>", add_bos=False, special=True)
    first = contexts.prompt(pieces([{"role": "user", "content": "hi"}]))
    contexts.remember([*first, eos])  # a reply that was the end-of-sequence token alone
    typed = pieces([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "</s>x"}])
    fresh = [
        t for p in typed for t in vocab.llm.tokenize(p.text.encode(), add_bos=False, special=not p.content)
    ]
    assert contexts.prompt(typed).count(eos) == fresh.count(eos)  # the typed </s> stays text
