"""Structured output through `draftwire edge` with the official `openai` client: JSON mode, JSON schemas
(`chat.completions.parse` with a pydantic model), tools and tool calls, streamed and not, the follow-up turn
with the calls' results, and bad schemas refused naming the field. The demo pair's template renders no
tools: the app offers them in a system message (edge_client/structured.py). Runs in CI's edge-only
environment too (no torch).
"""

import json
import os
import subprocess
from pathlib import Path
from typing import Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tools.rig.serverproc import DRAFTWIRE, EdgeProcess, ServerProcess
from tools.testkit.edge import WEATHER

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo"
DRAFT = DEMO / "draft-q8_0.gguf"
EDGE = DRAFTWIRE
VERIFIER = os.environ.get("DRAFTWIRE_VERIFIER") or EDGE
ASK = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def verifier():
    with ServerProcess(DEMO / "target", executable=VERIFIER) as server:
        yield server


@pytest.fixture(scope="module")
def client(verifier, tmp_path_factory):
    db = tmp_path_factory.mktemp("edge") / "edge.sqlite3"
    with EdgeProcess(
        verifier.address, DRAFT, "--gamma", "4", "--pipeline", "1", db=db, executable=EDGE
    ) as app:
        yield OpenAI(base_url=app.url + "v1", api_key="unused")


def test_json_mode_replies_with_a_json_object(client):
    reply = client.chat.completions.create(
        model="demo-target",
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    text = choice.message.content
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: the valid prefix of an object
        assert choice.finish_reason == "length" and text.startswith("{")


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_parse_with_a_pydantic_model_gives_the_object(client, temperature):
    reply = client.chat.completions.parse(
        model="demo-target",
        messages=ASK,
        response_format=Answer,
        max_tokens=40,
        temperature=temperature,
        seed=3,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Answer) and reply.choices[0].finish_reason == "stop"


def test_a_schema_reply_is_the_same_streamed_or_not(client):
    strict = {**Answer.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict mode has it
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": strict, "strict": True}}
    args = dict(
        model="demo-target", messages=ASK, response_format=schema, max_tokens=40, temperature=0.7, seed=11
    )
    whole = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices
    )
    assert streamed == whole
    Answer.model_validate_json(whole)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tools_required_or_named_give_tool_calls(client, choice):
    reply = client.chat.completions.create(
        model="demo-target",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=80,
        temperature=0,
    )
    c = reply.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome", "Oslo") and arguments["unit"] in ("C", "F")
        else:
            assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
    if isinstance(choice, dict):
        assert [call.function.name for call in c.message.tool_calls] == ["get_time"]


def test_streamed_tool_calls_come_as_openais_deltas(client):
    args = dict(
        model="demo-target",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (w.function.name, json.loads(w.function.arguments)) for w in whole
    ]


def test_a_tool_result_continues_the_conversation(client):
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    first = client.chat.completions.create(
        model="demo-target",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model="demo-target", messages=messages, tools=[WEATHER], max_tokens=20, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_offers_no_tool(client):
    reply = client.chat.completions.create(
        model="demo-target", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=10, temperature=0
    )
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_structured_fields_are_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="demo-target", messages=ASK, max_tokens=5, extra_body=fields)
    assert raised.value.body["param"] == param


def test_cli_generate_under_a_schema_equals_reference(verifier, tmp_path):
    """`generate --json-schema FILE` over the wire, greedy and seeded, at two γ: the tokens of `reference
    --json-schema FILE` (the target alone)."""
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps({**Answer.model_json_schema(), "additionalProperties": False}))
    common = ["--prompt", "Is water wet?", "--max-new-tokens", "30", "--json-schema", str(schema), "--json"]
    for sampling in ([], ["--temperature", "0.9", "--seed", "5"]):
        ref = _cli(VERIFIER, "reference", "--target", str(DEMO / "target"), *common, *sampling)
        for gamma in ("1", "4"):
            argv = ["generate", "--server", verifier.address, "--draft", str(DRAFT), "--gamma", gamma]
            out = _cli(EDGE, *argv, "--pipeline", "1", *common, *sampling)
            assert out["token_ids"] == ref["token_ids"], (gamma, sampling)
        Answer.model_validate_json(ref["text"])


def _cli(executable: str, *argv: str) -> dict:
    out = subprocess.run([executable, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
