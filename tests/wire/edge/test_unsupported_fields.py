"""A request field the edge app does not implement is 400 naming it, never dropped silently; min_p is
read and reaches the session's sampling. In process, no torch (CI's edge-only environment runs it too)."""

from __future__ import annotations

import pytest

from edge_client.openai_api import Settings, parse_chat, parse_completion
from tests.wire.edge.test_edge_guard import CHAT, edge, honest_info, post, run, vocab  # noqa: F401


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/chat/completions", {**CHAT, "typical_p": 0.9}, "typical_p"),
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {**CHAT, "prompt": "hi"}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "messages": []}, "messages"),
        ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, "min_p"),
    ],
)
def test_a_field_the_app_does_not_implement_is_400_naming_it(vocab, route, body, param):  # noqa: F811
    async def go():
        async with edge(vocab, info=honest_info(vocab, max_context=1000)) as client:
            status, reply, _ = await post(client, route, body)
            assert status == 400, reply
            assert reply["error"]["param"] == param and param in reply["error"]["message"]
            assert client.verifier.opened == []  # refused before anything was drafted or sent

    run(go())


def test_labels_are_taken_and_min_p_reaches_the_sampling():
    request = parse_chat({**CHAT, "user": "u1", "metadata": {"k": "v"}, "min_p": 0.1}, Settings())
    assert request.settings.min_p == 0.1 and request.settings.sampling().min_p == 0.1
    assert parse_completion({"prompt": "hi", "min_p": 0.2}, Settings()).settings.sampling().min_p == 0.2
    assert Settings.from_json(request.settings.as_json()) == request.settings
    assert Settings.from_json({}).min_p == 0.0  # a conversation stored before min_p
