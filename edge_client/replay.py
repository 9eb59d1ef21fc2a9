"""A replay drafter for load tests and benchmarks: proposes a known continuation, some of it corrupted.

It costs nothing to run, so many sessions can share one machine with the verifier, and its acceptance
is set by `corrupt`: a draft token is replaced, deterministically by position, with that probability.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from draftwire.contract import SamplingParams
from draftwire.vocab import Vocabulary


class ReplayDrafter:
    executor = None  # cheap: proposes on the event loop

    def __init__(self, script: Sequence[int], vocabulary: Vocabulary, corrupt: float = 0.2, seed: int = 0):
        """`script`: prompt plus the target's own continuation, the sequence this drafter replays."""
        self.script = list(script)
        self.vocabulary = vocabulary
        self.corrupt = corrupt
        self.seed = seed

    def propose(
        self,
        sequence: Sequence[int],
        gamma: int,
        params: SamplingParams,
        stop_token_ids: Collection[int] = (),
        prompt_length: int = 0,
    ) -> list[int]:
        """The script's next gamma tokens after `sequence` (the script is trusted to match it)."""
        start = len(sequence)
        draft = []
        for position in range(start, start + gamma):
            rng = random.Random(self.seed * 1_000_003 + position)
            on_script = position < len(self.script) and rng.random() >= self.corrupt
            draft.append(self.script[position] if on_script else rng.randrange(self.vocabulary.size))
        return draft
