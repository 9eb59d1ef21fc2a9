"""Benchmark prompts: the start of held-out windows of the demo corpus (files no model trained on),
held-out chat turns for a chat target, or plain deterministic ids where any ids will do (replayed drafts,
load tests)."""

from __future__ import annotations

from pathlib import Path


def id_prompts(vocab_size: int, count: int, length: int) -> list[tuple[int, ...]]:
    """`count` deterministic prompts of `length` ordinary ids (clear of the low special ids), different
    per prompt."""
    span = vocab_size - 10
    return [tuple((7 + 31 * p + 17 * i) % span + 5 for i in range(length)) for p in range(count)]


def heldout_prompts(target_dir: Path, count: int, tokens: int) -> tuple[tuple[int, ...], ...]:
    """`count` prompts of `tokens` ids, in the target's tokenizer. Raises ValueError when the
    held-out files are too short for that many."""
    from transformers import AutoTokenizer

    from tools.models.demopair.corpus import WINDOW, heldout_windows

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    windows = heldout_windows(tokenizer, count, max(tokens, WINDOW))
    if len(windows) < count:
        raise ValueError(f"held-out files give {len(windows)} windows, not {count}")
    return tuple(tuple(w[:tokens]) for w in windows)


def chat_prompts(target_dir: Path, count: int) -> tuple[tuple[int, ...], ...]:
    """`count` held-out chat turns (the SmolLM2 card's questions) rendered with the target's chat
    template, generation prompt included. Raises ValueError when there are fewer than that."""
    from tools.models.smollm2 import CARD_PROMPTS

    if count > len(CARD_PROMPTS):
        raise ValueError(f"{len(CARD_PROMPTS)} held-out chat prompts, not {count}")
    return chat_turns(target_dir, CARD_PROMPTS[:count])


def chat_turns(target_dir: Path, questions) -> tuple[tuple[int, ...], ...]:
    """Each question as one user turn rendered with the target's chat template, generation prompt
    included."""
    from transformers import AutoTokenizer

    from tools.models.smollm2 import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return tuple(tuple(chat_ids(tokenizer, q)) for q in questions)
