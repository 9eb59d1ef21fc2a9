"""Benchmark prompts: the start of held-out windows of the demo corpus (files no model trained on), or
plain deterministic ids where any ids will do (replayed drafts, load tests)."""

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
