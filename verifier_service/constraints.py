"""The verifier's side of structured output: its target's tokenizer for llguidance, and a session's matcher.

The tokenizer is built once per engine, from the token table of the transformers tokenizer
`TargetEngine.load` keeps, the one its vocabulary's fingerprint covers (about a second for a vocabulary of
150k); an engine without one (a fake) serves no constraint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from draftwire.contract import SessionSpec
from draftwire.grammar import Matcher, compile_constraint, table_tokenizer
from draftwire.vocab import tokens_from_hf

if TYPE_CHECKING:
    import llguidance  # imported by draftwire.grammar where a constraint is built


def grammar_tokenizer(engine) -> llguidance.LLTokenizer | None:
    """llguidance's tokenizer of the engine's target, or None when the engine has no tokenizer."""
    cached = getattr(engine, "_grammar_tokenizer", None)
    if cached is not None:
        return cached
    hf = getattr(engine, "tokenizer", None)
    if hf is None:
        return None
    built = hf_grammar_tokenizer(hf, engine.info.vocabulary.size, engine.info.eos_token_ids)
    engine._grammar_tokenizer = built
    return built


def hf_grammar_tokenizer(hf, size: int | None, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over a transformers tokenizer's first `size` ids: the table the vocabulary's
    fingerprint covers, id by id (draftwire.grammar.table_tokenizer)."""
    table = tokens_from_hf(hf, size)

    def tokenize(text: bytes) -> list[int]:
        return hf.encode(text.decode("utf-8", "replace"), add_special_tokens=False)

    return table_tokenizer(table.tokens, tokenize, eos_token_ids)


def serves_constraints(engine) -> bool:
    return getattr(engine, "tokenizer", None) is not None


def session_matcher(engine, spec: SessionSpec) -> Matcher | None:
    """The session's matcher at the start of its output, or None for an unconstrained session. Raises
    InvalidConstraint (draftwire.grammar) naming the field, LookupError when the engine serves none."""
    if spec.constraint is None:
        return None
    tokenizer = grammar_tokenizer(engine)
    if tokenizer is None:
        raise LookupError("this verifier serves no constraint (its engine has no tokenizer)")
    return compile_constraint(spec.constraint, tokenizer)
