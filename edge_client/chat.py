"""The terminal chat: reads a turn, streams the reply as rounds are committed, then shows the figures."""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from draftwire.contract import SamplingParams
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats


@dataclass(frozen=True)
class ChatConfig:
    gamma: int | None = None  # draft tokens per round; None: chosen online (edge_client.adaptive)
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    pipeline: int | None = None  # proposals sent ahead of their verdicts; None: chosen online
    ignore_eos: bool = False  # reply until max_new_tokens whatever the target says


def render_chat(template: str, messages: list[dict[str, str]], bos: str, eos: str) -> str:
    """Formats the conversation with the target tokenizer's chat template (Jinja, as transformers
    renders it), ending with the prompt for the assistant's turn."""
    # Sandboxed: the template comes from the server, and is code.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


def _raise(message: str):
    raise jinja2.TemplateError(message)


async def reply(
    session: EdgeSession, messages: list[dict[str, str]], config: ChatConfig, out: TextIO
) -> tuple[str, GenerationStats]:
    """Streams one assistant reply to `out`; returns its text and figures."""
    info = await session.model_info()
    drafter = session.drafter
    prompt = chat_prompt(info, drafter, messages)
    request = GenerationRequest(
        tuple(prompt),
        config.sampling,
        config.max_new_tokens,
        config.gamma,
        ignore_eos=config.ignore_eos,
        pipeline=config.pipeline,
    )
    stats = GenerationStats()
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    eos_ids = set(info.target.eos_token_ids)
    parts = []
    async for tokens in session.generate(request, stats):
        piece = decoder.decode(drafter.detokenize([t for t in tokens if t not in eos_ids]))
        parts.append(piece)
        out.write(piece)
        out.flush()
    parts.append(decoder.decode(b"", final=True))
    out.write(parts[-1] + "\n")
    return "".join(parts), stats


def chat_prompt(info, drafter, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of the conversation: the target's chat template when it has one (carried by
    ModelInfo), else the last message as a plain completion prompt."""
    target = info.target
    if not target.chat_template:
        return drafter.tokenize(messages[-1]["content"])
    bos = special_piece(drafter, target.bos_token_id)
    eos = special_piece(drafter, target.eos_token_ids[0] if target.eos_token_ids else None)
    text = render_chat(target.chat_template, messages, bos, eos)
    return drafter.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def summary(stats: GenerationStats) -> str:
    speed = stats.generated_tokens / stats.wall_s if stats.wall_s else 0.0
    return (
        f"[{stats.generated_tokens} tokens in {stats.rounds} rounds, acceptance {stats.acceptance_rate:.0%}, "
        f"{stats.tokens_per_round:.2f} tokens/round, {speed:.1f} tokens/s]"
    )


async def chat(
    session: EdgeSession,
    config: ChatConfig,
    out: TextIO,
    read_line: Callable[[str], str] = input,
    once: str | None = None,
) -> None:
    """The chat loop; `once` answers that one message and returns. Ends on EOF or an empty line."""
    info = await session.model_info()
    mode = "chat template" if info.target.chat_template else "plain completion"
    out.write(f"draftwire chat with {info.target.target_id} ({mode}); an empty line or Ctrl-D ends.\n")
    messages: list[dict[str, str]] = []
    while True:
        if once is not None:
            line = once
        else:
            try:
                line = await asyncio.to_thread(read_line, "you> ")
            except EOFError:
                break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        out.write("draftwire> ")
        text, stats = await reply(session, messages, config, out)
        messages.append({"role": "assistant", "content": text})
        out.write(summary(stats) + "\n")
        if once is not None:
            break


def special_piece(drafter, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return drafter.llm.detokenize([token_id], special=True).decode("utf-8", "replace")
