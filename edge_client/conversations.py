"""The chat page's conversations (/api/conversations), kept in SQLite (edge_client.store): each turn
stored before its reply is generated, the reply once it ends; a reply the page stopped is stored as the
page showed it."""

from __future__ import annotations

from aiohttp import web

from edge_client.httpkit import read_json
from edge_client.openai_api import BadRequest, CompletionRequest, Settings, parse_settings
from edge_client.replier import Replier
from edge_client.replies import Outcome
from edge_client.store import Store


class Conversations:
    """The conversations' endpoints over one store, replying through `replier`."""

    def __init__(self, store: Store, defaults: Settings, replier: Replier):
        self.store = store
        self.defaults = defaults
        self.replier = replier
        self._replying: set[str] = set()  # conversations whose reply is being generated
        self._shown: dict[str, str] = {}  # a stopped reply's text as the page showed it, until stored

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/api/conversations", self.list_conversations),
            web.post("/api/conversations", self.create_conversation),
            web.get("/api/conversations/{cid}", self.get_conversation),
            web.delete("/api/conversations/{cid}", self.delete_conversation),
            web.post("/api/conversations/{cid}/messages", self.conversation_message),
            web.post("/api/conversations/{cid}/stop", self.stop_reply),
        ]

    async def list_conversations(self, request: web.Request) -> web.Response:
        return web.json_response({"conversations": self.store.list()})

    async def create_conversation(self, request: web.Request) -> web.Response:
        body = await read_json(request) if request.can_read_body else {}
        settings = parse_settings(body.get("settings") or {}, self.defaults)
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
        with self.replier.slot():
            return await self._conversation_message(request)

    async def _conversation_message(self, request: web.Request) -> web.StreamResponse:
        cid = request.match_info["cid"]
        conversation = self.store.get(cid)
        body = await read_json(request)
        content = body.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRequest("content must be a non-empty string", "content")
        stored = Settings.from_json(conversation["settings"])
        given = body.get("settings") or {}
        settings = parse_settings(given, stored)
        stream, include_usage = body.get("stream", True), False
        if not isinstance(stream, bool):
            raise BadRequest("stream must be a boolean", "stream")
        info = await self.replier.link.info()
        self.store.update(cid, settings=settings.as_json())
        if conversation["title"] == "New chat":
            self.store.update(cid, title=content.strip().splitlines()[0][:60])
        self.store.add_message(cid, "user", content)
        messages = [{"role": m["role"], "content": m["content"]} for m in conversation["messages"]]
        messages.append({"role": "user", "content": content})
        prompt = await self.replier.chat_prompt(messages, self.store.context_ids(cid))

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
            max_tokens_given=isinstance(given, dict) and max_tokens_set(given),
        )
        req = self.replier.budget(req, prompt, info, "content")
        self._replying.add(cid)
        self._shown.pop(cid, None)
        try:
            return await self.replier.respond(
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
        shown = (await read_json(request)).get("shown")
        if not isinstance(shown, str):
            raise BadRequest("shown must be a string", "shown")
        if cid in self._replying:
            self._shown[cid] = shown
        else:
            self.store.cut_last_reply(cid, shown)
        return web.json_response({"stopped": True})


def max_tokens_set(body: dict) -> bool:
    return body.get("max_completion_tokens", body.get("max_tokens")) is not None
