"""Prompt-lookup drafting: the tokens that followed an earlier occurrence of the sequence's last tokens.
Costs no model, and wins where the output repeats its input (code edits, quotes, structured text).
Pure: tokens in, draft out; the verifier uses it for thin sessions.

The rule (`NgramRule`): the match is the longest suffix of the tokens (at most `max_ngram` long) that
occurred before with a known continuation, its latest occurrence among the longest. A match shorter
than `min_ngram` drafts nothing (the round is the target alone); a match of n tokens drafts up to
n - `lag` tokens. Every drafted token is a position the target computes, so a draft must be likely:
on the capacity bench's chat and code outputs (docs/capacity.md) the next token followed a 1-token
match 12 to 19 % of the time, a 3-token one 31 % (chat) to 65 % (code), a 4-token one 83 to 84 %; the
second token followed a 4-token match 32 % (chat) to 57 % (code) of the time, and more often after
longer matches on code. Drafting `gamma` tokens after any 1-gram cost the target 2.4 to 2.5 positions
per generated token there; this default (4 tokens, n - 2 drafted) costs 1.02 (chat) to 1.05 (code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramRule:
    """When prompt lookup drafts and how much. lag None: `gamma` tokens whatever the match's length."""

    min_ngram: int = 4  # the shortest suffix match that drafts
    max_ngram: int = 10  # the longest suffix matched (longer matches count as this long)
    lag: int | None = 2  # a match of n tokens drafts up to n - lag tokens (and at most gamma)

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"n-gram sizes {self.min_ngram}..{self.max_ngram}: need 1 <= min <= max")
        if self.lag is not None and not 0 <= self.lag < self.min_ngram:
            raise ValueError(f"lag {self.lag}: need 0 <= lag < min_ngram ({self.min_ngram})")

    def draft_length(self, match: int, gamma: int) -> int:
        """How many tokens a match of `match` tokens drafts, at most `gamma`."""
        if match < self.min_ngram:
            return 0
        return max(0, gamma if self.lag is None else min(gamma, match - self.lag))

    def label(self) -> str:
        length = "γ" if self.lag is None else f"n - {self.lag}" if self.lag else "n"
        return f"match {self.min_ngram}..{self.max_ngram}, draft {length}"


RULE = NgramRule()
NGRAM_GAMMA = 5  # prompt-lookup draft tokens per round of a thin session
# Until this rule: any 1-gram drafted, up to 3 matched, gamma tokens whatever the match.
ANY_1GRAM = NgramRule(min_ngram=1, max_ngram=3, lag=None)


def longest_match(tokens: Sequence[int], max_ngram: int) -> tuple[int, int]:
    """(n, end): the longest suffix of `tokens`, at most `max_ngram` long, that also ends at an earlier
    index `end` (so that tokens[end + 1] is known), the latest such end among the longest; (0, -1) when
    the last token never occurred before. The occurrence may overlap the suffix."""
    length = len(tokens)
    best, best_end = 0, -1
    if length < 2:
        return best, best_end
    last = tokens[-1]
    for end in range(length - 2, -1, -1):
        if tokens[end] != last:
            continue
        n, cap = 1, min(max_ngram, end + 1)
        while n < cap and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best:
            best, best_end = n, end
            if best == max_ngram:
                break
    return best, best_end


def ngram_draft(tokens: Sequence[int], gamma: int, rule: NgramRule = RULE) -> list[int]:
    """Up to `gamma` tokens to propose after `tokens`: what followed the longest earlier match of their
    suffix, as many as `rule` allows for its length; [] when no match is long enough."""
    n, end = longest_match(tokens, rule.max_ngram)
    count = rule.draft_length(n, gamma)
    return list(tokens[end + 1 : end + 1 + count]) if count else []
