"""The edge app's replies, from a parsed request: admitted (one generates, `max_waiting` wait), the prompt
built (a chat template's, or the text's tokens) and budgeted against the context, the reply generated
under the one lock, and answered whole or streamed (edge_client.replies).

One reply is generated at a time (the device has one draft model); other requests wait their turn.
A conversation's next turn extends the token ids of its last one (`Contexts`), so the verifier's kept
cache and the draft's llama.cpp cache both cover the history and only the new turn is computed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from aiohttp import web

from draftwire.contract import Constraint, Drafting
from edge_client.chat import special_piece
from edge_client.config import EdgeConfig
from edge_client.contexts import Contexts
from edge_client.link import VerifierLink
from edge_client.metrics import EdgeMetrics
from edge_client.openai_api import ApiError, BadRequest, CompletionRequest, Settings
from edge_client.planner import GenerationStats
from edge_client.replies import Outcome, Reply, TextStream
from edge_client.responses import ResponseShape, logprob_entry
from edge_client.session import GenerationRequest, logit_bias_refusal
from edge_client.structured import Tools, template_messages
from edge_client.template import TemplateRefused, TemplateRenderer


class Replier:
    """Generates the app's replies, one at a time, over the verifier `link`."""

    def __init__(self, config: EdgeConfig, drafter, link: VerifierLink, metrics: EdgeMetrics):
        self.config = config
        self.drafter = drafter
        self.link = link
        self.metrics = metrics
        self.contexts = Contexts(drafter)
        self.renderer = TemplateRenderer(config.template_time_s)
        self.lock = asyncio.Lock()
        self.waiting = 0  # generations admitted and not finished (one runs, the rest wait for the lock)
        self._token_bytes: int | None = None  # the longest token's bytes: a text's fewest tokens

    def close(self) -> None:
        self.renderer.close()

    def _context(self, info) -> int:
        """The longest sequence (prompt and reply) both the target and the draft can hold."""
        limit = info.target.max_context
        if self.config.drafting is Drafting.EDGE and getattr(self.drafter, "n_ctx", None):
            limit = min(limit, self.drafter.n_ctx)
        return limit

    def check_model(self, model: str | None, info) -> None:
        names = (info.target.target_id, *self.config.model_aliases)
        if model is not None and model not in names:
            raise ApiError(
                404,
                f"the model {model!r} does not exist here; this edge serves {info.target.target_id!r}",
                param="model",
                code="model_not_found",
            )

    async def _too_long(self, text_bytes: int, info, param: str) -> None:
        """Refuses, before tokenizing it, a text that cannot fit the context whatever its tokens (each
        token is at most the vocabulary's longest): a 1 MiB prompt gets its 400 at once."""
        if self._token_bytes is None:
            self._token_bytes = await asyncio.to_thread(longest_token, self.drafter.llm)
        limit = self._context(info)
        if text_bytes > limit * self._token_bytes:
            raise BadRequest(
                f"the prompt is at least {text_bytes // self._token_bytes} tokens; the context holds {limit} "
                "(prompt and reply)",
                param,
            )

    def budget(self, req: CompletionRequest, prompt: list[int], info, param: str) -> CompletionRequest:
        """Checks prompt + max_tokens against the context before anything is drafted: a prompt that does
        not fit is refused (400); a reply without a max_tokens of its own gets what the context leaves."""
        vocab = min(info.target.vocabulary.size, self.link.vocab_size() or info.target.vocabulary.size)
        if (refusal := logit_bias_refusal(req.settings, vocab)) is not None:
            raise BadRequest(refusal, "logit_bias")
        limit = self._context(info)
        if len(prompt) >= limit:
            raise BadRequest(
                f"the prompt is {len(prompt)} tokens; the context holds {limit} (prompt and reply)", param
            )
        settings = req.settings
        if settings.max_tokens + len(prompt) > limit:
            if req.max_tokens_given:
                raise BadRequest(
                    f"max_tokens {settings.max_tokens} and the prompt's {len(prompt)} tokens exceed "
                    f"the context of {limit}",
                    "max_tokens",
                )
            settings = replace(settings, max_tokens=limit - len(prompt))
        return replace(req, settings=settings)

    @contextlib.contextmanager
    def slot(self):
        """Admits one generation, or refuses it with 429 when `max_waiting` already wait."""
        if self.waiting > self.config.max_waiting:
            raise ApiError(
                429,
                f"{self.waiting} replies are running or waiting; try again shortly",
                code="too_many_requests",
                headers={"Retry-After": str(min(60, self.waiting))},
            )
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    async def text_prompt(self, text: str, info) -> list[int]:
        """A completion's prompt: its text's tokens, refused (400) before tokenizing where it cannot fit."""
        await self._too_long(len(text.encode("utf-8", "replace")), info, "prompt")
        return await asyncio.to_thread(self.drafter.tokenize, text)

    async def chat_prompt(
        self, messages: list[dict], hint: list[int] | None = None, tools: Tools | None = None
    ) -> list[int]:
        info = await self.link.info()
        target = info.target
        messages, offered = template_messages(messages, tools, target.chat_template)
        if not target.chat_template:
            last = messages[-1]["content"]
            await self._too_long(len(last.encode("utf-8", "replace")), info, "messages")
            return await asyncio.to_thread(self.drafter.tokenize, last)
        bos = special_piece(self.drafter, target.bos_token_id)
        eos = special_piece(self.drafter, target.eos_token_ids[0] if target.eos_token_ids else None)
        try:
            pieces = await self.renderer.render(target.chat_template, messages, bos, eos, offered)
        except TemplateRefused as e:  # it refuses the conversation (roles out of order), or ran past a limit
            raise BadRequest(str(e), "messages") from None
        text = "".join(p.text for p in pieces)
        await self._too_long(len(text.encode("utf-8", "replace")), await self.link.info(), "messages")
        return await asyncio.to_thread(self.contexts.prompt, pieces, hint)

    async def _reply(
        self, prompt: list[int], settings: Settings, outcome: Outcome, constraint: Constraint | None = None
    ) -> AsyncIterator[str]:
        """The reply's text as it is verified, cut at a stop string, under `constraint` when given;
        `outcome` is filled in as it goes (also when the reader stops early: the text so far, finish
        "cancelled"). One reply at a time."""
        async with self.lock:
            info = await self.link.info()
            request = GenerationRequest(
                tuple(prompt),
                replace(settings.sampling(), seed=outcome.seed),
                settings.max_tokens,
                self.config.gamma,
                pipeline=self.config.pipeline,
                drafting=self.config.drafting,
                top_logprobs=settings.logprobs,
                constraint=constraint,
            )
            text = TextStream(self.drafter, info.target.eos_token_ids, settings.stop)
            parts, logprobs = [], []
            try:
                generation = self.link.session.generate(request, outcome.stats, outcome.generated, logprobs)
                async with contextlib.aclosing(generation) as tokens:
                    async for new in tokens:
                        if settings.logprobs is not None:  # the text's tokens, end-of-sequence left out
                            outcome.logprobs += [
                                logprob_entry(self._piece_bytes, token, t)
                                for token, t in zip(new, logprobs[len(logprobs) - len(new) :], strict=True)
                                if token not in text.eos
                            ]
                        if piece := text.feed(new):
                            parts.append(piece)
                            yield piece
                        if text.stopped:
                            break
                if piece := text.end():
                    parts.append(piece)
                    yield piece
                generated = outcome.generated
                by_model = bool(generated) and generated[-1] in info.target.eos_token_ids
                length = len(generated) >= settings.max_tokens and not by_model
                outcome.finish_reason = "length" if length and not text.stopped else "stop"
            finally:
                outcome.text = "".join(parts)
                self.contexts.remember(prompt + outcome.generated)

    def _piece_bytes(self, token: int) -> bytes:
        return self.drafter.detokenize([token])

    async def respond(
        self,
        request: web.Request,
        req: CompletionRequest,
        prompt: list[int],
        chat: bool,
        on_done: Callable[[Outcome], None] | None = None,
        extra: dict | None = None,
    ) -> web.StreamResponse:
        """Generates the reply and answers with it: one JSON object, or server-sent events ending with
        `data: [DONE]`. A refusal of the open is answered as an error before any byte of a reply is sent;
        a failure mid-reply ends the stream with an error event and no [DONE]; a client that goes away
        cancels the session on the verifier. `on_done` gets the Outcome in every case."""
        shape = ResponseShape(chat, (await self.link.info()).target.target_id)
        await self.link.connected()
        seed = req.settings.sampling().seed
        outcome = Outcome("", "cancelled", prompt, [], GenerationStats(), seed)
        figures, logprobs = {**(extra or {}), "seed": seed}, req.settings.logprobs is not None
        reply = Reply(shape, outcome, figures, logprobs, tools=req.tools)
        run = self._reply(prompt, req.settings, outcome, req.constraint)
        try:
            async with contextlib.aclosing(run):
                first = await anext(run, None)  # a refusal of the open raises here
                if not req.stream:
                    async for _ in run:
                        pass
                    return reply.whole()
                return await reply.stream(request, run, first, req.include_usage)
        finally:
            self.metrics.reply(outcome)
            if on_done is not None and (outcome.generated or outcome.finish_reason != "cancelled"):
                on_done(outcome)


def longest_token(llm) -> int:
    """The bytes of the vocabulary's longest token."""
    return max(len(llm.detokenize([i], special=True)) for i in range(llm.n_vocab())) or 1
