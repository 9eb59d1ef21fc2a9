"""The verifier's KV caches: a session's layers that grow in place (GrowingLayer), a batch's view of
its sessions' caches as transformers' attention sees them (RowsCache, read by `rows_attention`), and
finished sessions' caches kept for the next turn (PrefixCache). How the engine uses them:
verifier_service.engine."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from verifier_service.attention import (
    FUSED_BLOCK,
    KEY_BLOCK,
    batched_block_attention,
    block_attention,
    fused_attention,
    softcapped_attention,
    whole,
)
from verifier_service.settings import PrefixCacheConfig

ROOM_BLOCK = max(KEY_BLOCK, FUSED_BLOCK)  # a cache's capacity in whole blocks of either exact attention
# The invariant attentions of a batch (verifier_service.attention): fixed key blocks one session at a
# time (block_attention); all of a layer's sessions in one set of calls (batched_block_attention, a
# GPU's way: per session, a layer's calls are launches; on a CPU the copies into one tensor cost more
# than the calls); one session at a time through torch's fused kernel (fused_attention, a CPU's way
# where the load proves it; the key blocks where scores are capped).
EXACT_ATTENTIONS = ("blocks", "batched", "fused")


class GrowingLayer:
    """One layer of one session's cache: keys and values that append in place into spare capacity,
    doubling it when full (transformers' DynamicLayer concatenates, copying the whole cache each round).

    With a `limit`, the capacity never passes it unless an append needs more: a session's cache stays
    within the positions its admission reserved (verifier_service/admission.py)."""

    def __init__(self, limit: int | None = None):
        self._keys: torch.Tensor | None = None  # [1, kv_heads, capacity, head_dim]
        self._values: torch.Tensor | None = None
        self.length = 0  # positions held
        self.limit = limit  # most positions of capacity (None: doubling without bound)

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends new positions; returns views of all held ones.  # each [1, kv_heads, length, head_dim]"""
        end = self.length + keys.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            self._grow(keys, end)
        self._keys[..., self.length : end, :] = keys
        self._values[..., self.length : end, :] = values
        self.length = end
        return self._keys[..., :end, :], self._values[..., :end, :]

    def cut(self, length: int) -> None:
        """Keeps the first `length` positions."""
        self.length = min(self.length, length)

    def fit(self, limit: int) -> None:
        """Sets the limit, and gives back the capacity past it (a kept cache taken by a session that
        reserved fewer positions than the cache's earlier owner)."""
        self.limit = limit
        if self._keys is not None and self.capacity > max(limit, self.length):
            self._resize(self._keys, max(limit, self.length))

    def reserve(self, like: torch.Tensor, positions: int) -> None:
        """Capacity for `positions` in whole blocks, made at once (no doubling on the way to them); the
        layer's keys and values have `like`'s shape but for the positions."""
        capacity = whole(positions, ROOM_BLOCK)
        if capacity > self.capacity:
            self._resize(like, capacity)

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        target = max(2 * self.capacity, 64)
        if target > 64:  # whole key blocks: invariant attention reads to the next block's end in place
            target = whole(target, ROOM_BLOCK)
        if self.limit is not None:
            target = min(target, self.limit)
        self._resize(like, max(needed, target))

    def _resize(self, like: torch.Tensor, capacity: int) -> None:
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        # Zeroed: invariant attention reads the room past the held positions (finite values only).
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self._keys is not None:
            keys[..., : self.length, :] = self._keys[..., : self.length, :]
            values[..., : self.length, :] = self._values[..., : self.length, :]
        self._keys, self._values = keys, values


@dataclass
class _Rows:
    """A batch's keys (or values) of one layer, row by row: each row's whole session, new positions last."""

    states: list[torch.Tensor]  # per row [1, kv_heads, held positions, head_dim]
    widths: list[int]  # new positions per row
    masks: dict  # the batch's causal masks, built once for all its layers: _causal_mask's arguments -> mask
    attention: str | None = None  # None (plain sdpa) or one of EXACT_ATTENTIONS


class _RowsLayer:
    """One layer of a batch, as transformers' attention modules see it: `update` appends each row's new
    positions (its stretch of the packed sequence) to its session's layer and hands on the rows."""

    is_sliding = False

    def __init__(
        self,
        sessions: list[GrowingLayer],
        widths: list[int],
        masks: dict,
        attention: str | None,
    ):
        self.sessions, self.widths, self.masks, self.attention = sessions, widths, masks, attention

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states  # [1, kv_heads, sum(widths), head_dim]: the rows one after another
        held = [
            layer.append(keys, values)
            for layer, keys, values in zip(
                self.sessions,
                key_states.split(self.widths, dim=2),
                value_states.split(self.widths, dim=2),
                strict=True,
            )
        ]
        keys, values = ([states[i] for states in held] for i in (0, 1))
        return tuple(_Rows(states, self.widths, self.masks, self.attention) for states in (keys, values))


class RowsCache(Cache):
    """The past_key_values of a batch: each row reads and grows its own session's cache in place, so no
    session's cache is copied into the batch. Paired with `rows_attention`. `attention`: None for the
    plain path, else one of EXACT_ATTENTIONS."""

    def __init__(
        self,
        sessions: list[list[GrowingLayer]],
        widths: list[int],
        attention: str | None = None,
    ):
        if attention is not None and attention not in EXACT_ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}: choose one of {', '.join(EXACT_ATTENTIONS)}")
        masks = {}
        layers = [_RowsLayer(list(layer), widths, masks, attention) for layer in zip(*sessions, strict=True)]
        super().__init__(layers=layers)


