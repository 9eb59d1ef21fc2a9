"""The edge app's structured fields: response_format and tools read into constraints, tool calls read back
from a reply in OpenAI's shape, the content held back from a call's tag, and the messages given to a
template (edge_client/structured.py, through openai_api.parse_chat)."""

import json

import llguidance
import pytest

from draftwire.contract import ConstraintKind
from draftwire.grammar import grammar_source
from edge_client.openai_api import BadRequest, Settings, parse_chat
from edge_client.structured import (
    CALL_CLOSE,
    CALL_OPEN,
    Tools,
    held_back,
    parse_tools,
    split_tool_calls,
    template_messages,
)

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields):
    return parse_chat({"messages": USER, **fields}, Settings())


def test_response_formats_become_constraints():
    assert chat(response_format={"type": "text"}).constraint is None
    assert chat(response_format={"type": "json_object"}).constraint.kind is ConstraintKind.JSON_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    c = chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        }
    )
    assert c.constraint.kind is ConstraintKind.JSON_SCHEMA and json.loads(c.constraint.source) == schema


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "code"}]}, "tools.[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools.[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_structured_fields_name_the_field(fields, param):
    with pytest.raises(BadRequest) as raised:
        chat(**fields)
    assert raised.value.param == param


def test_required_and_named_tool_choices_constrain_to_calls():
    assert chat(tools=[WEATHER]).constraint is None  # auto: free, calls read afterwards
    assert chat(tools=[WEATHER], tool_choice="none").constraint is None
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        constraint = chat(tools=[WEATHER, TIME], tool_choice=choice).constraint
        assert constraint.kind is ConstraintKind.GRAMMAR
        assert llguidance.LLMatcher.validate_grammar(grammar_source(constraint)) == ""  # it compiles


def test_tool_calls_are_read_in_openais_shape():
    tools = parse_tools([WEATHER, TIME], "auto")
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = (
        f"Let me look.\n{CALL_OPEN}\n{weather}\n{CALL_CLOSE}\n"
        f'{CALL_OPEN}\n{{"name": "get_time", "arguments": {{}}}}\n{CALL_CLOSE}'
    )
    content, calls = split_tool_calls(text, tools)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_a_call_that_does_not_parse_or_names_no_tool_stays_text():
    tools = parse_tools([WEATHER], "auto")
    for text in (
        f"{CALL_OPEN}\n{{broken\n{CALL_CLOSE}",
        f'{CALL_OPEN}{{"name": "rm_rf", "arguments": {{}}}}{CALL_CLOSE}',
    ):
        assert split_tool_calls(text, tools) == (text, [])


def test_streamed_content_is_held_back_from_a_calls_tag():
    assert held_back("plain text") == len("plain text")
    assert held_back("text <tool") == len("text ")  # could still become the tag
    assert held_back(f"text {CALL_OPEN}") == len("text ")
    assert held_back("a < b") == len("a < b")


def test_assistant_calls_and_tool_results_are_accepted_and_given_to_the_template():
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
        }
    ]
    req = parse_chat(
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            ],
            "tools": [WEATHER],
        },
        Settings(),
    )
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    # A template that renders tools gets them, and the arguments as an object.
    messages, offered = template_messages(list(req.messages), req.tools, "{% for t in tools %}{% endfor %}")
    assert offered == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    # One that does not gets them in a system message of their own.
    messages, offered = template_messages(list(req.messages), req.tools, "{{ messages }}")
    assert offered == [] and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "x"},  # no tool_call_id
        {"role": "tool", "tool_call_id": "a", "content": 3},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},  # no arguments
        {"role": "assistant", "tool_calls": "f()"},
    ],
)
def test_bad_tool_messages_are_400(message):
    with pytest.raises(BadRequest):
        parse_chat({"messages": [*USER, message]}, Settings())


def test_parallel_tool_calls_false_allows_one_call():
    several = chat(tools=[WEATHER, TIME], tool_choice="required").constraint.source
    one = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).constraint.source
    assert "call)*" in several and "call)*" not in one
    with pytest.raises(BadRequest):
        chat(tools=[WEATHER], parallel_tool_calls="yes")


def test_tools_named_offer_that_one():
    assert [t["function"]["name"] for t in Tools((WEATHER, TIME), "function", "get_time").offered] == [
        "get_time"
    ]
    assert Tools((WEATHER,), "none").offered == ()
