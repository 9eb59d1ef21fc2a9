"""Tokenizer fingerprints: one hash of a vocabulary that the edge and the verifier compute alike."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

# llama.cpp's converter pads a vocabulary up to the model's embedding rows with these names.
_PADDING = re.compile(r"\[PAD\d+\]")


@dataclass(frozen=True)
class Vocabulary:
    size: int  # number of token ids
    fingerprint: str  # sha256 hex of the token strings in id order

    def describe(self) -> str:
        return f"{self.size} tokens, fingerprint {self.fingerprint[:16]}"


def vocabulary_of(token_strings: Sequence[str]) -> Vocabulary:
    """Fingerprints token strings in id order (GGUF `tokenizer.ggml.tokens` or transformers'
    `convert_ids_to_tokens`, which spell byte-level tokens alike); trailing converter padding is
    not part of the vocabulary."""
    tokens = list(token_strings)
    while tokens and _PADDING.fullmatch(tokens[-1]):
        tokens.pop()
    digest = hashlib.sha256()
    for token in tokens:
        digest.update(token.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return Vocabulary(size=len(tokens), fingerprint=digest.hexdigest())
