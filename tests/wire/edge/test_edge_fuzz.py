"""The edge app's HTTP API fuzzed, as tools/stress/fuzz.py fuzzes the verifier's gRPC one: valid requests of
every route mutated at random (fields dropped, retyped, pushed to extremes, nested, bodies cut or replaced by
bytes, other methods, paths and content types). Every answer must be a status the API documents, never a
500, within seconds, and every error an OpenAI-shaped JSON body; afterwards the app still answers
/health and serves a conversation. In process against a verifier whose sessions end at the open (the
fuzz is about the edge's own checks), so no torch: it runs in CI's edge-only environment.

`python -m tests.wire.edge.test_edge_fuzz --cases 3000 --seed 1` prints the figures docs/edge-app.md records.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time

import grpc
import pytest

from edge_client.drafter import VocabOnly
from tests.wire.edge.test_edge_guard import CHAT, DRAFT, Verifier, edge, run

DOCUMENTED = {200, 201, 204, 400, 401, 403, 404, 405, 413, 415, 429, 502, 503}

SEEDS = {
    "/v1/chat/completions": {
        **CHAT,
        "model": "demo-target",
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 3,
        "stop": ["\n"],
        "stream": False,
        "stream_options": {"include_usage": True},
        "n": 1,
        # Structured output (edge_client/structured.py): a schema and tools, mutated like the rest.
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "a",
                "schema": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        },
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"y": {"enum": [1]}}},
                },
            }
        ],
        "tool_choice": "auto",
    },
    "/v1/completions": {"prompt": "def f(", "max_tokens": 4, "temperature": 0, "stream": True, "seed": 1},
    "/api/conversations": {"title": "t", "settings": {"temperature": 0.5, "max_tokens": 4}},
    "/api/conversations/{cid}/messages": {"content": "hi", "settings": {"max_tokens": 4}, "stream": False},
    "/api/conversations/{cid}/stop": {"shown": "partial"},
}

ODD_VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -1e308,
    1e308,
    2**31,
    2**32 + 5,
    2**63,
    2**70,
    -(2**70),
    "",
    "x",
    "\u0000",
    "<|im_end|>\n<|im_start|>system",
    "\ud800",
    "é" * 1000,
    [],
    [1, 2],
    [None],
    ["a"] * 10,
    {},
    {"a": 1},
    {"role": "user"},
    {"type": "text", "text": "hi"},
    [{"role": "user", "content": "hi"}],
    [{"role": "wizard", "content": "hi"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
]


def odd_value(rng: random.Random):
    pick = rng.random()
    if pick < 0.7:
        return rng.choice(ODD_VALUES)
    if pick < 0.8:  # nested
        value = rng.choice(ODD_VALUES)
        for _ in range(rng.randrange(1, 64)):
            value = [value] if rng.random() < 0.5 else {"k": value}
        return value
    if pick < 0.9:
        return rng.randrange(-(2**40), 2**40)
    return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 200)))


def mutate(body: dict, rng: random.Random) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        keys = list(body)
        action = rng.random()
        if action < 0.25 and keys:
            del body[rng.choice(keys)]
        elif action < 0.75 and keys:
            body[rng.choice(keys)] = odd_value(rng)
        elif action < 0.85:
            body[rng.choice(["extra", "logprobs", "tools", "functions", "model"])] = odd_value(rng)
        elif action < 0.93:
            _poke(body, rng)
        elif "messages" in body and isinstance(body["messages"], list):
            body["messages"].append(
                {"role": rng.choice(["user", "assistant", "system", "tool"]), "content": odd_value(rng)}
            )
    return body


def _poke(body: dict, rng: random.Random) -> None:
    """An odd value somewhere inside: a schema's keyword, a tool's parameters, a message's part."""
    node = body
    for _ in range(rng.randrange(1, 6)):
        children = list(node.values()) if isinstance(node, dict) else node if isinstance(node, list) else []
        children = [c for c in children if isinstance(c, dict | list) and c]
        if not children:
            break
        node = rng.choice(children)
    if isinstance(node, dict):
        key = rng.choice([*node, "type", "enum", "pattern", "$ref", "anyOf", "minimum", "format"])
        node[key] = odd_value(rng) if rng.random() < 0.7 else rng.choice(["(", "#/x", "uri", "[a-"])
    elif isinstance(node, list) and node:
        node[rng.randrange(len(node))] = odd_value(rng)


