"""The OpenAI-compatible requests of the edge app: bodies parsed into typed settings (or refused with the
field named), and stop strings cut as the OpenAI API cuts them. No I/O here; the responses are
edge_client.responses.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Any

from draftwire.contract import MAX_TOP_LOGPROBS, Constraint, InvalidSampling, SamplingParams
from edge_client.structured import (
    StructuredRequestError,
    Tools,
    parse_response_format,
    parse_tools,
    tool_message,
)

MAX_STOP_STRINGS = 4  # as the OpenAI API allows
MAX_UINT32 = 2**32 - 1  # top_k and max_tokens travel as uint32
ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system

# The request fields the API reads (chat and completions), and those it takes and ignores because they
# change nothing in a reply (labels). Any other field is 400 naming it: a setting the app does not
# implement must not be dropped silently (a user would believe it applied).
SETTINGS_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
)
# Structured output (edge_client/structured.py): a constraint the verifier masks with, tool calls.
STRUCTURED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")
CHAT_FIELDS = (
    *SETTINGS_FIELDS,
    *STRUCTURED_FIELDS,
    "model",
    "messages",
    "stream",
    "stream_options",
    "top_logprobs",
)
COMPLETION_FIELDS = (*SETTINGS_FIELDS, "model", "prompt", "stream", "stream_options")
LABEL_FIELDS = ("user", "metadata")
PASSED_UNREAD = ()  # fields taken unread, as before the check (none now)


class ApiError(Exception):
    """A request the API refuses with `status` and an OpenAI error (`param`, `code`)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}


