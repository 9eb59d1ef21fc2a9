"""Structured output in the edge app's OpenAI API: `response_format` and `tools` read into a constraint the
verifier masks with, and a reply's tool calls read back in OpenAI's shapes. No I/O here.

Tool calls are written the way Qwen2.5's (and Hermes') chat templates teach the model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The template renders the tools itself when it knows them (it reads `tools`); a template that does not
gets the same instructions as a system message (`tools_instruction`). `tool_choice` `required`, or a
named function, constrains the reply to such calls with the functions' parameter schemas (a Lark grammar
with llguidance's `%json`), so the calls always parse; `auto` leaves the model free and reads any calls
it wrote; `none` renders no tool.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from draftwire.contract import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from draftwire.grammar import JSON_OPTIONS, InvalidConstraint, check_constraint

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


class StructuredRequestError(ValueError):
    """A response_format, tools or tool_choice the API refuses with 400; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools and what it asks of them."""

    functions: tuple[dict, ...]  # OpenAI's tool objects ({"type": "function", "function": {...}})
    choice: str = "auto"  # "auto", "required", "none", or "function" (one named)
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: several calls in one reply (required)

    @property
    def offered(self) -> tuple[dict, ...]:
        """The tools the template renders: none for `none`; the named one alone for a named choice."""
        if self.choice == "none":
            return ()
        if self.named is not None:
            return tuple(t for t in self.functions if t["function"]["name"] == self.named)
        return self.functions

    def constraint(self) -> Constraint | None:
        """`required` or a named function: the reply is tool calls of the offered functions and nothing
        else; `auto` and `none`: unconstrained."""
        if self.choice not in ("required", "function"):
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": _parameters(t["function"]),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.offered
        ]
        schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
        repeat = "" if self.named is not None or not self.parallel else ' ("\\n" call)*'
        grammar = (
            f"start: call{repeat}\n"
            f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n"
        )
        if len(grammar.encode()) > MAX_CONSTRAINT_BYTES:
            raise StructuredRequestError(
                f"the tools' schemas come to {len(grammar.encode())} bytes: at most {MAX_CONSTRAINT_BYTES}",
                "tools",
            )
        return _checked(Constraint(ConstraintKind.GRAMMAR, grammar), "tools")


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return parameters if parameters else {"type": "object", "properties": {}}


def parse_response_format(value: Any) -> Constraint | None:
    """OpenAI's response_format: `text` (None), `json_object`, or `json_schema` with its schema. Raises
    StructuredRequestError."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise StructuredRequestError("response_format must be an object with a type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind != "json_schema":
        raise StructuredRequestError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise StructuredRequestError(
            "response_format.json_schema must be an object with a schema object",
            "response_format.json_schema",
        )
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _NAME.match(name)):
        raise StructuredRequestError(
            "response_format.json_schema.name must be a-z, A-Z, 0-9, _ or -, at most 64",
            "response_format.json_schema.name",
        )
    schema = spec.get("schema") or {"type": "object"}
    return _checked(
        Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), "response_format.json_schema.schema"
    )


def _checked(constraint: Constraint, param: str) -> Constraint:
    """The constraint, once it compiles (the verifier checks it again); else StructuredRequestError."""
    try:
        check_constraint(constraint)
    except InvalidConstraint as e:
        said = str(e).split(": ", 1)[-1]
        raise StructuredRequestError(f"{param}: {said}", param) from None
    return constraint


def parse_tools(tools: Any, tool_choice: Any, parallel: Any = None) -> Tools | None:
    """OpenAI's `tools` (functions), `tool_choice` and `parallel_tool_calls`. Raises
    StructuredRequestError."""
    if parallel is not None and not isinstance(parallel, bool):
        raise StructuredRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise StructuredRequestError("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise StructuredRequestError("tools must be a non-empty list of function tools", "tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools.[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise StructuredRequestError(f"{where} must be a function tool (type function)", where)
        function = tool["function"]
        name = function.get("name")
        if not (isinstance(name, str) and _NAME.match(name)):
            raise StructuredRequestError(
                f"{where}.function.name must be a-z, A-Z, 0-9, _ or -, at most 64", f"{where}.function.name"
            )
        if name in names:
            raise StructuredRequestError(
                f"{where}.function.name {name!r} is given twice", f"{where}.function.name"
            )
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise StructuredRequestError(
                f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters"
            )
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise StructuredRequestError(
                f"{where}.function.description must be a string", f"{where}.function.description"
            )
        functions.append({"type": "function", "function": function})
    choice, named = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict):
            raise StructuredRequestError("tool_choice must name a function tool", "tool_choice")
        named = function.get("name")
        if named not in names:
            raise StructuredRequestError(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
        choice = "function"
    elif choice not in ("auto", "required", "none"):
        raise StructuredRequestError(
            "tool_choice must be none, auto, required or a named function", "tool_choice"
        )
    return Tools(tuple(functions), choice, named, parallel is not False)


def tools_instruction(tools: tuple[dict, ...]) -> str:
    """The system text that offers `tools` where the chat template does not render them: Qwen2.5's own
    wording and format, which the model reads and `tool_calls` parses."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{CALL_CLOSE}"
    )


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` it is given."""
    return "tools" in template


def split_tool_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """A reply's content (None when only calls) and its tool calls in OpenAI's shape. A block whose JSON
    does not parse, or names no offered function, stays in the content as the model wrote it."""
    names = {t["function"]["name"] for t in tools.offered}
    calls, kept, at = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not (isinstance(call, dict) and call.get("name") in names):
            continue
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        kept.append(text[at : match.start()])
        at = match.end()
    if not calls:
        return text, []
    kept.append(text[at:])
    content = "".join(kept).strip()
    return content or None, calls


def held_back(text: str) -> int:
    """Where the streamed content must stop: at a tool call's opening tag, or at an end of `text` that
    could still become one (the rest is held until the reply ends)."""
    at = text.find(CALL_OPEN)
    if at >= 0:
        return at
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if text.endswith(CALL_OPEN[:n]):
            return len(text) - n
    return len(text)


def template_messages(messages: list[dict], tools: Tools | None, template: str) -> tuple[list[dict], list]:
    """The messages and tools to render: assistant tool calls with their arguments as objects (what chat
    templates read); where the template renders no tools, the tools as a system message of their own."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    offered = list(tools.offered) if tools is not None else []
    if offered and not template_renders_tools(template):
        instruction = tools_instruction(tuple(offered))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instruction}"}
        else:
            out.insert(0, {"role": "system", "content": instruction})
        offered = []
    return out, offered


def _template_call(call: dict) -> dict:
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, ValueError):
        pass
    return {**call, "function": function}


def tool_message(m: dict, where: str) -> dict:
    """A `role: tool` message (a call's result), or an assistant message carrying `tool_calls`, checked
    and kept in the shape chat templates read. Raises StructuredRequestError."""
    content = m.get("content")
    if isinstance(content, list):  # content parts: the text ones, joined
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise StructuredRequestError("only text content parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if m["role"] == "tool":
        if not isinstance(content, str):
            raise StructuredRequestError(
                f"{where}.content must be a string (the tool's result)", f"{where}.content"
            )
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise StructuredRequestError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        return {"role": "tool", "content": content, "tool_call_id": call_id}
    if content is not None and not isinstance(content, str):
        raise StructuredRequestError(f"{where}.content must be a string or null", f"{where}.content")
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise StructuredRequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    kept = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls.[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise StructuredRequestError(
                f"{at} must be a function call with a name and its arguments (a JSON string)", at
            )
        kept.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return {"role": "assistant", "content": content or "", "tool_calls": kept}
