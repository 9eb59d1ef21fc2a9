"""An edge's requests against a test's server: the drive most exactness tests share."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from draftwire import wire
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, Timeouts

# A tool in OpenAI's shape that the edge app's structured-output tests offer (the demo pair's and Qwen's).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

# A test's edge waits long for a verdict: a busy machine (CI's two files at a time) once kept the first
# verdict of a Gemma session past the product's 60 s, which reads a slow verifier as a hung one.
PATIENT = Timeouts(verdict_s=600.0)


def run_requests(
    address: str, drafter, requests: Sequence[GenerationRequest]
) -> list[tuple[list[int], GenerationStats]]:
    """The requests one after another through one edge session on one plaintext channel to `address`:
    what each generated, with its stats."""

    async def run():
        async with wire.insecure_channel(address) as channel:
            session = EdgeSession(channel, drafter, PATIENT)
            return [await session.run(r) for r in requests]

    return asyncio.run(run())
