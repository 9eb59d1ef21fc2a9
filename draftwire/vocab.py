"""Vocabulary fingerprints: a hash of what every token id means, computed alike by the edge and the verifier.

A token means its bytes, plus whether it is a plain piece of text or an added token (control, unknown or
user-defined: matched whole, outside the model's ordinary pieces). Libraries spell the same token
differently -- transformers keeps SentencePiece's `▁` and GPT-2's byte alphabet, a GGUF may store spaces,
llama.cpp hands out raw bytes -- so each side decodes its own spelling before hashing. This module takes
tokenizer and model objects as arguments and imports neither transformers nor llama_cpp at load: the
edge installs without torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# llama.cpp's converter pads a vocabulary up to the model's embedding rows with these names.
_PADDING = re.compile(r"\[PAD\d+\]")
# SentencePiece's byte-fallback pieces.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARK = "\u2581"  # SentencePiece's visible space

# Hashed first: a fingerprint of this scheme never equals one of the earlier spelling-based scheme.
_SCHEME = b"draftwire-vocab-meaning-1\0"
_TEXT, _ADDED = b"T", b"A"

# llama.cpp's token attributes (llama_token_attr), copied as numbers so that llama_cpp need not be imported.
_ATTR_UNKNOWN, _ATTR_NORMAL, _ATTR_CONTROL = 1 << 0, 1 << 2, 1 << 3
_ATTR_USER_DEFINED, _ATTR_BYTE = 1 << 4, 1 << 5
_LLAMA_VOCAB_TYPE_BPE = 2
# GGUF keys of the designated tokens; transformers registers each of them as a special token.
_DESIGNATED_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("bos", "eos", "unknown", "padding"))


@dataclass(frozen=True)
class Vocabulary:
    size: int  # number of token ids, trailing converter padding excluded
    fingerprint: str  # sha256 hex of every token's kind and bytes in id order

    def describe(self) -> str:
        return f"{self.size} tokens, fingerprint {self.fingerprint[:16]}"


@dataclass(frozen=True)
class _Token:
    added: bool  # control, unknown or user-defined rather than a piece of text
    data: bytes  # what the token stands for
    spelling: str  # how the library spells it, only to recognise converter padding


def _fingerprint(tokens: Sequence[_Token]) -> Vocabulary:
    tokens = list(tokens)
    while tokens and _PADDING.fullmatch(tokens[-1].spelling):
        tokens.pop()
    digest = hashlib.sha256(_SCHEME)
    for token in tokens:
        # Length-prefixed, so no token's bytes can run into the next token's kind.
        digest.update(_ADDED if token.added else _TEXT)
        digest.update(len(token.data).to_bytes(4, "little"))
        digest.update(token.data)
    return Vocabulary(size=len(tokens), fingerprint=digest.hexdigest())


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
            # Added tokens are matched in raw text, so their content is literal, never byte-level.
            tokens.append(_Token(True, added[i].content.encode("utf-8"), added[i].content))
        elif spelling is None:  # an id with no token: a hole in the vocabulary
            tokens.append(_Token(True, b"", ""))
        else:
            tokens.append(_Token(i in special, to_bytes(spelling), spelling))
    return _fingerprint(tokens)


# ---------------------------------------------------------------------------------------------------------
# llama.cpp


def vocabulary_from_llama(llm) -> Vocabulary:
    """The vocabulary of a llama_cpp.Llama (vocab_only=True is enough), read through llama.cpp's own
    token_to_piece and token attributes."""
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
        # sees, so that is the one that counts. Unused and undefined tokens have no piece of text.
        stored_added = bool(attr & (_ATTR_UNKNOWN | _ATTR_USER_DEFINED)) or not attr & (
            _ATTR_NORMAL | _ATTR_BYTE
        )
        if stored_added:
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
        tokens.append(_Token(stored_added or i in designated, data, text))
    return _fingerprint(tokens)


def _promoted_piece(text: str, byte_level: bool) -> bytes:
    if byte_level and _SPACE_MARK not in text:
        return _byte_level_bytes(text)
    return _sentencepiece_bytes(text, marks_spaces=True, byte_fallback=False)
