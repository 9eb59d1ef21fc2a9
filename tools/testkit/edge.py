"""An edge's requests against a test's server: the drive most exactness tests share."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from draftwire import wire
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats


def run_requests(
    address: str, drafter, requests: Sequence[GenerationRequest]
) -> list[tuple[list[int], GenerationStats]]:
    """The requests one after another through one edge session on one plaintext channel to `address`:
    what each generated, with its stats."""

    async def run():
        async with wire.insecure_channel(address) as channel:
            session = EdgeSession(channel, drafter)
            return [await session.run(r) for r in requests]

    return asyncio.run(run())
