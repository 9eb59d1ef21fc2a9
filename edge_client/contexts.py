"""The edge app's recent conversations by token ids: a new prompt takes the ids of the one it shares the
longest prefix with, so that the verifier's kept cache and the draft's llama.cpp context (both keyed by
ids) serve that prefix again, whatever follows it.

Tokenizing a prompt afresh may split text differently from the ids a conversation already has (a reply's
generated tokens above all): the verifier would then find its kept cache shares only the ids before the
first such split. A prompt's pieces (edge_client.template) are matched against a remembered sequence in
order: a template piece by its ids (its special tokens), a message's content by its text, through the
remembered tokens whose text it begins with (plain tokens only, never a control token standing for
typed text); the rest of the prompt is tokenized afresh after them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from edge_client.template import Piece


@dataclass
class Contexts:
    drafter: object  # its llm: llama-cpp-python's tokenize and detokenize
    size: int = 32  # sequences remembered, the least recently used dropped first
    _recent: OrderedDict[tuple[int, ...], None] = field(default_factory=OrderedDict)
    _bytes: dict[int, tuple[bytes, bool]] = field(default_factory=dict)  # id: (its text, plain?)

    def __post_init__(self):
        self._lock = threading.Lock()  # prompt() runs in a worker thread

    def prompt(self, pieces: list[Piece], hint: list[int] | None = None) -> list[int]:
        """The ids of the rendered chat (blocking: run it off the event loop): those of the remembered
        sequence that shares the most with it, then the rest tokenized (the template's pieces with their
        special tokens, the messages' contents as text). `hint`: a sequence to remember first."""
        if hint:
            self.remember(hint)
        fresh = [(piece, self._tokenize(piece.text, special=not piece.content)) for piece in pieces]
        with self._lock:
            recent = list(self._recent)
        best, best_shared = [t for _, ids in fresh for t in ids], 0
        for known in recent:
            ids, shared = self._along(known, fresh)
            if shared > best_shared:
                best, best_shared = ids, shared
        return best

    def remember(self, ids: list[int]) -> None:
        key = tuple(ids)
        with self._lock:
            self._recent[key] = None
            self._recent.move_to_end(key)
            while len(self._recent) > self.size:
                self._recent.popitem(last=False)

    def _along(self, known: tuple[int, ...], fresh: list[tuple[Piece, list[int]]]) -> tuple[list[int], int]:
        """The prompt's ids following `known` as far as the prompt allows, and how many of them are
        known's first ones."""
        out: list[int] = []
        at: int | None = 0  # in known; None once the prompt has left it
        for piece, ids in fresh:
            if at is None:
                out += ids
                continue
            same = _common(known[at:], ids)
            if same == len(ids) or not piece.content:  # a template piece: its ids, as far as known has them
                out += ids
                at = at + same if same == len(ids) else None
                continue
            taken, used = self._text_along(known, at, piece.text.encode("utf-8"))
            out += known[at : at + taken]
            rest = piece.text.encode("utf-8")[used:].decode("utf-8")
            out += self._tokenize(rest, special=False)
            at = at + taken if not rest else None
        return out, _common(known, out)

    def _text_along(self, known: tuple[int, ...], at: int, text: bytes) -> tuple[int, int]:
        """How many of known's plain tokens from `at` spell the start of `text`, and their bytes (ending
        on a character's boundary)."""
        taken, used, ends = 0, 0, [0]
        while at + taken < len(known) and used < len(text):
            piece, plain = self._token(known[at + taken])
            if not plain or not piece or text[used : used + len(piece)] != piece:
                break
            taken, used = taken + 1, used + len(piece)
            ends.append(used)
        while taken and not _boundary(text, ends[taken]):  # a token ending inside a character
            taken -= 1
        return taken, ends[taken]

    def _token(self, token: int) -> tuple[bytes, bool]:
        found = self._bytes.get(token)
        if found is None:
            llm = self.drafter.llm
            text = llm.detokenize([token], special=True)
            found = self._bytes[token] = (text, llm.detokenize([token], special=False) == text)
        return found

    def _tokenize(self, text: str, special: bool) -> list[int]:
        return self.drafter.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special) if text else []


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _boundary(text: bytes, i: int) -> bool:
    """Whether byte i of UTF-8 `text` starts a character (or ends the text)."""
    return i >= len(text) or (text[i] & 0xC0) != 0x80
