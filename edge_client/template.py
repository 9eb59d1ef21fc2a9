"""The target's chat template, rendered safely: it comes from the verifier (or anyone between it and the
device, on a plaintext channel) and is code, so it runs in a sandbox (Jinja's), in a separate worker
process with a memory limit, under a time limit and an output limit; a template past them is an error
(`TemplateRefused`), and the worker is replaced.

The rendered prompt comes back as pieces: the template's own text, whose special tokens (`<|im_start|>`
...) are parsed as such, and each message's content, tokenized as plain text, so that a user who types
`<|im_end|>` gets those characters, never the control token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import multiprocessing
import re
import secrets
import sys
from dataclasses import dataclass

from draftwire.aio import within

TIME_LIMIT_S = 2.0  # a chat template renders in milliseconds
MEMORY_LIMIT = 1 << 30  # address space of the worker process
MIN_OUTPUT_LIMIT = 1 << 16  # characters: the template's own text on top of the messages'


class TemplateRefused(Exception):
    """The template failed, refused the messages, or went past a limit; the message says which."""


@dataclass(frozen=True)
class Piece:
    text: str
    content: bool  # a message's content: tokenized as text, special tokens not parsed


def output_limit(messages: list[dict[str, str]], tools: list | tuple = ()) -> int:
    calls = sum(len(repr(m.get("tool_calls", ""))) for m in messages) + len(repr(tools))
    return MIN_OUTPUT_LIMIT + 2 * (sum(len(m["content"]) + len(m["role"]) for m in messages) + calls)


def render_pieces(
    template: str,
    messages: list[dict[str, str]],
    bos: str,
    eos: str,
    limit: int | None = None,
    tools: list | tuple = (),
) -> list[Piece]:
    """Renders in this process (the worker's function; `TemplateRenderer` calls it in the worker).

    The messages' contents are replaced by unguessable markers, so the rendered text splits into the
    template's pieces and the contents. A template that changes the content (trims it, say) is then
    rendered with the real contents too and the split kept only where the markers' text matches it."""
    import jinja2

    limit = limit if limit is not None else output_limit(messages, tools)
    nonce = secrets.token_hex(8)
    marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    # An empty content (an assistant turn of tool calls alone) stays empty: templates test it.
    marked = [{**m, "content": mark if m["content"] else ""} for m, mark in zip(messages, marks, strict=True)]
    try:
        text = _render(template, marked, bos, eos, limit, tools)
        real = _render(template, messages, bos, eos, limit, tools)
    except TemplateRefused:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        raise TemplateRefused(f"the chat template refuses these messages: {e}") from None
    except RecursionError:
        raise TemplateRefused("the chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateRefused("the chat template needed more than its memory limit") from None
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)  # template, index, template, ...
    indices = [int(i) for i in parts[1::2]]
    if len(set(indices)) != len(indices):
        raise TemplateRefused("the chat template repeats a message's content")
    pieces = [Piece(parts[0], False)]
    for i, after in zip(indices, parts[2::2], strict=True):
        pieces += [Piece(messages[i]["content"], True), Piece(after, False)]
    if "".join(p.text for p in pieces) != real:  # the template transforms the content: try it trimmed
        trimmed = [Piece(p.text.strip(), True) if p.content else p for p in pieces]
        if "".join(p.text for p in trimmed) == real:
            pieces = trimmed
    return [p for p in pieces if p.text]


def _render(template: str, messages, bos: str, eos: str, limit: int, tools: list | tuple = ()) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    out, size = [], 0
    # `tools` only when there are some: templates test `tools is defined`, or `tools` for truth.
    extra = {"tools": list(tools)} if tools else {}
    for chunk in env.from_string(template).generate(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos, **extra
    ):
        size += len(chunk)
        if size > limit:
            raise TemplateRefused(f"the chat template's output passed its limit of {limit} characters")
        out.append(chunk)
    return "".join(out)


def _raise(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


@contextlib.contextmanager
def _without_main():
    """Hides the __main__ module's file and spec while the worker is spawned: spawn would run that file
    again in the worker (a script, `python -` from stdin, a notebook), which it must not and at times
    cannot."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _started() -> bool:
    import jinja2.sandbox  # noqa: F401  (imported before the first render's clock starts)

    return True


def _worker_init() -> None:
    """The worker's start: its memory limit, and Ctrl-C left to the parent. A terminal's Ctrl-C goes to
    every process in its foreground group, the worker too; the parent stops the reply, and the worker
    must not die of it (it would print a KeyboardInterrupt and break the pool)."""
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked since its spawn (_spawning)
    _die_with_parent()


def _die_with_parent(every_s: float = 0.5) -> None:
    """Exits the worker once its parent (the edge) is gone, however it went (SIGKILL included): a
    thread watches for the worker being handed to another parent. The resource tracker, whose pipe the
    worker holds too, then sees it close and exits as well (no orphans, issue 55)."""
    import os
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@contextlib.contextmanager
def _spawning():
    """SIGINT blocked on this thread while a worker may be spawned, so that the worker starts with it
    blocked (the mask is inherited), until `_worker_init` ignores it: a Ctrl-C during the start waits
    here, and goes to the parent alone."""
    import multiprocessing.resource_tracker
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # Started first: its own start unblocks SIGINT on this thread when it is done.
    multiprocessing.resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class TemplateRenderer:
    """Renders in one worker process (spawned on first use), killed and replaced when a render runs past
    `time_limit_s`; a worker found dead before a render (killed from outside) is replaced too."""

    def __init__(self, time_limit_s: float = TIME_LIMIT_S):
        self.time_limit_s = time_limit_s
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warm = False

    async def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        """The worker, started (the time limit counts the render only, not the start)."""
        pool = self._pool
        if pool is None:
            pool = self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
            )
            self._warm = False
        if not self._warm:
            with _without_main(), _spawning():  # the worker starts here, needing nothing of __main__
                started = asyncio.get_running_loop().run_in_executor(pool, _started)
            await within(started, 60)
            self._warm = True
        return pool

    async def render(
        self, template: str, messages: list[dict[str, str]], bos: str, eos: str, tools: list | tuple = ()
    ) -> list[Piece]:
        """`tools`: OpenAI's tool objects, for a template that renders them (edge_client/structured.py)."""
        loop = asyncio.get_running_loop()
        render = functools.partial(render_pieces, template, messages, bos, eos, None, tuple(tools))
        try:
            future = loop.run_in_executor(await self._executor(), render)
        except concurrent.futures.process.BrokenProcessPool:  # the worker died while idle: a new one
            self._kill()
            future = loop.run_in_executor(await self._executor(), render)
        try:
            return await within(future, self.time_limit_s)
        except TimeoutError:
            self._kill()
            raise TemplateRefused(
                f"the chat template did not render within its limit of {self.time_limit_s:g} s"
            ) from None
        except concurrent.futures.process.BrokenProcessPool:
            self._kill()
            raise TemplateRefused("the chat template's renderer died (past its memory limit?)") from None
        except MemoryError:
            raise TemplateRefused("the chat template needed more than its memory limit") from None

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):  # a running render is not cancellable
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._kill()
