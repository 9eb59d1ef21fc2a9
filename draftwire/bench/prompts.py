"""Benchmark prompts: code from standard-library files that the models were not trained on."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from draftwire.modelkit import stdlib_texts

# Past the first 2 M characters of the standard library: beyond what the test pair trains on.
_SKIP_CHARS = 2_000_000


def heldout_prompts(target_dir: Path, count: int, tokens: int) -> tuple[tuple[int, ...], ...]:
    """`count` prompts of `tokens` ids each, cut at line starts of held-out source, in the target's
    tokenizer. Raises ValueError when the held-out text is too short."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text = "".join(stdlib_texts(count * tokens * 12, skip_chars=_SKIP_CHARS))
    lines = text.splitlines(keepends=True)
    step = max(1, len(lines) // count)
    prompts = []
    for i in range(0, len(lines), step):
        ids = tokenizer("".join(lines[i : i + 40]))["input_ids"][:tokens]
        if len(ids) == tokens:
            prompts.append(tuple(ids))
        if len(prompts) == count:
            return tuple(prompts)
    raise ValueError(f"held-out text gave {len(prompts)} prompts of {tokens} tokens, not {count}")
