"""Prompt lookup replayed on known outputs (tools/bench/ngram_replay.py), and the capacity bench's rule
option: pure, no model."""

import pytest

from tools.bench import capacity, ngram_replay


def test_ngram_replay_counts_the_verifiers_rounds():
    """Prompt lookup replayed on a known output: the draft after (5, 6, 7, 8) is what followed the earlier
    (5, 6, 7, 8), two tokens for a 4-token match, cut to the budget; the target's token ends each round."""
    from draftwire.ngram import ANY_1GRAM

    replay = ngram_replay.replay((5, 6, 7, 8, 9, 5, 6, 7, 8), (9, 5, 2, 2), max_gamma=5)
    # Round 1: draft (9, 5), both accepted, then the target's 2; round 2: no room to draft.
    assert replay == {
        "tokens": 4,
        "rounds": 2,
        "drafts": 1,
        "draft_tokens": 2,
        "accepted_tokens": 2,
        "round_positions": 4,
    }
    totals = ngram_replay.totals([replay, replay])
    assert totals["acceptance"] == 1.0 and totals["tokens_per_round"] == 2.0
    # A 2- or 3-token match drafts nothing now (rounds 1 and 2 are the target alone: 7, then 8); then
    # (5, 6, 7, 8) matches and drafts (5, 6), cut to (5,) by the budget and rejected (9); round 4 has no
    # room. The first rule drafted on the 2-token match.
    replay = ngram_replay.replay((5, 6, 7, 8, 5, 6), (7, 8, 9, 9), max_gamma=5)
    assert [replay[k] for k in ("rounds", "drafts", "draft_tokens", "round_positions")] == [4, 1, 1, 5]
    replay = ngram_replay.replay((5, 6, 7, 8, 5, 6), (7, 8, 9, 9), max_gamma=5, rule=ANY_1GRAM)
    # Round 1: draft (7, 8, 5) (budget 4), two accepted, then the target's 9; round 2: no room to draft.
    assert (replay["draft_tokens"], replay["accepted_tokens"], replay["round_positions"]) == (3, 2, 5)


def test_ngram_rule_option():
    args = capacity.parser().parse_args(
        ["--ngram-from", "x.json", "--ngram-rule", "1,3,-", "--ngram-rule", "4,10,2"]
    )
    assert [(r.min_ngram, r.max_ngram, r.lag) for r in args.ngram_rule] == [(1, 3, None), (4, 10, 2)]
    with pytest.raises(SystemExit):
        capacity.parser().parse_args(["--ngram-rule", "0,3,1"])
