"""A reply as the edge app writes it: its Outcome as it grows (text, finish, tokens, figures), answered as
one JSON object or as server-sent events; and the text of its token ids, cut at the first stop string.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
from dataclasses import dataclass, field

from aiohttp import web

from draftwire import jsonout
from edge_client.inbox import VerifierError
from edge_client.openai_api import StopCutter
from edge_client.planner import GenerationStats
from edge_client.responses import HTTP_STATUS, ResponseShape, error_body, timings, usage
from edge_client.structured import Tools, held_back, split_tool_calls

log = logging.getLogger(__name__)


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
                await send(response, shape.chunk("", first=True))
            piece = first
            while piece is not None:
                if self.calls_read:  # content up to a tool call's tag; the calls go at the end
                    self.streamed += piece
                    upto = max(self.shown, held_back(self.streamed))
                    piece, self.shown = self.streamed[self.shown : upto], upto
                if piece or not self.calls_read:
                    fresh = self.unsent()
                    chunk = shape.chunk(piece, logprobs=fresh) if chat else shape.text_chunk(piece, fresh)
                    await send(response, chunk)
                piece = await anext(run, None)
            if self.calls_read:
                _, calls = self.tool_calls()
                rest = self.outcome.text[self.shown :]
                if calls or rest:
                    await send(response, shape.chunk(None if calls else rest, tool_calls=calls or None))
            await send(response, shape.final_chunk(self.outcome.finish_reason, self._end(), self.unsent()))
            if include_usage:
                await send(response, shape.usage_chunk(self.outcome.usage()))
            await response.write(b"data: [DONE]\n\n")
        except VerifierError as e:
            with contextlib.suppress(ConnectionError):
                await send(response, error_body(e.details, HTTP_STATUS.get(e.code, 502), code=e.code.name))
        except ConnectionError:
            log.info("client disconnected mid-reply")
        return response


class TextStream:
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


async def send(response: web.StreamResponse, payload: dict | None) -> None:
    if payload is not None:
        await response.write(b"data: " + jsonout.dumps(payload).encode() + b"\n\n")
