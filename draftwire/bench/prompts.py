"""Benchmark prompts: the start of held-out windows of the demo corpus (files no model trained on)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from draftwire.demopair.corpus import WINDOW, heldout_windows


def heldout_prompts(target_dir: Path, count: int, tokens: int) -> tuple[tuple[int, ...], ...]:
    """`count` prompts of `tokens` ids, in the target's tokenizer. Raises ValueError when the
    held-out files are too short for that many."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    windows = heldout_windows(tokenizer, count, max(tokens, WINDOW))
    if len(windows) < count:
        raise ValueError(f"held-out files give {len(windows)} windows, not {count}")
    return tuple(tuple(w[:tokens]) for w in windows)
