"""The target engine: a transformers causal LM that keeps one KV cache per session.

A session's cache holds every committed position but the last committed token; a forward first cuts
the cache back to the positions the caller keeps, then runs the new tokens on top of it, so a round
costs gamma + 1 positions and never recomputes the prefix. Cache layers append in place into spare
capacity (transformers' DynamicLayer concatenates, copying the whole cache every round), and a batch
of sessions copies each session's cache once into the batch and only the new positions back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from draftwire.vocab import Vocabulary, vocabulary_of


@dataclass(frozen=True)
class TargetInfo:
    target_id: str  # model directory name
    vocabulary: Vocabulary  # the tokenizer's ids and fingerprint
    max_context: int  # longest sequence the model accepts
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str  # Jinja, empty when the tokenizer has none


@dataclass(frozen=True)
class Forward:
    key: str  # the session
    keep: int  # cached positions to keep; the rest is cut first
    token_ids: tuple[int, ...]  # new positions to run
    logits: bool = True  # False skips the logits (prefill)


class GrowingLayer(DynamicLayer):
    """A cache layer that appends in place into spare capacity, doubling it when full.

    `keys` and `values` are views of the first `length` positions. # [batch, kv_heads, length, head_dim]
    """

    def __init__(self):
        super().__init__()
        self._keys: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
        self._values: torch.Tensor | None = None
        self._length = 0

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> GrowingLayer:
        """A layer over preallocated buffers whose first `length` positions are filled."""
        layer = cls()
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        layer._keys, layer._values = keys, values
        layer._set_length(length)
        return layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            self._grow(key_states, end)
        self._keys[..., self._length : end, :] = key_states
        self._values[..., self._length : end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last -tokens_to_remove positions (a negative count, as DynamicLayer takes)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of positions to remove")
        if self.is_initialized:
            self._set_length(max(0, self._length + tokens_to_remove))

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        old = 0 if self._keys is None else self._keys.shape[-2]
        shape = (*like.shape[:-2], max(needed, 2 * old, 64), like.shape[-1])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self._keys is not None:
            keys[..., : self._length, :] = self._keys[..., : self._length, :]
            values[..., : self._length, :] = self._values[..., : self._length, :]
        self._keys, self._values = keys, values

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._keys[..., :length, :]
        self.values = self._values[..., :length, :]


def new_cache(config) -> DynamicCache:
    """A DynamicCache whose plain layers grow in place; special layers (sliding windows) stay as they are."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@dataclass
class _Cache:
    kv: DynamicCache
    length: int = 0  # positions held