ROWS_ATTENTION = "draftwire_rows"


def rows_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A transformers attention function: each row of the batch, a stretch of one packed sequence,
    attends over its own session's keys and values (from `RowsCache`), causally, with no padding and no
    copy of the cache.

    query  # [1, heads, sum(widths), head_dim]; key, value: _Rows
    returns (output [1, sum(widths), heads, head_dim], None)
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("the verifier's attention does not support attention sinks")
    if not isinstance(key, _Rows):
        raise TypeError("rows_attention reads the sessions' caches: run the model through TargetEngine")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if key.attention == "batched":
        out = batched_block_attention(
            query, key.states, value.states, key.widths, scaling, window, softcap, key.masks
        )
        return out, None
    outputs = []
    for rows, keys, values in zip(query.split(key.widths, dim=2), key.states, value.states, strict=True):
        if key.attention == "fused" and softcap is None:
            outputs.append(fused_attention(rows, keys, values, scaling, window, key.masks))
            continue
        if key.attention is not None:
            outputs.append(block_attention(rows, keys, values, scaling, window, softcap, key.masks))
            continue
        shape = (rows.shape[2], keys.shape[-2], window)
        if shape not in key.masks:
            key.masks[shape] = _causal_mask(*shape, query.device)
        if softcap is None:
            out = torch.nn.functional.scaled_dot_product_attention(
                rows, keys, values, attn_mask=key.masks[shape], scale=scaling, enable_gqa=True
            )
        else:
            out = softcapped_attention(rows, keys, values, scaling, softcap, key.masks[shape])
        outputs.append(out.transpose(1, 2))  # [1, n, heads, head_dim]
    return torch.cat(outputs, dim=1), None


def _causal_mask(new: int, held: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Which of `held` positions each of the last `new` ones sees (itself and earlier, within the
    sliding window if any).  # [new, held] bool, or None when that is all of them"""
    if new == 1 and (window is None or held <= window):
        return None
    query_pos = torch.arange(held - new, held, device=device)[:, None]
    key_pos = torch.arange(held, device=device)[None, :]
    seen = key_pos <= query_pos
    if window is not None:
        seen &= key_pos > query_pos - window
    return seen


AttentionInterface.register(ROWS_ATTENTION, rows_attention)


@dataclass
class SessionCache:
    layers: list[GrowingLayer]
    tokens: list[int] = field(default_factory=list)  # the token at each held position
    owner: str = ""  # the client whose sessions may take it once kept

    @property
    def length(self) -> int:  # positions held
        return self.layers[0].length

    @property
    def nbytes(self) -> int:  # memory held, spare capacity included
        return sum(t.nbytes for layer in self.layers for t in (layer._keys, layer._values) if t is not None)


class PrefixCache:
    """Finished sessions' KV caches, least recently used first, within a memory budget and a time limit.

    A kept cache is identified by its owner (the client whose session left it) and the token ids it
    holds: a new sequence takes the owner's kept cache with which it shares the longest prefix. Only the
    same client's sessions take it, so no client learns from a fast prefill what another one sent.
    Taking moves the cache to the new session; it comes back, extended, when that session ends.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        clock: Callable[[], float] = time.monotonic,
        room: Callable[[], int] | None = None,
    ):
        """`room()`: the memory kept caches may hold now beside the live sessions' (None: the config's
        budget alone), the server's KV budget less what admission reserved, so that kept caches give
        way to sessions and never push the whole past the budget."""
        self.config, self.clock, self.room = config, clock, room
        self._kept: OrderedDict[int, tuple[SessionCache, float]] = OrderedDict()  # oldest first
        self._ids = itertools.count()
        self.bytes = 0

    @property
    def limit(self) -> int:
        """The bytes kept caches may hold now."""
        budget = self.config.budget_bytes
        return budget if self.room is None else max(0, min(budget, self.room()))

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, cache: SessionCache) -> None:
        """Keeps a finished session's cache (if it fits the budget at all), dropping the least recently
        used ones to make room."""
        size = cache.nbytes
        if not cache.tokens or size > self.limit:
            return
        self._kept[next(self._ids)] = (cache, self.clock())
        self.bytes += size
        self._expire()
        self.fit()

    def fit(self) -> None:
        """Drops the least recently used kept caches until the rest fit `limit`."""
        limit = self.limit
        while self._kept and self.bytes > limit:
            self._drop(next(iter(self._kept)))

    def take(self, tokens: Sequence[int], owner: str = "") -> tuple[SessionCache | None, int]:
        """Removes and returns `owner`'s kept cache sharing the longest prefix with `tokens` (at most all
        of them), and that prefix's length; (None, 0) when none shares a token."""
        self._expire()
        best, best_n = None, 0
        for kid, (cache, _) in self._kept.items():
            n = _common_prefix(cache.tokens, tokens) if cache.owner == owner else 0
            if n > best_n:
                best, best_n = kid, n
        if best is None:
            return None, 0
        cache = self._drop(best)
        return cache, best_n

    def _expire(self) -> None:
        horizon = self.clock() - self.config.ttl_s
        for kid in [k for k, (_, at) in self._kept.items() if at < horizon]:
            self._drop(kid)

    def _drop(self, kid: int) -> SessionCache:
        cache, _ = self._kept.pop(kid)
        self.bytes -= cache.nbytes
        return cache


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
