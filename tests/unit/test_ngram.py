"""The verifier's prompt-lookup drafter (draftwire/ngram.py): which match it takes, and how many tokens a
match of each length drafts. Pure, so tables."""

import pytest

from draftwire.ngram import ANY_1GRAM, RULE, NgramRule, longest_match, ngram_draft

# tokens, max_ngram -> (match length, end of its latest occurrence among the longest)
MATCHES = [
    ((), 10, (0, -1)),
    ((7,), 10, (0, -1)),
    ((1, 2, 3), 10, (0, -1)),  # the last token never occurred before
    ((5, 1, 5), 10, (1, 0)),
    ((1, 2, 9, 1, 2), 10, (2, 1)),
    ((1, 2, 3, 4, 9, 1, 2, 3, 4), 10, (4, 3)),
    ((1, 2, 3, 4, 9, 1, 2, 3, 4), 3, (3, 3)),  # capped at max_ngram
    # The longest wins over a later, shorter one: (2, 3, 4) at the start, only (3, 4) later.
    ((2, 3, 4, 8, 7, 3, 4, 6, 2, 3, 4), 10, (3, 2)),
    # Two occurrences as long: the latest.
    ((3, 4, 8, 3, 4, 6, 3, 4), 10, (2, 4)),
    # Past max_ngram both count as max_ngram long: the latest of them.
    ((1, 2, 3, 4, 8, 9, 2, 3, 4, 6, 1, 2, 3, 4), 3, (3, 8)),
    # A run: the occurrence may overlap the suffix.
    ((7, 7, 7, 7), 10, (3, 2)),
]


@pytest.mark.parametrize("tokens, max_ngram, expected", MATCHES)
def test_longest_match(tokens, max_ngram, expected):
    assert longest_match(tokens, max_ngram) == expected


# rule, match length, gamma -> tokens drafted
LENGTHS = [
    (RULE, 0, 5, 0),
    (RULE, 1, 5, 0),
    (RULE, 3, 5, 0),  # shorter than min_ngram: the round is the target alone
    (RULE, 4, 5, 2),  # n - 2
    (RULE, 5, 5, 3),
    (RULE, 6, 5, 4),
    (RULE, 7, 5, 5),
    (RULE, 10, 5, 5),  # at most gamma
    (RULE, 6, 2, 2),
    (RULE, 6, 0, 0),
    (ANY_1GRAM, 0, 5, 0),
    (ANY_1GRAM, 1, 5, 5),  # the old rule: gamma tokens after any 1-gram
    (ANY_1GRAM, 3, 3, 3),
    (NgramRule(3, 10, 0), 3, 5, 3),
    (NgramRule(2, 4, 1), 2, 5, 1),
]


@pytest.mark.parametrize("rule, match, gamma, expected", LENGTHS)
def test_draft_length(rule, match, gamma, expected):
    assert rule.draft_length(match, gamma) == expected


REPEAT = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21)
# tokens, gamma, rule -> draft
DRAFTS = [
    ((), 5, RULE, []),
    ((5, 6, 7, 8, 5, 6), 5, RULE, []),  # a 2-token match: no draft
    ((5, 6, 7, 8, 5, 6), 5, ANY_1GRAM, [7, 8, 5, 6]),  # the old rule drafts on it (all that is known)
    ((5, 6, 7, 8, 5, 6), 1, ANY_1GRAM, [7]),
    ((5, 6, 7, 9, 5, 6, 7), 5, RULE, []),  # 3 tokens: still none
    ((5, 6, 7, 8, 1, 2, 3, 4, 9, 5, 6, 7, 8), 5, RULE, [1, 2]),  # 4 tokens: two
    ((*REPEAT, 0, *REPEAT[:6]), 5, RULE, [16, 17, 18, 19]),  # 6 tokens: four
    ((*REPEAT, 0, *REPEAT[:9]), 5, RULE, [19, 20, 21, 0, 10]),  # 9: gamma, across the earlier end
    ((*REPEAT, 0, *REPEAT[:9]), 3, RULE, [19, 20, 21]),
    ((*REPEAT, 0, *REPEAT), 5, RULE, [0, 10, 11, 12, 13]),
    # The continuation stops at the sequence's end: a draft may be shorter than the rule allows.
    ((1, 2, 3, 4, 1, 2, 3, 4), 5, RULE, [1, 2]),
    ((9, 1, 2, 3, 4, 8, 1, 2, 3, 4), 5, NgramRule(4, 10, 0), [8, 1, 2, 3]),  # n - 0 = 4
]


@pytest.mark.parametrize("tokens, gamma, rule, expected", DRAFTS)
def test_ngram_draft(tokens, gamma, rule, expected):
    assert ngram_draft(tokens, gamma, rule) == expected
    assert ngram_draft(list(tokens), gamma, rule) == expected  # a list or a tuple alike


def test_default_rule_is_the_one_measured():
    """docs/capacity.md chose it from the offline replay: a 4-token match, n - 2 drafted, up to 10 matched."""
    assert RULE == NgramRule(min_ngram=4, max_ngram=10, lag=2)
    assert RULE.label() == "match 4..10, draft n - 2" and ANY_1GRAM.label() == "match 1..3, draft γ"


@pytest.mark.parametrize("low, high, lag", [(0, 3, None), (4, 3, 1), (3, 10, 3), (3, 10, -1)])
def test_a_rule_that_could_never_draft_or_draft_nonsense_is_refused(low, high, lag):
    with pytest.raises(ValueError):
        NgramRule(low, high, lag)


def test_the_old_rule_is_the_old_drafter():
    """ANY_1GRAM drafts what the first drafter did: the latest occurrence of the longest suffix of at most
    3 tokens, gamma tokens after it (a reference implementation of it, on random short sequences)."""
    import random

    def old(tokens, gamma):
        length = len(tokens)
        for n in range(min(3, length - 1), 0, -1):
            suffix = list(tokens[length - n :])
            for start in range(length - n - 1, -1, -1):
                if list(tokens[start : start + n]) == suffix:
                    return list(tokens[start + n : start + n + gamma])
        return []

    rng = random.Random(7)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(30))]
        assert ngram_draft(tokens, 5, ANY_1GRAM) == old(tokens, 5), tokens