class TargetEngine:
    """Runs the target over new positions of a session; single-threaded by contract (callers
    serialise calls, e.g. on one executor thread)."""

    def __init__(self, model: torch.nn.Module, info: TargetInfo, device: torch.device):
        self.model = model
        self.info = info
        self.device = device
        self._caches: dict[str, _Cache] = {}
        # Per layer, the keys and values buffers batches are assembled in, reused from batch to batch:
        # fresh large buffers each batch cost more in page faults than the copies into them.
        self._workspace: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def load(cls, model_dir: Path, device: str | None = None) -> TargetEngine:
        """Loads a transformers model directory: float32 on CPU, bfloat16 on CUDA when present.

        Raises OSError or ValueError from transformers when the directory holds no causal LM.
        """
        model_dir = Path(model_dir)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
        return cls(model, target_info(model_dir.name, tokenizer, model.config), dev)

    @property
    def active_sessions(self) -> int:
        return len(self._caches)

    def forward(self, key: str, keep: int, token_ids: list[int], logits: bool = True) -> torch.Tensor | None:
        """Cuts session `key`'s cache to its first `keep` positions, runs `token_ids` after them and
        returns the logits of the new positions.  # [len(token_ids), vocab] float32 on CPU

        A new key starts an empty cache. Raises ValueError when keep exceeds the cached positions.
        """
        return self.forward_many([Forward(key, keep, tuple(token_ids), logits)])[0]

    @torch.inference_mode()
    def forward_many(self, forwards: Sequence[Forward]) -> list[torch.Tensor | None]:
        """Runs the forwards of different sessions as one batch: ragged lengths, per-row positions,
        each session's own cache. Returns each one's logits as `forward` does.

        Raises ValueError when a key repeats or a keep exceeds its session's cached positions.
        """
        if len({f.key for f in forwards}) != len(forwards):
            raise ValueError("one forward per session in a batch")
        caches = [self._cut(f.key, f.keep) for f in forwards]
        live = [(f, c) for f, c in zip(forwards, caches, strict=True) if f.token_ids]
        # Rounds batch; a prefill (long, no logits) or an empty cache runs alone.
        batch = [(f, c) for f, c in live if f.logits and c.length and _batchable(c.kv)]
        if len(batch) < 2:
            batch = []
        batched = {f.key for f, _ in batch}
        alone = [(f, c) for f, c in live if f.key not in batched]
        by_key = {f.key: self._run_one(f, c) for f, c in alone}
        if batch:
            by_key.update(zip((f.key for f, _ in batch), self._run_batch(batch), strict=True))
        empty = torch.empty(0, self.info.vocabulary.size)
        return [by_key.get(f.key, empty) if f.logits else None for f in forwards]

    def _cut(self, key: str, keep: int) -> _Cache:
        cache = self._caches.get(key)
        if cache is None:
            cache = self._caches[key] = _Cache(new_cache(self.model.config))
        if keep > cache.length:
            raise ValueError(f"session {key} holds {cache.length} positions, cannot keep {keep}")
        if keep < cache.length:
            cache.kv.crop(keep - cache.length)  # a negative count removes that many positions
            cache.length = keep
        return cache

    def _run_one(self, f: Forward, cache: _Cache) -> torch.Tensor | None:
        ids = torch.tensor([f.token_ids], device=self.device)
        out = self.model(
            input_ids=ids, past_key_values=cache.kv, use_cache=True, logits_to_keep=0 if f.logits else 1
        )
        cache.length += len(f.token_ids)
        return out.logits[0, :, : self.info.vocabulary.size].float().cpu() if f.logits else None

    def _run_batch(self, live: list[tuple[Forward, _Cache]]) -> list[torch.Tensor | None]:
        # Each row: its session's past, left-padded to the longest past, then its new tokens,
        # right-padded to the longest. The mask hides both paddings; positions come per row.
        past = max(c.length for _, c in live)
        width = max(len(f.token_ids) for f, _ in live)
        rows = len(live)
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, past + width, dtype=torch.long)
        positions = torch.zeros(rows, width, dtype=torch.long)
        for r, (f, c) in enumerate(live):
            ids[r, : len(f.token_ids)] = torch.tensor(f.token_ids)
            mask[r, past - c.length : past + len(f.token_ids)] = 1
            positions[r] = c.length + torch.arange(width)
        # One copy of each session's cache into the batch's buffers, which leave room for the new
        # positions; the model writes those in place, and only they are copied back.
        batch_kv = DynamicCache(config=self.model.config)
        layers = []
        for layer in range(len(live[0][1].kv.layers)):
            keys, values = self._batch_buffers(layer, live[0][1].kv.layers[layer].keys, rows, past + width)
            for r, (_, c) in enumerate(live):
                session_layer = c.kv.layers[layer]
                keys[r, :, past - c.length : past] = session_layer.keys[0]
                values[r, :, past - c.length : past] = session_layer.values[0]
            layers.append(GrowingLayer.holding(keys, values, past))
        batch_kv.layers = layers
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=batch_kv,
            use_cache=True,
        )
        results = []
        for r, (f, c) in enumerate(live):
            n = len(f.token_ids)
            for layer, batch_layer in enumerate(batch_kv.layers):
                new_keys = batch_layer.keys[r : r + 1, :, past : past + n]
                new_values = batch_layer.values[r : r + 1, :, past : past + n]
                c.kv.layers[layer].update(new_keys, new_values)
            c.length += n
            results.append(out.logits[r, :n, : self.info.vocabulary.size].float().cpu() if f.logits else None)
        return results

    def _batch_buffers(
        self, layer: int, like: torch.Tensor, rows: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [rows, kv_heads, length, head_dim] of the layer's workspace, grown when too small. The
        workspace starts zeroed and only ever holds keys and values, so padding the attention mask hides
        is finite (a NaN there would leak through the zero attention weight)."""
        while len(self._workspace) <= layer:
            self._workspace.append((like.new_zeros(0, 0, 0, 0), like.new_zeros(0, 0, 0, 0)))
        keys, values = self._workspace[layer]
        if keys.shape[0] < rows or keys.shape[2] < length:
            grown = max(length, min(2 * keys.shape[2], self.info.max_context))
            shape = (max(rows, keys.shape[0]), like.shape[1], grown, like.shape[3])
            keys, values = like.new_zeros(shape), like.new_zeros(shape)
            self._workspace[layer] = (keys, values)
        return keys[:rows, :, :length], values[:rows, :, :length]

    def release(self, key: str) -> None:
        """Frees session `key`'s cache; unknown keys are ignored."""
        self._caches.pop(key, None)


def _batchable(kv: DynamicCache) -> bool:
    # Sliding-window or otherwise special layers keep their own bookkeeping: run those one at a time.
    return all(type(layer) is GrowingLayer and layer.is_initialized for layer in kv.layers)


def target_info(target_id: str, tokenizer, config) -> TargetInfo:
    """What the verifier tells edges about the target, read from its tokenizer and config."""
    vocabulary = vocabulary_of(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    eos = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    return TargetInfo(
        target_id=target_id,
        vocabulary=vocabulary,
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        chat_template=tokenizer.chat_template or "",
    )
