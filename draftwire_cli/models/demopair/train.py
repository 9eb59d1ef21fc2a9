"""Training of the demo pair: the target on code and chat windows, then the draft distilled from it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class Shape:
    hidden: int  # model width
    layers: int  # decoder blocks
    heads: int  # attention heads (head dim = hidden / heads)
    kv_heads: int  # key/value heads (grouped-query attention)
    intermediate: int  # MLP width
    tie_embeddings: bool  # share the input embedding with the output head


@dataclass(frozen=True)
class TrainConfig:
    steps: int  # optimizer steps
    batch: int = 16  # windows per step
    seq_len: int = 256  # tokens per window
    lr: float = 2e-3  # peak learning rate, after a linear warmup, then cosine to a tenth
    warmup: int = 100  # warmup steps
    chat_share: float = 0.2  # share of windows taken from the chat form
    generated_share: float = 0.0  # share taken from the target's own greedy continuations
    seed: int = 0


@dataclass
class TokenData:
    """Token streams to draw training windows from."""

    code: torch.Tensor  # [n] every training file, EOS-separated
    chat: torch.Tensor  # [m] every chat conversation, back to back
    chat_starts: torch.Tensor  # [k] offsets where a conversation starts
    generated: torch.Tensor | None = None  # [rows, seq_len + 1] prompts continued by the target

    def batch(self, config: TrainConfig, generator: torch.Generator) -> torch.Tensor:
        """[batch, seq_len + 1] windows, chat ones starting at a conversation."""
        n = config.seq_len + 1
        rows = []
        for _ in range(config.batch):
            draw = float(torch.rand((), generator=generator))
            if self.generated is not None and draw < config.generated_share:
                rows.append(self.generated[int(torch.randint(len(self.generated), (), generator=generator))])
            elif draw < config.generated_share + config.chat_share:
                starts = self.chat_starts[self.chat_starts < len(self.chat) - n]
                start = int(starts[torch.randint(len(starts), (), generator=generator)])
                rows.append(self.chat[start : start + n])
            else:
                start = int(torch.randint(len(self.code) - n, (), generator=generator))
                rows.append(self.code[start : start + n])
        return torch.stack(rows)


def make_model(
    shape: Shape, vocab_size: int, max_positions: int, special: dict[str, int]
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=shape.tie_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        **special,
    )
    return LlamaForCausalLM(config)


def compute_per_token(model: LlamaForCausalLM) -> int:
    """Multiply-adds per generated token in the matrices (embedding lookup excluded, output head
    included): the cost that grows with the model, for the draft-to-target ratio."""
    total = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if model.config.tie_word_embeddings:
        total += model.lm_head.weight.numel()
    return total


def _lr(step: int, config: TrainConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(
    model: torch.nn.Module,
    data: TokenData,
    config: TrainConfig,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    log: Callable[[str], None],
    name: str,
) -> dict:
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    start, recent = time.perf_counter(), []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, config)
        window = data.batch(config, generator)
        # bfloat16 autocast: the CPU's matrix units run it an order of magnitude faster than float32.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=window[:, :-1]).logits
        loss = loss_fn(logits.float(), window)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == config.steps:
            elapsed = time.perf_counter() - start
            mean = sum(recent) / len(recent)
            log(f"{name} step {step + 1}/{config.steps} loss {mean:.3f} ({elapsed:.0f} s)")
            recent = []
    model.eval()
    return {"steps": config.steps, "seconds": time.perf_counter() - start, "final_loss": float(loss)}


def train_target(model: LlamaForCausalLM, data: TokenData, config: TrainConfig, log=print) -> dict:
    """Next-token cross-entropy on code and chat windows."""

    def loss_fn(logits: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())

    return _train(model, data, config, loss_fn, log, "target")


def distill_draft(
    draft: LlamaForCausalLM, target: LlamaForCausalLM, data: TokenData, config: TrainConfig, log=print
) -> dict:
    """The draft learns the target's next-token distribution (forward KL) on the same windows."""
    target.eval()

    def loss_fn(logits: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher = target(input_ids=window[:, :-1]).logits.float()
        return F.kl_div(
            F.log_softmax(logits, -1).flatten(0, 1),
            F.log_softmax(teacher, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )

    return _train(draft, data, config, loss_fn, log, "draft")


def target_continuations(
    target: LlamaForCausalLM, data: TokenData, rows: int, length: int, prompt: int, seed: int, log=print
) -> torch.Tensor:
    """[rows, length] code windows whose last `length - prompt` tokens the target wrote greedily: the
    contexts a draft meets in greedy speculation, where the prefix is the target's own output."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for first in range(0, rows, 64):
        n = min(64, rows - first)
        starts = torch.randint(len(data.code) - prompt, (n,), generator=generator)
        prompts = torch.stack([data.code[s : s + prompt] for s in starts.tolist()])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            sequences = target.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=False,
                max_new_tokens=length - prompt,
                min_new_tokens=length - prompt,
                pad_token_id=target.config.pad_token_id,
            )
        out.append(sequences[:, :length])
        log(f"target continuations: {first + n}/{rows}")
    return torch.cat(out)
