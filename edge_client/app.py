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
import json
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from draftwire import wire
from draftwire.contract import Drafting
from edge_client.chat import render_chat, special_piece
from edge_client.openai_api import (
    HTTP_STATUS,
    BadRequest,
    CompletionRequest,
    ResponseShape,
    Settings,
    StopCutter,
    error_body,
    parse_chat,
    parse_completion,
    parse_settings,
    timings,
    usage,
)
from edge_client.planner import GenerationStats
from edge_client.session import EdgeSession, GenerationRequest, VerifierError
from edge_client.store import NotFound, Store

log = logging.getLogger(__name__)
WEB = Path(__file__).parent / "web"


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


@dataclass
class Outcome:
    """One finished (or abandoned) reply."""

    text: str
    finish_reason: str  # "stop", "length", or "cancelled"
    prompt_ids: list[int]
    generated: list[int]
    stats: GenerationStats
    seed: int

    def figures(self) -> dict:
        return {
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "timings": timings(self.stats, len(self.prompt_ids)),
        }


@dataclass
class Contexts:
    """The token ids of recent conversations, and their text: a prompt whose text extends one of them
    is those ids plus the new text's, so the verifier's and the draft's caches match it up to the new
    turn (tokenizing the whole text again may split the reply's tokens differently)."""

    drafter: object
    size: int = 32
    _recent: OrderedDict[tuple[int, ...], str] = field(default_factory=OrderedDict)

    def prompt(self, text: str, hint: list[int] | None = None) -> list[int]:
        if hint:
            self.remember(hint)
        base, base_text = (), ""
        for ids, seen in self._recent.items():
            if len(seen) > len(base_text) and text.startswith(seen):
                base, base_text = ids, seen
        return [*base, *self._tokenize(text[len(base_text) :])] if base else self._tokenize(text)

    def remember(self, ids: list[int]) -> None:
        key = tuple(ids)
        if key not in self._recent:
            self._recent[key] = self.drafter.llm.detokenize(ids, special=True).decode("utf-8", "replace")
        self._recent.move_to_end(key)
        while len(self._recent) > self.size:
            self._recent.popitem(last=False)

    def _tokenize(self, text: str) -> list[int]:
        return self.drafter.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) if text else []


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

    def web_app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20, middlewares=[errors])
        app[METRICS] = self.metrics
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        app.add_routes(
            [
                web.get("/", self.page),
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
            ]
        )
        return app

    async def _start(self, _app) -> None:
        self.channel = wire.channel(self.config.server, self.config.credentials)
        drafter = self.drafter if self.config.drafting is Drafting.EDGE else None
        self.session = EdgeSession(self.channel, drafter, vocabulary=self.drafter.vocabulary)

    async def _stop(self, _app) -> None:
        await self.channel.close()
        self.store.close()

    # --- pages and small endpoints -------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB / "index.html")

    async def health(self, request: web.Request) -> web.Response:
        """200 while the verifier says SERVING, else 503 with the reason."""
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
        return web.json_response(
            body if serving else {**body, "reason": reason}, status=200 if serving else 503
        )

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
            },
        }
        return web.json_response({"object": "list", "data": [model]})

    # --- OpenAI API ----------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat(await _json(request), self.config.defaults)
        prompt = await self._chat_prompt(list(req.messages))
        return await self._respond(request, req, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion(await _json(request), self.config.defaults)
        return await self._respond(request, req, self.drafter.tokenize(req.prompt), chat=False)

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
        cid = request.match_info["cid"]
        conversation = self.store.get(cid)
        body = await _json(request)
        content = body.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRequest("content must be a non-empty string", "content")
        stored = Settings(**{**conversation["settings"], "stop": tuple(conversation["settings"]["stop"])})
        settings = parse_settings(body.get("settings") or {}, stored)
        stream, include_usage = body.get("stream", True), False
        self.store.update(cid, settings=settings.as_json())
        if conversation["title"] == "New chat":
            self.store.update(cid, title=content.strip().splitlines()[0][:60])
        self.store.add_message(cid, "user", content)
        messages = [{"role": m["role"], "content": m["content"]} for m in conversation["messages"]]
        messages.append({"role": "user", "content": content})
        prompt = await self._chat_prompt(messages, self.store.context_ids(cid))

        def done(outcome: Outcome) -> None:
            self.store.add_message(cid, "assistant", outcome.text, outcome.figures())
            self.store.update(cid, context_ids=outcome.prompt_ids + outcome.generated)

        req = CompletionRequest(settings, bool(stream), include_usage, messages=tuple(messages))
        return await self._respond(
            request, req, prompt, chat=True, on_done=done, extra={"conversation_id": cid}
        )

    # --- generation ----------------------------------------------------------------------------------

    async def _info(self):
        try:
            return await self.session.model_info()
        except grpc.aio.AioRpcError as e:
            raise VerifierError(e.code(), e.details() or "") from None

    async def _chat_prompt(self, messages: list[dict], hint: list[int] | None = None) -> list[int]:
        target = (await self._info()).target
        if not target.chat_template:
            return self.drafter.tokenize(messages[-1]["content"])
        bos = special_piece(self.drafter, target.bos_token_id)
        eos = special_piece(self.drafter, target.eos_token_ids[0] if target.eos_token_ids else None)
        try:
            text = render_chat(target.chat_template, messages, bos, eos)
        except Exception as e:  # the template refuses the conversation (roles out of order, say)
            raise BadRequest(f"the chat template refuses these messages: {e}", "messages") from None
        return self.contexts.prompt(text, hint)

    async def _reply(self, prompt: list[int], settings: Settings, outcome: Outcome) -> AsyncIterator[str]:
        """The reply's text as it is verified, cut at a stop string; `outcome` is filled in as it goes
        (also when the reader stops early: the text so far, finish "cancelled"). One reply at a time."""
        async with self.lock:
            info = await self._info()
            request = GenerationRequest(
                tuple(prompt),
                replace(settings.sampling(), seed=outcome.seed),
                settings.max_tokens,
                self.config.gamma,
                pipeline=self.config.pipeline,
                drafting=self.config.drafting,
            )
            text = _TextStream(self.drafter, info.target.eos_token_ids, settings.stop)
            parts = []
            try:
                generation = self.session.generate(request, outcome.stats, outcome.generated)
                async with contextlib.aclosing(generation) as tokens:
                    async for new in tokens:
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
        seed = req.settings.sampling().seed
        outcome = Outcome("", "cancelled", prompt, [], GenerationStats(), seed)
        figures = {**(extra or {}), "seed": seed}
        run = self._reply(prompt, req.settings, outcome)
        try:
            async with contextlib.aclosing(run):
                first = await anext(run, None)  # a refusal of the open raises here
                if not req.stream:
                    async for _ in run:
                        pass
                    figures["timings"] = timings(outcome.stats, len(prompt))
                    body = shape.complete(outcome.text, outcome.finish_reason, self._usage(outcome), figures)
                    return web.json_response(body)
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
                try:
                    if chat:
                        await _send(response, shape.chunk("", first=True))
                    piece = first
                    while piece is not None:
                        await _send(response, shape.chunk(piece) if chat else shape.text_chunk(piece))
                        piece = await anext(run, None)
                    figures["timings"] = timings(outcome.stats, len(prompt))
                    await _send(response, shape.final_chunk(outcome.finish_reason, figures))
                    if req.include_usage:
                        await _send(response, shape.usage_chunk(self._usage(outcome)))
                    await response.write(b"data: [DONE]\n\n")
                except (
                    VerifierError
                ) as e:  # mid-reply: an error event and no [DONE], so no client takes it as whole
                    with contextlib.suppress(ConnectionError):
                        await _send(
                            response, error_body(e.details, HTTP_STATUS.get(e.code, 502), code=e.code.name)
                        )
                except ConnectionError:  # the client went away: closing `run` cancels the verifier's session
                    log.info("client disconnected mid-reply")
                return response
        finally:
            self.metrics.reply(outcome)
            if on_done is not None and (outcome.generated or outcome.finish_reason != "cancelled"):
                on_done(outcome)

    @staticmethod
    def _usage(outcome: Outcome) -> dict:
        return usage(len(outcome.prompt_ids), len(outcome.generated), outcome.stats.reused_positions)


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
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


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
        return web.json_response(error_body(str(e), 400, e.param), status=400)
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


def make_app(config: EdgeConfig, drafter, draft_name: str = "") -> web.Application:
    return EdgeApp(config, drafter, draft_name).web_app()


async def serve(config: EdgeConfig, drafter, host: str, port: int, draft_name: str = "", ready=None) -> None:
    """Runs the edge server until cancelled; `ready(url)` is called once it listens."""
    runner = web.AppRunner(make_app(config, drafter, draft_name), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}/"
    if ready is not None:
        ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
