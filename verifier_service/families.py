"""Which model families the verifier serves, and how it proves at load that it serves one right.

A target is a transformers causal LM run through the engine's own caches and attention
(verifier_service/engine.py). That reproduces a family's forward only where the family computes each
position from its token, its position id and the keys and values before it, through transformers'
attention interface. `FAMILIES` records, per `config.model_type`, what the matrix test
(tests/exact/test_families.py, a tiny random model of each family) found; docs/families.md is rendered from
it (`python -m tests.exact.test_families --write-docs`).

At load every target, of a listed family or not, is checked against its own forward
(`TargetEngine.check_conformance`) and, in bit-exact mode, for invariance (`check_invariance`); a
listed refusal is said before the weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedModel(ValueError):
    """The engine cannot serve this architecture right; one line that says why."""


EXACT, PLAIN, REFUSED = "exact", "plain", "refused"


@dataclass(frozen=True)
class Family:
    name: str  # as users know it
    state: str  # EXACT: served bit-exact; PLAIN: served only with --no-bit-exact; REFUSED at load
    note: str  # what the matrix checks for it, or why it is not served exactly


_ONE_LENGTH = "its forward asks the cache for one length, which a ragged batch has not"
_EXPERTS = "its experts' matrix products change with how many tokens a batch routes to each"

FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 2/3.x, SmolLM2", EXACT, "grouped-query attention; RoPE scaling llama3"),
    "mistral": Family("Mistral", EXACT, "sliding window"),
    "qwen2": Family("Qwen 2/2.5", EXACT, "biased q/k/v projections; RoPE scaling yarn"),
    "qwen3": Family("Qwen 3", EXACT, "q/k norms"),
    "gemma": Family("Gemma", EXACT, "tied embeddings, scaled embedding"),
    "gemma2": Family("Gemma 2", EXACT, "attention and final logit soft-capping, alternating sliding window"),
    "gemma3_text": Family("Gemma 3 (text)", EXACT, "sliding and full layers, q/k norms, soft-capping"),
    "gemma3n_text": Family("Gemma 3n (text)", EXACT, "layers that share other layers' keys and values"),
    "phi3": Family(
        "Phi-3/4", EXACT, "fused projections; longrope served up to its original context (context_limit)"
    ),
    "phi": Family("Phi-2", EXACT, "partial rotary, parallel attention and MLP"),
    "gpt2": Family("GPT-2", EXACT, "Conv1D projections, learned positions"),
    "gpt_neox": Family("GPT-NeoX, Pythia", EXACT, "partial rotary, parallel residual"),
    "starcoder2": Family("StarCoder 2", EXACT, "sliding window, biased projections"),
    "olmo2": Family("OLMo 2", EXACT, "q/k norms, norms after the blocks"),
    "olmo3": Family("OLMo 3", EXACT, "sliding window"),
    "granite": Family("Granite 3", EXACT, "embedding, attention and logit multipliers"),
    "cohere": Family("Command R", EXACT, "parallel block, logit scale"),
    "cohere2": Family("Command R7B", EXACT, "sliding window on 3 layers of 4"),
    "stablelm": Family("StableLM 2", EXACT, "partial rotary"),
    "smollm3": Family("SmolLM3", EXACT, "no RoPE on some layers"),
    "exaone4": Family("EXAONE 4", EXACT, "sliding window"),
    "glm4": Family("GLM-4", EXACT, "partial rotary, norms after the blocks"),
    "lfm2": Family("LFM2", EXACT, "short convolutions beside attention"),
    "apertus": Family("Apertus", EXACT, "xIELU activation, q/k norms"),
    "seed_oss": Family("Seed-OSS", EXACT, "biased projections"),
    "ernie4_5": Family("ERNIE 4.5 (dense)", EXACT, "interleaved rotary"),
    "mixtral": Family("Mixtral", PLAIN, _EXPERTS),
    "qwen3_moe": Family("Qwen 3 MoE", PLAIN, _EXPERTS),
    "falcon": Family("Falcon", REFUSED, _ONE_LENGTH),
    "gptj": Family("GPT-J", REFUSED, _ONE_LENGTH),
    "opt": Family("OPT", REFUSED, _ONE_LENGTH),
    "bloom": Family("BLOOM", REFUSED, "ALiBi built from the attention mask, which the engine does not pass"),
    "llama4_text": Family("Llama 4 (text)", REFUSED, "chunked attention"),
    "gpt_oss": Family("gpt-oss", REFUSED, "attention sinks"),
    "qwen3_next": Family("Qwen3-Next", REFUSED, "linear-attention layers keep a recurrent state"),
    "mamba": Family("Mamba", REFUSED, "recurrent state, not a key/value cache that rounds can cut back"),
}


def refusal(model_type: str) -> str | None:
    """Why the verifier refuses a family before loading it (None: not refused; an unlisted family is
    loaded and then proven or refused by the checks at load)."""
    family = FAMILIES.get(model_type)
    if family is None or family.state != REFUSED:
        return None
    return f"the verifier cannot serve {family.name} ({model_type}) models: {family.note} (docs/families.md)"


# The most a logit may differ from the model's own forward, relative to the logits' largest magnitude,
# per dtype. The engine and the model's eager path run the same weights and differ only in how attention
# is summed, which in float32 moves logits by about 1e-7 of their range on every listed family (the
# matrix test); a family the engine does not reproduce is off by 1e-2 and more.
TOLERANCE: dict[str, float] = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-3}


def relative_error(ours: torch.Tensor, own: torch.Tensor) -> float:
    """max |ours - own| over max(1, max |own|)."""
    return float((ours - own).abs().max() / own.abs().max().clamp(min=1.0))


def context_limit(config) -> int:
    """The longest context the target is served with: its `max_position_embeddings`, cut to the
    original context for RoPE types whose frequencies follow the longest position in the forward
    (longrope, dynamic). Past that point their frequencies would change with what else shares a
    batch, and keys cached before it would have been rotated differently."""
    limit = int(getattr(config, "max_position_embeddings", None) or 2048)
    rope = getattr(config, "rope_parameters", None) or {}
    for params in rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]:
        if params.get("rope_type") in ("longrope", "dynamic"):
            limit = min(limit, int(params.get("original_max_position_embeddings") or limit))
    return limit
