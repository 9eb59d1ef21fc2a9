"""The target engine: a transformers causal LM that keeps one KV cache per session.

A session's cache holds every committed position but the last committed token; a forward first cuts
the cache back to the positions the caller keeps, then runs the new tokens on top of it, so a round
costs gamma + 1 positions and never recomputes the prefix.
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
        cache = self._caches.setdefault(key, _Cache(DynamicCache(config=self.model.config)))
        if keep > cache.length:
            raise ValueError(f"session {key} holds {cache.length} positions, cannot keep {keep}")
        if keep < cache.length:
            cache.kv.crop(keep - cache.length)  # a negative count removes that many positions
            cache.length = keep
        return cache

    def _run_one(self, f: Forward, cache: _Cache) -> torch.Tensor | None:
        ids = torch.tensor([f.token_ids], device=self.device)
        with torch.inference_mode():
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
        batch_kv = DynamicCache(config=self.model.config)
        if past:
            for layer in range(len(live[0][1].kv.layers)):
                keys = [_left_pad(c.kv.layers[layer].keys, past) for _, c in live]
                values = [_left_pad(c.kv.layers[layer].values, past) for _, c in live]
                batch_kv.update(torch.cat(keys), torch.cat(values), layer)
        with torch.inference_mode():
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
                c.kv.update(new_keys.clone(), new_values.clone(), layer)
            c.length += n
            results.append(out.logits[r, :n, : self.info.vocabulary.size].float().cpu() if f.logits else None)
        return results

    def release(self, key: str) -> None:
        """Frees session `key`'s cache; unknown keys are ignored."""
        self._caches.pop(key, None)


def _batchable(kv: DynamicCache) -> bool:
    # Sliding-window or otherwise special layers keep their own bookkeeping: run those one at a time.
    return all(type(layer) is DynamicLayer and layer.is_initialized for layer in kv.layers)


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """[1, heads, n, dim] -> [1, heads, length, dim], zeros first."""
    return torch.nn.functional.pad(t, (0, 0, length - t.shape[2], 0))


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
