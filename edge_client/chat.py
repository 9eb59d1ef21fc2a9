"""The terminal chat: reads a turn, streams the reply as rounds are committed, then shows the figures."""

from __future__ import annotations

import asyncio
import codecs
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from draftwire.contract import SamplingParams
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats
from edge_client.template import Piece, TemplateRenderer, output_limit, render_pieces


@dataclass(frozen=True)
class ChatConfig:
    gamma: int | None = None  # draft tokens per round; None: chosen online (edge_client.adaptive)
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    pipeline: int | None = None  # proposals sent ahead of their verdicts; None: chosen online
    ignore_eos: bool = False  # reply until max_new_tokens whatever the target says


def render_chat(template: str, messages: list[dict[str, str]], bos: str, eos: str) -> str:
    """Formats the conversation with the target tokenizer's chat template (Jinja, as transformers
    renders it), ending with the prompt for the assistant's turn. In this process, sandboxed and under an
    output limit; `TemplateRenderer` adds the time and memory limits."""
    return "".join(p.text for p in render_pieces(template, messages, bos, eos, output_limit(messages)))


_renderer: TemplateRenderer | None = None


def renderer() -> TemplateRenderer:
    """The process's template renderer (its worker starts at the first render)."""
    global _renderer
    if _renderer is None:
        _renderer = TemplateRenderer()
    return _renderer


def tokenize_pieces(drafter, pieces: list[Piece]) -> list[int]:
    """The template's pieces with their special tokens, the messages' contents as plain text: a user who
    types `<|im_end|>` gets those characters, not the control token."""
    ids: list[int] = []
    for piece in pieces:
        if piece.text:
            ids += drafter.llm.tokenize(piece.text.encode("utf-8"), add_bos=False, special=not piece.content)
    return ids


async def reply(
    session: EdgeSession, messages: list[dict[str, str]], config: ChatConfig, out: TextIO
) -> tuple[str, GenerationStats]:
    """Streams one assistant reply to `out`; returns its text and figures."""
    info = await session.model_info()
    drafter = session.drafter
    prompt = await chat_prompt_async(info, drafter, messages)
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
    ModelInfo), else the last message as a plain completion prompt. Raises TemplateRefused."""
    return asyncio.run(chat_prompt_async(info, drafter, messages))


async def chat_prompt_async(info, drafter, messages: list[dict[str, str]]) -> list[int]:
    target = info.target
    if not target.chat_template:
        return drafter.tokenize(messages[-1]["content"])
    bos = special_piece(drafter, target.bos_token_id)
    eos = special_piece(drafter, target.eos_token_ids[0] if target.eos_token_ids else None)
    pieces = await renderer().render(target.chat_template, messages, bos, eos)
    return tokenize_pieces(drafter, pieces)


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
    """The chat loop; `once` answers that one message and returns. Ends on EOF, an empty line or Ctrl-C at
    the prompt; Ctrl-C during a reply stops the reply (what was shown is kept in the conversation) and
    returns to the prompt, as llama-cli and ollama do."""
    info = await session.model_info()
    mode = "chat template" if info.target.chat_template else "plain completion"
    out.write(
        f"draftwire chat with {info.target.target_id} ({mode}); an empty line, Ctrl-D or Ctrl-C ends, "
        "Ctrl-C during a reply stops it.\n"
    )
    loop = asyncio.get_running_loop()
    messages: list[dict[str, str]] = []
    with _Interrupts(loop) as interrupts:
        while True:
            if once is not None:
                line = once
            else:
                try:
                    out.flush()
                    line = await interrupts.around(_read_line(loop, read_line, "you> "))
                except (EOFError, _Interrupted):
                    out.write("\n")
                    break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            out.write("draftwire> ")
            shown = _Shown(out)
            try:
                text, stats = await interrupts.around(reply(session, messages, config, shown))
            except _Interrupted:  # stopped: the conversation keeps what was shown
                out.write("\n[stopped]\n")
                messages.append({"role": "assistant", "content": shown.text()})
            else:
                messages.append({"role": "assistant", "content": text})
                out.write(summary(stats) + "\n")
            if once is not None:
                break


class _Shown:
    """`out`, keeping what was written to it."""

    def __init__(self, out: TextIO):
        self.out, self.parts = out, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def text(self) -> str:
        return "".join(self.parts)


class _Interrupted(Exception):
    """Ctrl-C stopped what the chat was waiting for (a reply, or the next line)."""


class _Interrupts:
    """Ctrl-C for the whole chat, where the loop can take signals: it cancels what the chat awaits now
    (`around`): the reply under way, which stops it, or the prompt's read, which ends the chat. One
    handler from start to end: none of a terminal's Ctrl-C falls between two (Python's default would then
    raise KeyboardInterrupt wherever the chat was), and the line is read on a thread of its own, so that
    a Ctrl-C at the prompt is not left pending in whichever thread took it until Enter."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.current, self.installed = loop, None, False

    def __enter__(self) -> _Interrupts:
        try:
            self.loop.add_signal_handler(signal.SIGINT, self._interrupt)
            self.installed = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:
            self.loop.remove_signal_handler(signal.SIGINT)

    def _interrupt(self) -> None:
        if self.current is not None:
            self.current.cancel()

    async def around(self, awaitable):
        """Awaits it; raises _Interrupted when Ctrl-C cancelled it."""
        task = self.current = asyncio.ensure_future(awaitable)
        try:
            return await task
        except asyncio.CancelledError:
            if not task.cancelled():  # the chat itself is being cancelled
                raise
            raise _Interrupted from None
        finally:
            self.current = None


async def _read_line(loop: asyncio.AbstractEventLoop, read_line: Callable[[str], str], prompt: str) -> str:
    """read_line(prompt) on a daemon thread: a read that Ctrl-C abandons does not hold the exit."""
    done: asyncio.Future = loop.create_future()

    def settle(outcome, error) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(outcome)

    def run() -> None:
        try:
            line = read_line(prompt)
        except KeyboardInterrupt:  # a read_line that says Ctrl-C so (asyncio re-raises the real one)
            loop.call_soon_threadsafe(settle, None, _Interrupted())
        except BaseException as e:  # EOFError: Ctrl-D
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, line, None)

    threading.Thread(target=run, name="chat-input", daemon=True).start()
    return await done


def special_piece(drafter, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return drafter.llm.detokenize([token_id], special=True).decode("utf-8", "replace")
