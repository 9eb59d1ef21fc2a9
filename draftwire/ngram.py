"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the sequence's last
n-gram (longest n first). Costs no model, and wins where the output repeats its input (code edits,
quotes, structured text). Pure: tokens in, draft out; the verifier uses it for thin sessions.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3  # the longest suffix matched
MIN_NGRAM = 1


def ngram_draft(tokens: Sequence[int], gamma: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to `gamma` tokens to propose after `tokens`: what followed the latest earlier occurrence of the
    longest suffix of `tokens` (at most `max_ngram` long) that occurred before; [] when none did."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), MIN_NGRAM - 1, -1):
        suffix = list(tokens[length - n :])
        # The latest start before the suffix itself, so the continuation is known.
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + gamma])
    return []
