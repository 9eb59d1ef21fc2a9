"""The independent reference the exactness tests compare with: transformers' own greedy `generate` on
the target, in float32, with nothing of the verifier's (no engine, no rules, no caches of ours)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def transformers_greedy(
    target: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy continuation: up to `max_new_tokens`, the end of sequence included where it
    comes first (as a session stops there). The model is freed before returning."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    config = model.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    del model
    gc.collect()
    return outputs
