"""The target engine: a transformers causal LM that keeps one KV cache per session.

A session's cache holds every committed position but the last committed token; a forward first cuts
the cache back to the positions the caller keeps, then runs the new tokens on top of it, so a round
costs gamma + 1 positions and never recomputes the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

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
        cache = self._caches.setdefault(key, _Cache(DynamicCache(config=self.model.config)))
        if keep > cache.length:
            raise ValueError(f"session {key} holds {cache.length} positions, cannot keep {keep}")
        if keep < cache.length:
            cache.kv.crop(keep - cache.length)  # a negative count removes that many positions
            cache.length = keep
        if not token_ids:
            return torch.empty(0, self.info.vocabulary.size) if logits else None
        ids = torch.tensor([token_ids], device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, past_key_values=cache.kv, use_cache=True, logits_to_keep=0 if logits else 1
            )
        cache.length += len(token_ids)
        if not logits:
            return None
        return out.logits[0, :, : self.info.vocabulary.size].float().cpu()

    def release(self, key: str) -> None:
        """Frees session `key`'s cache; unknown keys are ignored."""
        self._caches.pop(key, None)


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
