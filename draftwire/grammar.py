"""Structured output: a session's constraint compiled by llguidance, and a matcher that follows its tokens.

The edge and the verifier run the same engine (llguidance) over the same vocabulary (the fingerprint
check: the same ids mean the same bytes), so the draft proposes under the mask the target is verified
with and acceptance survives a constraint. Only the verifier's masks decide the output; the edge's are
advice, and a draft that strays from them is rejected like any other.

Both sides build llguidance's tokenizer with `table_tokenizer` from the token table their vocabulary's
fingerprint covers (draftwire.vocab): the verifier from transformers' tokenizer, the edge from the GGUF's
vocabulary. This module takes the table and imports neither library; llguidance itself is imported where
a constraint is first compiled or checked, so that a verifier that serves none (a machine without it)
imports this module all the same.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from draftwire.contract import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from draftwire.vocab import Token

if TYPE_CHECKING:
    import llguidance

# JSON as a model writes it: one space after ':' and ',', no other whitespace (flexible whitespace lets a
# model pad with newlines until max_tokens). Where a byte is forced, the draft and the target both take it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on a grammar's size and on the lexer work of each token, well below where a compile or a mask
# takes a second: llguidance refuses past them (the matcher enters an error state that `compile` reports).
LIMITS = dict(max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000)
COMPILE_SECONDS = 1.0  # a constraint whose compile took longer is refused, so a later one is not tried


class InvalidConstraint(ValueError):
    """A constraint that does not compile, or is too large or too slow; the message names its field."""


def field_name(constraint: Constraint) -> str:
    return f"constraint.{constraint.kind.value}"


def grammar_source(constraint: Constraint) -> str:
    """llguidance's grammar for the constraint (not yet checked). Raises InvalidConstraint for a source
    over MAX_CONSTRAINT_BYTES, or a schema that is not a JSON object."""
    import llguidance

    name = field_name(constraint)
    size = len(constraint.source.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidConstraint(f"{name} is {size} bytes: at most {MAX_CONSTRAINT_BYTES}")
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.source)
        except ValueError as e:
            raise InvalidConstraint(f"{name} is not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidConstraint(f"{name} must be a JSON object (a schema), got {type(schema).__name__}")
        if isinstance(schema, dict):
            schema.pop("x-guidance", None)  # the engine's own options are ours to set
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise InvalidConstraint(f"{name}: {e}") from None
    if not constraint.source:
        raise InvalidConstraint(f"{name} is empty")
    if kind is ConstraintKind.GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(constraint.source)
    return llguidance.LLMatcher.grammar_from_regex(constraint.source)


def check_constraint(constraint: Constraint) -> None:
    """Checks a constraint without a vocabulary (a client's early check; the verifier's is
    `compile_constraint`). Raises InvalidConstraint naming the field."""
    import llguidance

    source = grammar_source(constraint)
    error = llguidance.LLMatcher.validate_grammar(source, limits=llguidance.LLParserLimits(**LIMITS))
    if error:
        raise InvalidConstraint(f"{field_name(constraint)}: {error.strip()}")


def table_tokenizer(
    tokens: Sequence[Token], tokenize, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over a vocabulary's tokens (draftwire.vocab's table, whose fingerprint the
    two sides compare): a special token is special to the grammar, any other is its bytes. `tokenize`
    turns text (bytes) into ids. Built from the compared table, the verifier's masks treat each id as the
    edge's do: `llguidance.hf` takes every added token for a special one, and then allowed Qwen2's
    `<tool_call>` (text to transformers) where the grammar asks for the text, and failed on consuming it."""
    import llguidance

    class Vocabulary:
        eos_token_id = eos_token_ids[0] if eos_token_ids else None
        bos_token_id = None
        special_token_ids = [i for i, t in enumerate(tokens) if t.special]

        def __init__(self):
            self.tokens = [b"\xff" + t.data if t.special else t.data for t in tokens]

        def __call__(self, text: bytes) -> list[int]:
            return tokenize(text)

    wrapper = llguidance.TokenizerWrapper(Vocabulary())
    return llguidance.LLTokenizer(wrapper, eos_token=list(eos_token_ids) or None)