class BadRequest(ValueError):
    """A request the API refuses with 400; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Settings:
    """How one reply is generated: what a request (or a stored conversation) sets."""

    max_tokens: int = 1024
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # None: a fresh one per reply (reported in the response)
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest

    def sampling(self) -> SamplingParams:
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        return SamplingParams(
            self.temperature,
            self.top_k,
            self.top_p,
            seed if self.temperature else 0,
            self.logit_bias,
            self.repetition_penalty,
            self.frequency_penalty,
            self.presence_penalty,
            self.min_p,
        )

    def as_json(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": {str(token): bias for token, bias in self.logit_bias},
            "logprobs": self.logprobs,
        }

    @classmethod
    def from_json(cls, stored: dict) -> Settings:
        """The inverse of as_json (a stored conversation's; fields it lacks take their defaults)."""
        fields = {**stored, "stop": tuple(stored.get("stop", ()))}
        fields["logit_bias"] = tuple((int(t), float(b)) for t, b in (stored.get("logit_bias") or {}).items())
        return cls(**fields)


@dataclass(frozen=True)
class CompletionRequest:
    settings: Settings
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    messages: tuple[dict[str, str], ...] = ()  # chat
    prompt: str | None = None  # completions
    model: str | None = None  # the `model` the request names (None: none named)
    max_tokens_given: bool = True  # False: the default, cut to what the context leaves
    constraint: Constraint | None = None  # response_format, or tool calls required
    tools: Tools | None = None  # chat: the tools offered, and tool_choice


def parse_settings(body: dict[str, Any], defaults: Settings, chat: bool = True) -> Settings:
    """The generation fields of an OpenAI request over `defaults` (other fields are the caller's to
    check: `unsupported`). `chat`: logprobs as the chat API has them (a boolean, and top_logprobs), else
    as the completions API (the number of alternatives). Raises BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    s = defaults
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        s = replace(s, max_tokens=_int(max_tokens, name, minimum=1, maximum=MAX_UINT32))
    if body.get("temperature") is not None:
        temperature = _number(body["temperature"], "temperature")
        if not 0 <= temperature <= 2:
            raise BadRequest(f"temperature must be in [0, 2], got {temperature}", "temperature")
        s = replace(s, temperature=temperature)
    if body.get("top_p") is not None:
        s = replace(s, top_p=_number(body["top_p"], "top_p"))
    if body.get("min_p") is not None:
        s = replace(s, min_p=_number(body["min_p"], "min_p"))
    if body.get("top_k") is not None:
        s = replace(s, top_k=_int(body["top_k"], "top_k", minimum=0, maximum=MAX_UINT32))
    if body.get("seed") is not None:
        s = replace(s, seed=_int(body["seed"], "seed", minimum=0, maximum=2**64 - 1))
    if body.get("stop") is not None:
        s = replace(s, stop=_stop(body["stop"]))
    if body.get("n") not in (None, 1):
        raise BadRequest("only n = 1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        if body.get(name) is not None:
            s = replace(s, **{name: _number(body[name], name)})
    if body.get("logit_bias") is not None:
        s = replace(s, logit_bias=_logit_bias(body["logit_bias"]))
    s = replace(s, logprobs=_logprobs(body, s.logprobs, chat))
    try:
        replace(s, seed=s.seed or 0).sampling().validate()
    except InvalidSampling as e:
        raise BadRequest(str(e), str(e).split()[0]) from None
    return s


def unsupported(body: Any, read: tuple[str, ...]) -> None:
    """Raises BadRequest naming the first field of `body` outside `read`, the labels and PASSED_UNREAD."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in read and name not in LABEL_FIELDS and name not in PASSED_UNREAD:
            raise BadRequest(f"{name} is not supported by this server", name, "unsupported_parameter")


def parse_chat(body: dict[str, Any], defaults: Settings) -> CompletionRequest:
    """POST /v1/chat/completions. Raises BadRequest."""
    unsupported(body, CHAT_FIELDS)
    settings = parse_settings(body, defaults)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
        constraint = parse_response_format(body.get("response_format"))
        calls = tools.constraint() if tools is not None else None
        if calls is not None:
            if constraint is not None:
                raise StructuredRequestError(
                    "response_format cannot go with tool_choice required or a named function: the reply "
                    "is tool calls",
                    "response_format",
                )
            constraint = calls
    except StructuredRequestError as e:
        raise BadRequest(str(e), e.param) from None
    return CompletionRequest(
        settings,
        *_stream_fields(body),
        messages=tuple(_message(m, i) for i, m in enumerate(messages)),
        model=_model(body),
        max_tokens_given=_max_tokens_given(body),
        constraint=constraint,
        tools=tools,
    )


def parse_completion(body: dict[str, Any], defaults: Settings) -> CompletionRequest:
    """POST /v1/completions (one prompt string). Raises BadRequest."""
    unsupported(body, COMPLETION_FIELDS)
    settings = parse_settings(body, defaults, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string", "prompt")
    return CompletionRequest(
        settings,
        *_stream_fields(body),
        prompt=prompt,
        model=_model(body),
        max_tokens_given=_max_tokens_given(body),
    )


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    return model


def _max_tokens_given(body: dict) -> bool:
    return body.get("max_completion_tokens", body.get("max_tokens")) is not None


def _stream_fields(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage"))


def _message(m: Any, i: int = 0) -> dict[str, str]:
    where = f"messages.[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object with a role and a content", where)
    role = m.get("role")
    if role == "tool" or (role == "assistant" and m.get("tool_calls")):
        try:
            return tool_message(m, where)
        except StructuredRequestError as e:
            raise BadRequest(str(e), e.param) from None
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: the text ones, joined
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise BadRequest("only text content parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number", name)
    return float(value)


def _int(value: Any, name: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise BadRequest(f"{name} must be an integer in [{minimum}, {maximum}]", name)
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (as strings, JSON keys) to a bias; ranges are the rules' to check."""
    if not isinstance(value, dict):
        raise BadRequest("logit_bias must be an object of token ids to numbers", "logit_bias")
    bias = []
    for token, number in value.items():
        if not (isinstance(token, str) and token.isdigit() and len(token) < 11):
            raise BadRequest(f"logit_bias key {token!r} is not a token id", "logit_bias")
        bias.append((int(token), _number(number, "logit_bias")))
    return tuple(bias)


def _logprobs(body: dict, default: int | None, chat: bool) -> int | None:
    """How many alternatives a request wants with each token's logprob (None: no logprobs)."""
    if chat:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest("logprobs must be a boolean", "logprobs")
        if top is not None:
            top = _int(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if not wanted:
                raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        if wanted is None:
            return default
        return (top or 0) if wanted else None
    if body.get("logprobs") is None:
        return default
    return _int(body["logprobs"], "logprobs", 0, MAX_TOP_LOGPROBS)


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    return tuple(stops)


class StopCutter:
    """Cuts streamed text at the first stop string, as the OpenAI API does: the text before it is
    returned, the stop string and everything after it never are. Text that could still turn out to begin
    a stop string is held back until it cannot."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        """The text safe to show after this piece ("" once stopped)."""
        if self.stopped:
            return ""
        text = self._held + text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What is held back, once the text has ended without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
