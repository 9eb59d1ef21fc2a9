"""The OpenAI-compatible responses of the edge app: whole and streamed (chunks), usage, logprobs, and
errors, as OpenAI clients read them. No I/O here.

Timings carry llama.cpp server's names (`prompt_n`, `cache_n`, `predicted_n`, `draft_n`,
`draft_n_accepted`, ...) so tools that read llama-server's figures read ours, plus the speculation's own.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from draftwire.contract import TokenLogprob
from edge_client.planner import GenerationStats


def timings(stats: GenerationStats, prompt_tokens: int) -> dict:
    """llama.cpp server's `timings` object for one reply, plus the speculation's figures."""
    first = stats.first_token_s or stats.wall_s
    predicted_s = max(stats.wall_s - first, 1e-9)
    computed = max(prompt_tokens - stats.reused_positions, 0)
    return {
        "cache_n": stats.reused_positions,  # prompt positions the verifier took from its kept cache
        "prompt_n": computed,
        "prompt_ms": first * 1000,  # to the first token: the prefill and the first round
        "prompt_per_token_ms": first * 1000 / computed if computed else 0.0,
        "prompt_per_second": computed / first if first else 0.0,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": predicted_s * 1000,
        "predicted_per_token_ms": predicted_s * 1000 / stats.generated_tokens
        if stats.generated_tokens
        else 0.0,
        "predicted_per_second": stats.generated_tokens / stats.wall_s if stats.wall_s else 0.0,
        "draft_n": stats.draft_tokens,
        "draft_n_accepted": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "rounds": stats.rounds,
        "tokens_per_round": stats.tokens_per_round,
        "time_to_first_token_ms": first * 1000,
        "verify_ms": stats.verify_s * 1000,  # the verifier's forward passes for these rounds
        "mean_batch_size": stats.batched_with / stats.rounds if stats.rounds else 0.0,
        "gamma_cap": stats.gamma_cap,  # the verifier's γ cap under load, last and lowest (0: none)
        "min_gamma_cap": stats.min_gamma_cap,
        # Speculation that does not pay (edge_client.adaptive): the gain over the target alone at its
        # one-step time, the state the request ended in, why it last changed, its plain steps, and the
        # tokens the verifier decoded alone in the legs it was handed.
        "speculation_gain": stats.speculation_gain,
        "speculation": stats.speculation,
        "speculation_reason": stats.speculation_reason,
        "plain_steps": stats.plain_steps,
        "server_tokens": stats.server_tokens,
        "handoffs": stats.legs,
    }


def usage(prompt_tokens: int, completion_tokens: int, reused: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reused},
    }


# What OpenAI reports for a token its sampling ruled out (JSON has no -Infinity).
RULED_OUT_LOGPROB = -9999.0


def logprob_entry(token_bytes: Callable[[int], bytes], token_id: int, t: TokenLogprob) -> dict:
    """One token's entry of a chat response's `logprobs.content`, in OpenAI's shape: its text, logprob
    and UTF-8 bytes, and its `top_logprobs` alternatives alike."""

    def piece(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        value = logprob if math.isfinite(logprob) else RULED_OUT_LOGPROB
        return {"token": raw.decode("utf-8", "replace"), "logprob": value, "bytes": list(raw)}

    return {**piece(token_id, t.logprob), "top_logprobs": [piece(i, p) for i, p in t.top]}


def completion_logprobs(entries: list[dict]) -> dict:
    """The completions API's `logprobs` object from chat-shaped entries: tokens, their logprobs, the
    alternatives as {token: logprob}, and each token's offset in the text."""
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


class ResponseShape:
    """The ids, objects and chunks of one response, chat or text completion."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self,
        text: str | None,
        finish: str | None,
        chunk: bool,
        first: bool = False,
        logprobs=None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """`logprobs`: the chat-shaped entries of the tokens this choice carries, or None (not asked).
        `tool_calls`: the reply's calls (edge_client.structured), streamed whole in one delta."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if not self.chat:
            choice.update(
                text=text or "", logprobs=completion_logprobs(logprobs) if logprobs is not None else None
            )
            return choice
        if chunk:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        choice["logprobs"] = {"content": logprobs, "refusal": None} if logprobs is not None else None
        return choice

    def chunk(self, text: str | None, first: bool = False, logprobs=None, tool_calls=None) -> dict:
        return {**self._base(True), "choices": [self._choice(text, None, True, first, logprobs, tool_calls)]}

    def text_chunk(self, text: str, logprobs=None) -> dict:
        """A streamed piece of a text completion."""
        return {**self._base(True), "choices": [self._choice(text, None, True, logprobs=logprobs)]}

    def final_chunk(self, finish: str, extra: dict, logprobs=None) -> dict:
        """The last chunk with a choice: its finish reason, the reply's figures, the logprobs of tokens
        whose text no earlier chunk carried."""
        return {
            **self._base(True),
            "choices": [self._choice(None if self.chat else "", finish, True, logprobs=logprobs)],
            **extra,
        }

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._base(True), "choices": [], "usage": usage_}

    def complete(
        self, text: str | None, finish: str, usage_: dict, extra: dict, logprobs=None, tool_calls=None
    ) -> dict:
        choice = self._choice(text, finish, False, logprobs=logprobs, tool_calls=tool_calls)
        return {**self._base(False), "choices": [choice], "usage": usage_, **extra}


# gRPC status of a verifier refusal -> HTTP status; what is not here is the upstream failing (502).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI-shaped error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
