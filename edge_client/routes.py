"""The edge app's routes: the page, /health, /metrics and the OpenAI API (/v1/models, chat and text
completions), with the conversations' (edge_client.conversations)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from edge_client.config import EdgeConfig
from edge_client.conversations import Conversations
from edge_client.httpkit import read_json
from edge_client.link import VerifierLink
from edge_client.metrics import EdgeMetrics
from edge_client.openai_api import parse_chat, parse_completion
from edge_client.replier import Replier

WEB = Path(__file__).parent / "web"


class Routes:
    """The app's endpoints; the generation behind them is the replier's."""

    def __init__(
        self,
        config: EdgeConfig,
        draft_name: str,
        link: VerifierLink,
        replier: Replier,
        metrics: EdgeMetrics,
        conversations: Conversations,
    ):
        self.config = config
        self.draft_name = draft_name
        self.link = link
        self.replier = replier
        self.metrics = metrics
        self.conversations = conversations

    def table(self) -> list[web.AbstractRouteDef]:
        return [
            web.get("/", self.page),
            web.get("/favicon.ico", self.favicon),
            web.static("/static", WEB),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics.page),
            web.get("/v1/models", self.models),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            *self.conversations.routes(),
        ]

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(WEB / "index.html")

    async def favicon(self, request: web.Request) -> web.FileResponse:
        """The page's icon where a browser or tool asks the old way, without reading the page's link."""
        return web.FileResponse(WEB / "favicon.svg", headers={"Content-Type": "image/svg+xml"})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the verifier says SERVING, else 503 with the reason (VerifierLink.health: cached)."""
        body, status = await self.link.health()
        return web.json_response(body, status=status)

    async def models(self, request: web.Request) -> web.Response:
        info = await self.link.info()
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

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        with self.replier.slot():
            req = parse_chat(await read_json(request), self.config.defaults)
            info = await self.link.info()
            self.replier.check_model(req.model, info)
            prompt = await self.replier.chat_prompt(list(req.messages), tools=req.tools)
            req = self.replier.budget(req, prompt, info, "messages")
            return await self.replier.respond(request, req, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        with self.replier.slot():
            req = parse_completion(await read_json(request), self.config.defaults)
            info = await self.link.info()
            self.replier.check_model(req.model, info)
            prompt = await self.replier.text_prompt(req.prompt, info)
            req = self.replier.budget(req, prompt, info, "prompt")
            return await self.replier.respond(request, req, prompt, chat=False)
