"""A draft wrong on purpose, for the benches and tests of speculation that does not pay."""

from __future__ import annotations


class WrongDrafter:
    """A real drafter at its real cost, each token it drafts shifted to the next id: a draft wrong on
    purpose, as an unrelated draft or a prompt class where agreement collapses would be."""

    def __init__(self, inner, vocab_size: int):
        self.inner, self.vocab_size = inner, vocab_size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs) -> list[int]:
        return [(t + 1) % self.vocab_size for t in self.inner.propose(*args, **kwargs)]
