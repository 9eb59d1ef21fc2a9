"""Vocabulary fingerprints: a hash of what every token id means, computed alike by the edge and the verifier.

What the pair must agree on, for the output to be the target's bit for bit and readable as the target's:

- **The same id means the same bytes.** The edge turns committed ids into text with llama.cpp, and the
  target's own tokenizer would turn them into the same text only if every id stands for the same bytes.
- **The same ids are special.** A special token (control or unknown in llama.cpp: BOS, EOS, `<|im_end|>`,
  `<unk>`; a special added token, or one of bos/eos/unk/pad, in transformers) is never produced from plain
  text and is not rendered as text, so a side that took `<|im_end|>` for the five-character text piece
  would tokenize prompts and print outputs that the other side never would. The fingerprint hashes one
  bit per token for it.

What is deliberately not hashed: **how an ordinary token reached the vocabulary.** llama.cpp spells some
tokens user-defined (matched whole in the text before the model's own splitting) where transformers has
an ordinary piece, or the reverse: Gemma's whitespace runs (ids 138-167) are user-defined in its GGUF and
plain pieces in transformers' Gemma tokenizer, Qwen2's `<think>` is user-defined in llama.cpp and an added
non-special token in transformers. Such a token means the same bytes and is produced from text on both
sides; the difference is how each converter spells the vocabulary, and an earlier scheme that hashed it
refused pairs made from one file. Normal, user-defined, byte and promoted-control-but-stored-normal
tokens are therefore one kind: text.

Whether the two tokenizers split text the same way (merges, pre-tokenizer regex, normalizer) is not in
a per-id table at all and so not in the fingerprint: tests/exact/test_vocab.py checks it family by family
against llama.cpp's own expected tokenizations (docs/vocabularies.md has the matrix), and the demo and
SmolLM2 tests on held-out text.

Libraries spell the same bytes differently -- transformers keeps SentencePiece's `▁` and GPT-2's byte
alphabet, a GGUF may store spaces, llama.cpp hands out raw bytes -- so each side decodes its own spelling
before hashing. Only sizes and fingerprints cross the wire; where both token tables are at hand (a pair
check, a test), `compare_vocabularies` names the first id that differs and what each side holds there.
This module takes tokenizer and model objects as arguments and imports neither transformers nor
llama_cpp at load: the edge installs without torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# llama.cpp's converter pads a vocabulary up to the model's embedding rows with these names.
_PADDING = re.compile(r"\[PAD\d+\]")
# SentencePiece's byte-fallback pieces.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # SentencePiece's visible space

# Hashed first: a fingerprint of this scheme never equals one of an earlier scheme (1 hashed "added"
# rather than "special", so user-defined tokens refused pairs made from one file).
_SCHEME = b"draftwire-vocab-meaning-2\0"
_TEXT, _SPECIAL = b"T", b"S"

# llama.cpp's token attributes (llama_token_attr), copied as numbers so that llama_cpp need not be imported.
_ATTR_UNKNOWN, _ATTR_NORMAL, _ATTR_CONTROL = 1 << 0, 1 << 2, 1 << 3
_ATTR_USER_DEFINED, _ATTR_BYTE = 1 << 4, 1 << 5
_LLAMA_VOCAB_TYPE_BPE = 2
# GGUF keys of the designated tokens; transformers registers each of them as a special token.
_DESIGNATED_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding"))


@dataclass(frozen=True)
class Vocabulary:
    size: int  # number of token ids, trailing converter padding excluded
    fingerprint: str  # sha256 hex of every token's special bit and bytes in id order

    def describe(self) -> str:
        return f"{self.size} tokens, fingerprint {self.fingerprint[:16]}"


@dataclass(frozen=True)
class Token:
    """What one id means: its bytes, and whether it is special (never produced from plain text)."""

    special: bool
    data: bytes

    def describe(self) -> str:
        return f"{self.data!r} ({'special' if self.special else 'text'})"


@dataclass(frozen=True)
class TokenTable:
    """A whole vocabulary, id by id, with its fingerprint; for comparing two sides on one machine."""

    vocabulary: Vocabulary
    tokens: tuple[Token, ...] = field(repr=False)


@dataclass(frozen=True)
class _Token:
    special: bool  # control or unknown: never produced from plain text, not rendered as text
    data: bytes  # what the token stands for
    spelling: str  # how the library spells it, only to recognise converter padding


def _table(tokens: Sequence[_Token]) -> TokenTable:
    tokens = list(tokens)
    while tokens and _PADDING.fullmatch(tokens[-1].spelling):
        tokens.pop()
    digest = hashlib.sha256(_SCHEME)
    for token in tokens:
        # Length-prefixed, so no token's bytes can run into the next token's kind.
        digest.update(_SPECIAL if token.special else _TEXT)
        digest.update(len(token.data).to_bytes(4, "little"))
        digest.update(token.data)
    return TokenTable(
        Vocabulary(size=len(tokens), fingerprint=digest.hexdigest()),
        tuple(Token(t.special, t.data) for t in tokens),
    )


def compare_vocabularies(
    a: TokenTable, b: TokenTable, names: tuple[str, str] = ("draft", "target")
) -> str | None:
    """None when the two tables pair up (equal fingerprints); otherwise one line naming the first id
    whose meaning differs, both sides' view of it, and how many ids differ in all."""
    if a.vocabulary == b.vocabulary:
        return None
    first, count = None, 0
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)):  # sizes may differ
        if x != y:
            count += 1
            first = i if first is None else first
    (na, nb), (sa, sb) = names, (a.vocabulary.size, b.vocabulary.size)
    sizes = f"the {na} has {a.vocabulary.describe()}, the {nb} {b.vocabulary.describe()}"
    if first is None:
        if sa == sb:  # equal tables, equal sizes: only a fingerprint of another scheme can differ
            return f"vocabulary mismatch: {sizes}, yet every id means the same on both sides"
        longer, name = (a, na) if sa > sb else (b, nb)
        return (
            f"vocabulary mismatch: {sizes}; ids 0 to {min(sa, sb) - 1} agree, and from id {min(sa, sb)} "
            f"only the {name} has tokens (id {min(sa, sb)}: {longer.tokens[min(sa, sb)].describe()})"
        )
    more = f" ({count} of the {min(sa, sb)} shared ids differ" + (", and the sizes too)" if sa != sb else ")")
    return (
        f"vocabulary mismatch: {sizes}; the first id that differs is {first}: the {na} has "
        f"{a.tokens[first].describe()}, the {nb} {b.tokens[first].describe()}{more}"
    )


