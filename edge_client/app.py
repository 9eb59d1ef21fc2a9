"""`draftwire edge`: the device's local HTTP server (aiohttp). It holds one drafter and one gRPC channel
to the verifier and serves an OpenAI-compatible API (server-sent events when streaming), the web chat page
at `/`, and the conversations kept in SQLite (`edge_client.store`).

One reply is generated at a time (the device has one draft model); other requests wait their turn.
A conversation's next turn extends the token ids of its last one (`Contexts`), so the verifier's kept
cache and the draft's llama.cpp cache both cover the history and only the new turn is computed.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from draftwire import jsonout, wire
from draftwire.aio import within
from draftwire.contract import Constraint, Drafting
from edge_client import guard as guards
from edge_client import httpkit
from edge_client.chat import special_piece
from edge_client.contexts import Contexts
from edge_client.openai_api import (
    HTTP_STATUS,
    ApiError,
    BadRequest,
    CompletionRequest,
    ResponseShape,
    Settings,
    StopCutter,
    error_body,
    logprob_entry,
    parse_chat,
    parse_completion,
    parse_settings,
    timings,
    usage,
)
from edge_client.planner import GenerationStats
from edge_client.session import EdgeSession, GenerationRequest, Timeouts, VerifierError, logit_bias_refusal
from edge_client.store import NotFound, Store
from edge_client.structured import Tools, held_back, split_tool_calls, template_messages
from edge_client.template import TemplateRefused, TemplateRenderer
from edge_client.trust import UntrustedVerifier, check_model_info

log = logging.getLogger(__name__)
WEB = Path(__file__).parent / "web"
# A reply that has shown nothing: the verifier connected, and the session opened, within this (else 503).
CONNECT_WITHIN_S = 1.5


def default_store() -> Path:
    """Where `draftwire edge` keeps conversations: $XDG_DATA_HOME/draftwire/edge.sqlite3."""
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "draftwire" / "edge.sqlite3"


@dataclass(frozen=True)
class EdgeConfig:
    server: str  # the verifier's HOST:PORT
    gamma: int | None = None  # draft tokens per round; None: chosen online (edge_client.adaptive)
    pipeline: int | None = None  # proposals sent ahead of their verdicts; None: chosen online
    defaults: Settings = Settings()
    store_path: Path | str = ":memory:"
    # EDGE: the device drafts. NONE or NGRAM: a thin device (no draft model, only its vocabulary): the
    # verifier decodes, alone or with its prompt-lookup drafts.
    drafting: Drafting = Drafting.EDGE
    credentials: wire.ClientCredentials = wire.PLAINTEXT  # TLS, client certificate, token to the verifier
    guard: guards.Guard = guards.Guard()  # Host, Origin and API key checks (edge_client.guard)
    max_body: int = 1 << 20  # bytes of a request body
    max_waiting: int = 8  # generations waiting behind the running one; more get 429
    model_aliases: tuple[str, ...] = ()  # names a request's `model` may give besides the target's own
    template_time_s: float = 2.0  # a chat template's render
    public_without_key: bool = False  # listen on a non-loopback address without an API key (warned)


@dataclass
class Outcome:
    """One finished (or abandoned) reply."""

    text: str
    finish_reason: str  # "stop", "length", or "cancelled"
    prompt_ids: list[int]
    generated: list[int]
    stats: GenerationStats
    seed: int
    logprobs: list[dict] = field(default_factory=list)  # OpenAI's chat entries, when the request asks

    def figures(self) -> dict:
        return {
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "timings": timings(self.stats, len(self.prompt_ids)),
        }

    def usage(self) -> dict:
        return usage(len(self.prompt_ids), len(self.generated), self.stats.reused_positions)


@dataclass
class Reply:
    """A reply being written as its Outcome grows: one JSON object (`whole`) or server-sent events
    (`stream`), each ending with the figures (`extra`, the seed, the timings)."""

    shape: ResponseShape
    outcome: Outcome
    figures: dict
    wants_logprobs: bool
    sent: int = 0  # logprobs entries already sent
    tools: Tools | None = None  # the request's tools: calls in the reply are read as tool_calls
    streamed: str = ""  # a streamed reply's text so far, with tools
    shown: int = 0  # characters of it sent as content (held back from a tool call's tag on)

    @property
    def calls_read(self) -> bool:
        return self.tools is not None and self.tools.choice != "none"

    def tool_calls(self) -> tuple[str | None, list[dict]]:
        """The reply's content and tool calls; a reply with calls finishes with `tool_calls`."""
        o = self.outcome
        if not self.calls_read:
            return o.text, []
        content, calls = split_tool_calls(o.text, self.tools)
        if calls and o.finish_reason in ("stop", "length"):
            o.finish_reason = "tool_calls"
        return content, calls

    def unsent(self) -> list[dict] | None:
        if not self.wants_logprobs:
            return None
        fresh, self.sent = self.outcome.logprobs[self.sent :], len(self.outcome.logprobs)
        return fresh

    def _end(self) -> dict:
        self.figures["timings"] = timings(self.outcome.stats, len(self.outcome.prompt_ids))
        return self.figures

    def whole(self) -> web.Response:
        o = self.outcome
        content, calls = self.tool_calls()
        return web.json_response(
            self.shape.complete(content, o.finish_reason, o.usage(), self._end(), self.unsent(), calls),
            dumps=jsonout.dumps,
        )

    async def stream(self, request: web.Request, run, first: str | None, include_usage: bool):
        """Sends `first` and every piece `run` yields as events, then the final chunk, the usage (when
        asked) and `data: [DONE]`. A failure mid-reply ends it with an error event and no [DONE], so no
        client takes it as whole; a client that goes away ends it quietly (closing `run` cancels the
        verifier's session)."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        shape, chat = self.shape, self.shape.chat
        try:
            if chat:
                await _send(response, shape.chunk("", first=True))
            piece = first
            while piece is not None:
                if self.calls_read:  # content up to a tool call's tag; the calls go at the end
                    self.streamed += piece
                    upto = max(self.shown, held_back(self.streamed))
                    piece, self.shown = self.streamed[self.shown : upto], upto
                if piece or not self.calls_read:
                    fresh = self.unsent()
                    chunk = shape.chunk(piece, logprobs=fresh) if chat else shape.text_chunk(piece, fresh)
                    await _send(response, chunk)
                piece = await anext(run, None)
            if self.calls_read:
                _, calls = self.tool_calls()
                rest = self.outcome.text[self.shown :]
                if calls or rest:
                    await _send(response, shape.chunk(None if calls else rest, tool_calls=calls or None))
            await _send(response, shape.final_chunk(self.outcome.finish_reason, self._end(), self.unsent()))
            if include_usage:
                await _send(response, shape.usage_chunk(self.outcome.usage()))
            await response.write(b"data: [DONE]\n\n")
        except VerifierError as e:
            with contextlib.suppress(ConnectionError):
                await _send(response, error_body(e.details, HTTP_STATUS.get(e.code, 502), code=e.code.name))
        except ConnectionError:
            log.info("client disconnected mid-reply")
        return response


class EdgeApp:
    def __init__(self, config: EdgeConfig, drafter, draft_name: str = ""):
        """`drafter`: a LlamaDrafter, or for a thin device (config.drafting not EDGE) a VocabOnly."""
        self.config = config
        self.drafter = drafter
        self.draft_name = draft_name
        self.store = Store(config.store_path)
        self.contexts = Contexts(drafter)
        self.lock = asyncio.Lock()
        self.channel: grpc.aio.Channel | None = None
        self.session: EdgeSession | None = None
        self.metrics = EdgeMetrics()
        self.renderer = TemplateRenderer(config.template_time_s)
        self.waiting = 0  # generations admitted and not finished (one runs, the rest wait for the lock)
        self._checked_info = None
        self._health: tuple | None = None  # (when, body, status) of the last check
        self._health_lock = asyncio.Lock()
        self._health_task: asyncio.Task | None = None  # a check running in the background
        self._token_bytes: int | None = None  # the longest token's bytes: a text's fewest tokens
        self._replying: set[str] = set()  # conversations whose reply is being generated
        self._shown: dict[str, str] = {}  # a stopped reply's text as the page showed it, until stored

    def web_app(self) -> web.Application:
        guard = self.config.guard
        app = web.Application(
            client_max_size=self.config.max_body, middlewares=[errors, guards.middleware(guard)]
        )
        app[METRICS] = self.metrics
        app[MAX_BODY] = self.config.max_body
        app.on_response_prepare.append(
            lambda request, response: guards.cors_headers(guard, request, response)
        )
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.add_routes(
            [
                web.get("/", self.page),
                web.get("/favicon.ico", self.favicon),
                web.static("/static", WEB),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics.page),
                web.get("/v1/models", self.models),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/completions", self.completions),
                web.get("/api/conversations", self.list_conversations),
                web.post("/api/conversations", self.create_conversation),
                web.get("/api/conversations/{cid}", self.get_conversation),
                web.delete("/api/conversations/{cid}", self.delete_conversation),
                web.post("/api/conversations/{cid}/messages", self.conversation_message),
                web.post("/api/conversations/{cid}/stop", self.stop_reply),
            ]
        )
        return app

    async def _start(self, _app) -> None:
        self.channel = wire.channel(self.config.server, self.config.credentials)
        drafter = self.drafter if self.config.drafting is Drafting.EDGE else None
        # A reply that has shown nothing gets its 503 at once (as _connected's), not after the resume
        # budget: the channel may still read READY a moment after its verifier went away.
        timeouts = Timeouts(start_s=CONNECT_WITHIN_S)
        self.session = EdgeSession(self.channel, drafter, timeouts, vocabulary=self.drafter.vocabulary)
        self._health_task = asyncio.get_running_loop().create_task(self._refresh_health())

    async def _stop(self, _app) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.channel.close()
        self.store.close()
        self.renderer.close()

    async def connect(self, timeout_s: float = 5.0):
        """Asks the verifier what it serves and checks the answer; returns its ModelInfo, or None when the
        verifier cannot be reached yet (checked then at the first request). Raises UntrustedVerifier."""
        try:
            return await within(self._info(log_refusal=False), timeout_s)  # the caller says a refusal
        except (VerifierError, TimeoutError):
            return None
        except ApiError as e:
            raise UntrustedVerifier(str(e)) from None

    def _vocab_size(self) -> int | None:
        vocabulary = getattr(self.drafter, "vocabulary", None)
        return vocabulary.size if vocabulary is not None else None

    def _context(self, info) -> int:
        """The longest sequence (prompt and reply) both the target and the draft can hold."""
        limit = info.target.max_context
        if self.config.drafting is Drafting.EDGE and getattr(self.drafter, "n_ctx", None):
            limit = min(limit, self.drafter.n_ctx)
        return limit

    def _check_model(self, model: str | None, info) -> None:
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
            self._token_bytes = await asyncio.to_thread(_longest_token, self.drafter.llm)
        limit = self._context(info)
        if text_bytes > limit * self._token_bytes:
            raise BadRequest(
                f"the prompt is at least {text_bytes // self._token_bytes} tokens; the context holds {limit} "
                "(prompt and reply)",
                param,
            )

    def _budget(self, req: CompletionRequest, prompt: list[int], info, param: str) -> CompletionRequest:
        """Checks prompt + max_tokens against the context before anything is drafted: a prompt that does
        not fit is refused (400); a reply without a max_tokens of its own gets what the context leaves."""
        vocab = min(info.target.vocabulary.size, self._vocab_size() or info.target.vocabulary.size)
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

    async def _connected(self, within_s: float = CONNECT_WITHIN_S) -> None:
        """Raises VerifierError(UNAVAILABLE) unless the channel is (or gets, within `within_s`) connected:
        a request that would commit nothing gets its 503 at once, not after the resume budget, which is
        for replies already under way."""
        ready, failed = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        state = self.channel.get_state(try_to_connect=True)
        while state != ready:
            left = deadline - loop.time()
            if state in (failed, grpc.ChannelConnectivity.SHUTDOWN) or left <= 0:
                raise VerifierError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot connect to the verifier {self.config.server} ({state.name.lower()})",
                )
            with contextlib.suppress(TimeoutError):
                await within(self.channel.wait_for_state_change(state), left)
            state = self.channel.get_state(try_to_connect=True)

    @contextlib.contextmanager
    def _slot(self):
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

    # --- pages and small endpoints -------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB / "index.html")

    async def favicon(self, request: web.Request) -> web.FileResponse:
        """The page's icon where a browser or tool asks the old way, without reading the page's link."""
        return web.FileResponse(WEB / "favicon.svg", headers={"Content-Type": "image/svg+xml"})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the verifier says SERVING, else 503 with the reason. Answered from the last check of
        the verifier, which runs at start and again, in the background, when a probe finds it older than a
        second: a probe never waits on a verifier busy with load (only the very first, before any check
        has ended)."""
        loop = asyncio.get_running_loop()
        if self._health is None:
            if self._health_task is not None and not self._health_task.done():
                await asyncio.shield(self._health_task)
            else:
                await self._refresh_health()
        elif loop.time() - self._health[0] >= HEALTH_TTL_S and (
            self._health_task is None or self._health_task.done()
        ):
            self._health_task = loop.create_task(self._refresh_health())
        return _health_response(*self._health[1:])

    async def _refresh_health(self) -> None:
        async with self._health_lock:
            checked = asyncio.get_running_loop().time()
            self._health = (checked, *(await self._check_health()))

    async def _check_health(self) -> tuple[dict, int]:
        try:
            stub = health_pb2_grpc.HealthStub(self.channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=3)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = (
                ""
                if serving
                else f"the verifier reports {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            )
        except grpc.aio.AioRpcError as e:
            serving, reason = False, f"verifier {self.config.server} unreachable: {e.code().name}"
        body = {"status": "ok" if serving else "unavailable", "verifier": self.config.server}
        return (body if serving else {**body, "reason": reason}), 200 if serving else 503

    async def models(self, request: web.Request) -> web.Response:
        info = await self._info()
        model = {
            "id": info.target.target_id,
            "object": "model",
            "created": 0,
            "owned_by": "draftwire",
            "meta": {
                "draft": self.draft_name,
                "verifier": self.config.server,
                "max_context": info.target.max_context,
                "aliases": list(self.config.model_aliases),
            },
        }
        return web.json_response({"object": "list", "data": [model]})

    # --- OpenAI API ----------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self._slot():
            req = parse_chat(await _json(request), self.config.defaults)
            info = await self._info()
            self._check_model(req.model, info)
            prompt = await self._chat_prompt(list(req.messages), tools=req.tools)
            req = self._budget(req, prompt, info, "messages")
            return await self._respond(request, req, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self._slot():
            req = parse_completion(await _json(request), self.config.defaults)
            info = await self._info()
            self._check_model(req.model, info)
            await self._too_long(len(req.prompt.encode("utf-8", "replace")), info, "prompt")
            prompt = await asyncio.to_thread(self.drafter.tokenize, req.prompt)
            req = self._budget(req, prompt, info, "prompt")
            return await self._respond(request, req, prompt, chat=False)

    # --- conversations -------------------------------------------------------------------------------

    async def list_conversations(self, request: web.Request) -> web.Response:
        return web.json_response({"conversations": self.store.list()})

    async def create_conversation(self, request: web.Request) -> web.Response:
        body = await _json(request) if request.can_read_body else {}
        settings = parse_settings(body.get("settings") or {}, self.config.defaults)
        created = self.store.create(str(body.get("title") or "New chat"), settings.as_json())
        return web.json_response(created, status=201)

    async def get_conversation(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.get(request.match_info["cid"]))

    async def delete_conversation(self, request: web.Request) -> web.Response:
        self.store.delete(request.match_info["cid"])
        return web.Response(status=204)

    async def conversation_message(self, request: web.Request) -> web.StreamResponse:
        """The next user turn of a stored conversation: `{"content": ..., "settings": {...}, "stream":
        true}`. The message is stored before the reply is generated, the reply once it ends (also when the
        client stops it: what it saw, marked cancelled)."""
        with self._slot():
            return await self._conversation_message(request)

    async def _conversation_message(self, request: web.Request) -> web.StreamResponse:
        cid = request.match_info["cid"]
        conversation = self.store.get(cid)
        body = await _json(request)
        content = body.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRequest("content must be a non-empty string", "content")
        stored = Settings.from_json(conversation["settings"])
        given = body.get("settings") or {}
        settings = parse_settings(given, stored)
        stream, include_usage = body.get("stream", True), False
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        info = await self._info()
        self.store.update(cid, settings=settings.as_json())
        if conversation["title"] == "New chat":
            self.store.update(cid, title=content.strip().splitlines()[0][:60])
        self.store.add_message(cid, "user", content)
        messages = [{"role": m["role"], "content": m["content"]} for m in conversation["messages"]]
        messages.append({"role": "user", "content": content})
        prompt = await self._chat_prompt(messages, self.store.context_ids(cid))

        def done(outcome: Outcome) -> None:
            self._replying.discard(cid)
            shown = self._shown.pop(cid, None)
            if shown is not None and outcome.text.startswith(shown):  # stopped: kept as it was shown
                outcome.text, outcome.finish_reason = shown, "cancelled"
                self.store.add_message(cid, "assistant", shown, outcome.figures())
                self.store.update(cid, context_ids=[])
                return
            self.store.add_message(cid, "assistant", outcome.text, outcome.figures())
            self.store.update(cid, context_ids=outcome.prompt_ids + outcome.generated)

        req = CompletionRequest(
            settings,
            stream,
            include_usage,
            messages=tuple(messages),
            max_tokens_given=isinstance(given, dict) and _max_tokens_set(given),
        )
        req = self._budget(req, prompt, info, "content")
        self._replying.add(cid)
        self._shown.pop(cid, None)
        try:
            return await self._respond(
                request, req, prompt, chat=True, on_done=done, extra={"conversation_id": cid}
            )
        finally:
            self._replying.discard(cid)

    async def stop_reply(self, request: web.Request) -> web.Response:
        """The page stopped the reply and says what it showed (`{"shown": text}`): the reply is stored as
        that, whether it is stored already or not yet (the edge notices the closed stream a little later,
        and by then has written, and counted, text the page never showed)."""
        cid = request.match_info["cid"]
        self.store.get(cid)
        shown = (await _json(request)).get("shown")
        if not isinstance(shown, str):
            raise BadRequest("shown must be a string", "shown")
        if cid in self._replying:
            self._shown[cid] = shown
        else:
            self.store.cut_last_reply(cid, shown)
        return web.json_response({"stopped": True})

    # --- generation ----------------------------------------------------------------------------------

    async def _info(self, log_refusal: bool = True):
        """The verifier's ModelInfo, checked (edge_client.trust): one that does not hold up is refused
        (502, with the reason; logged unless `log_refusal` is false), and nothing of it is used."""
        try:
            info = await self.session.model_info()
        except grpc.aio.AioRpcError as e:
            raise VerifierError(e.code(), e.details() or "") from None
        if info is not self._checked_info:
            try:
                check_model_info(info, self._vocab_size())
            except UntrustedVerifier as e:
                self.session.forget_model_info()  # asked again next time (the verifier may be replaced)
                if log_refusal:
                    log.error("refusing the verifier %s: %s", self.config.server, e)
                raise ApiError(
                    502, f"refusing the verifier {self.config.server}: {e}", code="bad_verifier"
                ) from None
            self._checked_info = info
        return info

    async def _chat_prompt(
        self, messages: list[dict], hint: list[int] | None = None, tools: Tools | None = None
    ) -> list[int]:
        info = await self._info()
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
        await self._too_long(len(text.encode("utf-8", "replace")), await self._info(), "messages")
        return await asyncio.to_thread(self.contexts.prompt, pieces, hint)

    async def _reply(
        self, prompt: list[int], settings: Settings, outcome: Outcome, constraint: Constraint | None = None
    ) -> AsyncIterator[str]:
        """The reply's text as it is verified, cut at a stop string, under `constraint` when given;
        `outcome` is filled in as it goes (also when the reader stops early: the text so far, finish
        "cancelled"). One reply at a time."""
        async with self.lock:
            info = await self._info()
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
            text = _TextStream(self.drafter, info.target.eos_token_ids, settings.stop)
            parts, logprobs = [], []
            try:
                generation = self.session.generate(request, outcome.stats, outcome.generated, logprobs)
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

    async def _respond(
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
        shape = ResponseShape(chat, (await self._info()).target.target_id)
        await self._connected()
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


class EdgeMetrics:
    """The app's Prometheus metrics at /metrics: its replies, as the edge sees them (the verifier's own
    are on its --metrics-port). The speculation counters carry vLLM's names, like the verifier's."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        r, p = self.registry, "draftwire:"
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verified proposals.", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.generated = Counter(p + "edge_generated_tokens", "Tokens of the replies.", registry=r)
        self.replies = Counter(p + "edge_replies", "Replies by finish reason.", ["finish_reason"], registry=r)
        self.errors = Counter(
            p + "edge_errors", "Requests answered with an error, by HTTP status.", ["status"], registry=r
        )
        self.ttft = Histogram(
            p + "edge_time_to_first_token_seconds",
            "From a reply's start to its first verified token.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )

    def reply(self, outcome: Outcome) -> None:
        stats = outcome.stats
        self.drafts.inc(stats.rounds)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.generated.inc(len(outcome.generated))
        self.replies.labels(outcome.finish_reason).inc()
        if stats.first_token_s is not None:
            self.ttft.observe(stats.first_token_s)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )


METRICS = web.AppKey("metrics", EdgeMetrics)
MAX_BODY = web.AppKey("max_body", int)


class _TextStream:
    """Token ids in, text out: UTF-8 decoded across token boundaries, end-of-sequence ids dropped, cut at
    the first stop string."""

    def __init__(self, drafter, eos_ids, stops):
        self.drafter, self.eos = drafter, set(eos_ids)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.cutter = StopCutter(tuple(stops))

    @property
    def stopped(self) -> bool:
        return self.cutter.stopped

    def feed(self, tokens: list[int]) -> str:
        return self.cutter.feed(
            self.decoder.decode(self.drafter.detokenize([t for t in tokens if t not in self.eos]))
        )

    def end(self) -> str:
        return self.cutter.feed(self.decoder.decode(b"", final=True)) + self.cutter.flush()


async def _send(response: web.StreamResponse, payload: dict | None) -> None:
    if payload is not None:
        await response.write(b"data: " + jsonout.dumps(payload).encode() + b"\n\n")


HEALTH_TTL_S = 1.0


def _health_response(body: dict, status: int) -> web.Response:
    return web.json_response(body, status=status)


def _longest_token(llm) -> int:
    return max(len(llm.detokenize([i], special=True)) for i in range(llm.n_vocab())) or 1


def _max_tokens_set(body: dict) -> bool:
    return body.get("max_completion_tokens", body.get("max_tokens")) is not None


async def _json(request: web.Request) -> dict:
    try:  # at most client_max_size (413 past it), within the read timeout (a slow-loris body: 408)
        async with asyncio.timeout(httpkit.READ_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        message = f"the request body did not arrive within {httpkit.READ_TIMEOUT_S:g} s"
        raise ApiError(408, message, code="request_timeout") from None
    try:
        body = json.loads(raw, parse_constant=_not_json)
        # A \ud800 escape parses to a lone surrogate, which no text can hold (SQLite, the tokenizer).
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest(
            "the request body is not valid JSON (UTF-8 text, no NaN or lone surrogates)"
        ) from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


@web.middleware
async def errors(request: web.Request, handler):
    """OpenAI-shaped errors with the right status: 400 for bad input (the verifier's INVALID_ARGUMENT with
    its message), 404 for an unknown conversation, 503 when the verifier cannot be reached."""
    response = await _answer_errors(request, handler)
    if response.status >= 400:
        request.app[METRICS].errors.labels(str(response.status)).inc()
    return response


async def _answer_errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response(error_body(str(e), 400, e.param, e.code), status=400)
    except ApiError as e:
        return web.json_response(
            error_body(str(e), e.status, e.param, e.code), status=e.status, headers=e.headers
        )
    except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 ...; answered as JSON too
        if e.status < 400:
            raise
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"the request body is larger than the limit of {request.app[MAX_BODY]} bytes",
        }.get(e.status, e.reason)
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        return web.json_response(error_body(message, e.status, code=code), status=e.status, headers=headers)
    except NotFound as e:
        return web.json_response(
            error_body(f"no conversation {e.args[0]}", 404, code="not_found"), status=404
        )
    except VerifierError as e:
        status = HTTP_STATUS.get(e.code, 502)
        message = e.details
        if status == 503:
            message = f"the verifier is unavailable: {e.details}"
        return web.json_response(error_body(message, status, code=e.code.name.lower()), status=status)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:  # a bug: logged with its traceback, and still an OpenAI-shaped answer
        log.exception("unexpected failure on %s %s", request.method, request.path)
        return web.json_response(error_body("internal error (logged by the edge)", 500), status=500)


def make_app(config: EdgeConfig, drafter, draft_name: str = "") -> web.Application:
    return EdgeApp(config, drafter, draft_name).web_app()


async def serve(config: EdgeConfig, drafter, host: str, port: int, draft_name: str = "", ready=None) -> None:
    """Runs the edge server until cancelled; `ready(url, model)` is called once it listens (`model`: the
    target's name, None while the verifier cannot be reached).

    Raises draftwire.ports.PortInUse when something listens on host:port, guard.UnsafeBind for a
    non-loopback address without an API key (unless config.public_without_key), and
    trust.UntrustedVerifier when the verifier's ModelInfo does not hold up."""
    from draftwire.ports import PortInUse, check_free

    if not guards.is_loopback(host) and config.guard.api_key is None:
        if not config.public_without_key:
            raise guards.UnsafeBind(
                f"refusing to listen on {host} without an API key: any machine that reaches it could read "
                f"the conversations and use the verifier. Give --api-key-file FILE (or "
                f"${guards.API_KEY_ENV}), or --public-without-key to do it anyway"
            )
        log.warning("listening on %s WITHOUT an API key: anyone who can reach it can use it", host)
        print(
            f"draftwire edge: WARNING: listening on {host} without an API key; anyone who reaches this "
            "address can read the conversations and use the verifier",
            file=sys.stderr,
            flush=True,
        )
    config = replace(config, guard=replace(config.guard, bound_host=host))
    check_free(host, port)  # one process per port (no SO_REUSEPORT here either)
    edge = EdgeApp(config, drafter, draft_name)
    runner = httpkit.Runner(edge.web_app(), handle_signals=False)  # OpenAI-shaped errors, read timeouts
    await runner.setup()
    try:
        info = await edge.connect()  # a verifier whose ModelInfo does not hold up is refused here
    except UntrustedVerifier:
        await runner.cleanup()
        raise
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(port) from None
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}/"
    if ready is not None:
        ready(url, info.target.target_id if info is not None else None)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