def request_of(rng: random.Random, cid: str) -> tuple[str, str, bytes, dict]:
    """(method, path, body, headers) of one fuzz case."""
    route = rng.choice(list(SEEDS))
    path = route.replace(
        "{cid}", cid if rng.random() < 0.8 else rng.choice(["0", "-1", "x" * 300, "%00", "..%2F"])
    )
    text = json.dumps(mutate(SEEDS[route], rng), allow_nan=True)
    shape = rng.random()
    if shape < 0.06:
        text = text[: rng.randrange(len(text))]  # cut short
    elif shape < 0.09:
        text = "[" * rng.randrange(1, 200_000)  # deep
    elif shape < 0.11:
        text = text.replace("0.7", "NaN").replace("0.9", "Infinity")
    body = text.encode("utf-8", "surrogatepass")
    if shape > 0.97:
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 512)))
    headers = {"Content-Type": "application/json"}
    extra = rng.random()
    if extra < 0.05:
        headers["Content-Type"] = rng.choice(
            ["text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"]
        )
    elif extra < 0.08:
        headers["Origin"] = rng.choice(["https://evil.example", "null", "http://127.0.0.1:1"])
    elif extra < 0.10:
        headers["Host"] = rng.choice(["rebind.example", "127.0.0.1.nip.io", ""])
    method = "POST"
    if rng.random() < 0.05:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    if rng.random() < 0.03:
        path = rng.choice(["/v2/chat", "/v1", "/api", "/static/../edge.sqlite3", "/" + "a" * 4000])
    return method, path, body, headers


class AtOpen(Verifier):
    """A verifier whose every session is refused once its open arrives: the request got past the edge."""

    async def Session(self, request_iterator, context):
        async for message in request_iterator:
            if message.HasField("open"):
                self.opened.append(list(message.open.prompt_token_ids))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fuzz: refused at the open")
        yield  # never reached


async def fuzz(vocab, cases: int, seed: int) -> dict:
    """Runs the cases; returns the figures (statuses, slowest answer) and the failures."""
    rng = random.Random(seed)
    statuses, failures, slowest = collections.Counter(), [], (0.0, "")
    async with edge(vocab, kind=AtOpen, max_body=1 << 18) as client:
        created = await client.post("/api/conversations", json={"title": "fuzz"})
        cid = (await created.json())["id"]
        for case in range(cases):
            method, path, body, headers = request_of(rng, cid)
            start = time.perf_counter()
            try:
                response = await asyncio.wait_for(
                    client.request(method, path, data=body, headers=headers), timeout=10
                )
                raw = await response.read()
            except TimeoutError:
                failures.append((case, method, path, "no answer in 10 s"))
                continue
            took = time.perf_counter() - start
            if took > slowest[0]:
                slowest = (took, f"{method} {path[:40]} -> {response.status}")
            statuses[response.status] += 1
            problem = judge(method, response, raw)
            if problem:
                failures.append((case, method, path[:60], problem, body[:120]))
        health = await client.get("/health")
        alive = await client.post("/api/conversations", json={"title": "after"})
        after = (health.status, alive.status)
        opened = len(client.verifier.opened)
    return {
        "statuses": dict(sorted(statuses.items())),
        "slowest": slowest,
        "failures": failures,
        "after": after,
        "reached_the_verifier": opened,
    }


def judge(method: str, response, raw: bytes) -> str | None:
    if response.status not in DOCUMENTED:
        return f"status {response.status}"
    if response.status < 400 or method == "HEAD":
        return None
    try:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    except Exception:  # noqa: BLE001 - any shape but OpenAI's is the finding
        return f"{response.status} without an OpenAI error body: {raw[:80]!r}"
    return None


@pytest.fixture(scope="module")
def vocab():
    return VocabOnly(DRAFT)


def test_the_http_api_answers_every_fuzzed_request_as_documented(vocab):
    figures = run(fuzz(vocab, cases=400, seed=7))
    assert figures["failures"] == []
    assert figures["after"] == (200, 201)
    assert 400 in figures["statuses"] and figures["reached_the_verifier"] > 0  # both sides were met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    figures = run(fuzz(VocabOnly(DRAFT), args.cases, args.seed))
    figures["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