def _gpt2_byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable bytes stand for themselves, the other 68 bytes
    for the code points from 256 upwards, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {byte: chr(byte) for byte in printable}
    for offset, byte in enumerate(b for b in range(256) if b not in chars):
        chars[byte] = chr(256 + offset)
    return {char: byte for byte, char in chars.items()}


_GPT2_BYTE_OF_CHAR = _gpt2_byte_of_char()


def _byte_level_bytes(spelling: str) -> bytes:
    # A character outside the alphabet cannot come from a byte-level trainer; it stands for itself.
    return b"".join(
        bytes([_GPT2_BYTE_OF_CHAR[c]]) if c in _GPT2_BYTE_OF_CHAR else c.encode("utf-8") for c in spelling
    )


def _sentencepiece_bytes(spelling: str, marks_spaces: bool, byte_fallback: bool) -> bytes:
    match = _BYTE_PIECE.fullmatch(spelling) if byte_fallback else None
    if match:
        return bytes([int(match.group(1), 16)])
    return (spelling.replace(_SPACE_MARK, " ") if marks_spaces else spelling).encode("utf-8")


# ---------------------------------------------------------------------------------------------------------
# transformers


def _nodes(component) -> list[dict]:
    """Every JSON object in a tokenizers component (decoder, normalizer, ...), nested ones included."""
    if component is None:
        return []
    found: list[dict] = []
    pending = [json.loads(component.__getstate__())]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            found.append(node)
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return found


def _replaces(nodes: list[dict], old: str, new: str) -> bool:
    return any(
        n.get("type") == "Replace" and n.get("pattern") == {"String": old} and n.get("content") == new
        for n in nodes
    )