def compile_constraint(constraint: Constraint, tokenizer: llguidance.LLTokenizer) -> Matcher:
    """A matcher at the start of the output. Raises InvalidConstraint naming the field: a source too
    large, not valid, using what llguidance does not implement, or past its limits."""
    source = grammar_source(constraint)
    started = time.perf_counter()
    matcher = Matcher(tokenizer, source)
    took = time.perf_counter() - started
    if matcher.error:
        raise InvalidConstraint(f"{field_name(constraint)}: {matcher.error.strip()}")
    if took > COMPILE_SECONDS:
        raise InvalidConstraint(
            f"{field_name(constraint)} took {took:.1f} s to compile: at most {COMPILE_SECONDS}"
        )
    return matcher


class Matcher:
    """Follows a session's generated tokens under its grammar: the mask at the next position, and the
    masks along a draft. llguidance's matcher consumes tokens and rolls them back; a token it does not
    allow would put it in an error state for good, so none is ever consumed unchecked."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, source: str):
        import llguidance

        self._matcher = llguidance.LLMatcher(
            tokenizer, source, log_level=0, limits=llguidance.LLParserLimits(**LIMITS)
        )
        self.width = tokenizer.vocab_size  # mask columns; ids past it (logits' padding) are never allowed
        self.tokens: list[int] = []  # the generated tokens consumed, in order

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""

    @property
    def accepting(self) -> bool:
        """Whether the output may end here."""
        return self._matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """The tokens allowed at the next position.  # [width] bool
        Raises RuntimeError when the matcher is in an error state (it would allow nothing)."""
        if self._matcher.is_error():
            raise RuntimeError(f"the constraint's matcher failed: {self._matcher.get_error()}")
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.width].astype(bool)

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here (llguidance's fast-forward tokens)."""
        return list(self._matcher.compute_ff_tokens())

    def follow(self, tokens: Sequence[int]) -> int:
        """Moves to the end of `tokens` (the generated ones, from the first): rolls back past where they
        part from those consumed, then consumes the rest. Returns how many of `tokens` it now holds:
        fewer than all when the grammar refused one (it then stays right before it)."""
        keep = 0
        limit = min(len(self.tokens), len(tokens))
        while keep < limit and self.tokens[keep] == tokens[keep]:
            keep += 1
        if keep < len(self.tokens):
            self._matcher.rollback(len(self.tokens) - keep)
            del self.tokens[keep:]
        rest = list(tokens[keep:])
        valid = self._matcher.validate_tokens(rest) if rest else 0
        if valid and not self._matcher.consume_tokens(rest[:valid]):
            raise RuntimeError(f"llguidance refused tokens it had validated: {self._matcher.get_error()}")
        self.tokens += rest[:valid]
        return len(self.tokens)

    def masks(self, draft: Sequence[int], stop_token_ids: Collection[int] = ()) -> np.ndarray:
        """The allowed tokens at each position of a round: row i after the draft's first i tokens.
        # [len(draft) + 1, width] bool

        Past a draft token the grammar refuses, or a stop token, no row can choose a committed token
        (the target's choice there differs from the draft's, or the session ends): those rows repeat the
        last mask computed. The matcher ends where it started."""
        rows = np.empty((len(draft) + 1, self.width), dtype=bool)
        consumed = 0
        rows[0] = self.allowed()
        for i, token in enumerate(draft):
            if not (0 <= token < self.width and rows[i][token]) or token in stop_token_ids:
                rows[i + 1 :] = rows[i]
                break
            self._matcher.consume_token(token)
            consumed += 1
            rows[i + 1] = self.allowed()
        if consumed:
            self._matcher.rollback(consumed)
        return rows