def _hf_spelling_rule(tokenizer) -> Callable[[str], bytes]:
    """How this tokenizer's vocabulary spells bytes: GPT-2's byte alphabet, SentencePiece's `▁` and
    `<0xXX>` pieces, or plain UTF-8."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        # A slow tokenizer: the Python classes keep their alphabet in these attributes.
        if hasattr(tokenizer, "byte_decoder"):
            return _byte_level_bytes
        if hasattr(tokenizer, "sp_model"):
            return lambda s: _sentencepiece_bytes(s, marks_spaces=True, byte_fallback=True)
        return lambda s: s.encode("utf-8")
    # The decoder is what turns pieces back into text, so it says how they are to be read; without
    # one, the pre-tokenizer and the normalizer say how text was turned into pieces.
    decoder = _nodes(backend.decoder)
    types = {n.get("type") for n in decoder}
    if not decoder:
        encoding = _nodes(backend.pre_tokenizer) + _nodes(backend.normalizer)
        if "ByteLevel" in {n.get("type") for n in encoding}:
            return _byte_level_bytes
        marks_spaces = any(n.get("type") == "Metaspace" for n in encoding) or _replaces(
            encoding, " ", _SPACE_MARK
        )
    elif "ByteLevel" in types:
        return _byte_level_bytes
    else:
        marks_spaces = "Metaspace" in types or _replaces(decoder, _SPACE_MARK, " ")
    byte_fallback = "ByteFallback" in types or bool(getattr(backend.model, "byte_fallback", False))
    return lambda s: _sentencepiece_bytes(s, marks_spaces, byte_fallback)


def vocabulary_from_hf(tokenizer, model_vocab_size: int | None = None) -> Vocabulary:
    """The vocabulary of a transformers tokenizer (fast or slow).

    model_vocab_size, the model's embedding rows (config.vocab_size), cuts off ids the model cannot
    embed, such as a token the tokenizer class adds on load when the files name a special token the
    vocabulary lacks.
    """
    return tokens_from_hf(tokenizer, model_vocab_size).vocabulary


def tokens_from_hf(tokenizer, model_vocab_size: int | None = None) -> TokenTable:
    """vocabulary_from_hf with every id's meaning kept, for compare_vocabularies."""
    size = len(tokenizer)
    if model_vocab_size is not None:
        size = min(size, model_vocab_size)
    spelled = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items() if i < size}
    special = set(tokenizer.all_special_ids)
    to_bytes = _hf_spelling_rule(tokenizer)
    tokens = []
    for i, spelling in enumerate(spelled):
        if i in added:
            # Added tokens are matched in raw text, so their content is literal, never byte-level; a
            # non-special one (`<think>`, a whitespace run) is text like any piece.
            token = added[i]
            tokens.append(_Token(token.special or i in special, token.content.encode("utf-8"), token.content))
        elif spelling is None:  # an id with no token: a hole in the vocabulary, never produced
            tokens.append(_Token(True, b"", ""))
        else:
            tokens.append(_Token(i in special, to_bytes(spelling), spelling))
    return _table(tokens)


# ---------------------------------------------------------------------------------------------------------
# llama.cpp


def vocabulary_from_llama(llm) -> Vocabulary:
    """The vocabulary of a llama_cpp.Llama (vocab_only=True is enough), read through llama.cpp's own
    token_to_piece and token attributes."""
    return tokens_from_llama(llm).vocabulary


def tokens_from_llama(llm) -> TokenTable:
    """vocabulary_from_llama with every id's meaning kept, for compare_vocabularies."""
    import ctypes

    import llama_cpp  # the binding `llm` came from, so it is installed

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    count = llama_cpp.llama_vocab_n_tokens(vocab)
    designated = set()
    for key in _DESIGNATED_KEYS:
        value = llm.metadata.get(key)
        if value is not None and 0 <= int(value) < count:
            designated.add(int(value))
    byte_level = llama_cpp.llama_vocab_type(vocab) == _LLAMA_VOCAB_TYPE_BPE
    buffer = ctypes.create_string_buffer(256)
    tokens = []
    for i in range(count):
        attr = llama_cpp.llama_vocab_get_attr(vocab, i)
        text = llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8", "surrogateescape")
        # llama.cpp turns a token into CONTROL at load when its spelling looks like one (Qwen2's normal
        # "</s>", say) and keeps the stored type's bit beside it; the stored type is what transformers
        # sees, so that is the one that counts. A user-defined token is text (see the module's
        # docstring); control, unknown, unused and undefined ones are never produced from text.
        literal = bool(attr & (_ATTR_UNKNOWN | _ATTR_USER_DEFINED)) or not attr & (_ATTR_NORMAL | _ATTR_BYTE)
        special = bool(attr & _ATTR_UNKNOWN) or not attr & (_ATTR_NORMAL | _ATTR_BYTE | _ATTR_USER_DEFINED)
        if literal:  # stored as the text it matches, never in a byte alphabet
            data = text.encode("utf-8", "surrogateescape")
        elif attr & _ATTR_CONTROL:
            # Promoted at load: token_to_piece would give the raw spelling, so decode it here.
            data = _promoted_piece(text, byte_level)
        else:
            length = llama_cpp.llama_token_to_piece(vocab, i, buffer, len(buffer), 0, True)
            if length < 0:  # the piece is longer than the buffer; -length is what it needs
                buffer = ctypes.create_string_buffer(-length)
                length = llama_cpp.llama_token_to_piece(vocab, i, buffer, len(buffer), 0, True)
            data = buffer.raw[:length]
        tokens.append(_Token(special or i in designated, data, text))
    return _table(tokens)


def _promoted_piece(text: str, byte_level: bool) -> bytes:
    if byte_level and _SPACE_MARK not in text:
        return _byte_level_bytes(text)
    return _sentencepiece_bytes(text, marks_spaces=True, byte_fallback=False)
