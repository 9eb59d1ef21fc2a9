"""`draftwire demo`: a verifier on a free loopback port and a chat against it, in one process; with
`--web`, the edge app (its web page and OpenAI-compatible API) instead of the terminal chat."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

from edge_client.chat import ChatConfig, chat
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.llama_runtime import load_backends
from edge_client.session import EdgeSession
from verifier_service.engine import TargetEngine
from verifier_service.servicer import ServerConfig, start_server


async def run_demo(engine: TargetEngine, draft_path: Path, config: ChatConfig, prompt: str | None) -> int:
    """The terminal chat against a verifier of `engine` (the target of the pair the caller found)."""
    server, port = await start_server(engine, ServerConfig(port=0))
    address = f"127.0.0.1:{port}"
    print(f"draftwire demo: verifier for {engine.info.target_id} on {address}, draft {draft_path.name}")
    print(f"draftwire demo: {load_backends().summary}")
    try:
        drafter = LlamaDrafter(DrafterConfig(draft_path))
        async with grpc.aio.insecure_channel(address) as channel:
            await chat(EdgeSession(channel, drafter), config, sys.stdout, once=prompt)
    finally:
        await server.stop(grace=1.0)
    return 0


async def run_web_demo(engine: TargetEngine, draft_path: Path, port: int) -> int:
    from edge_client.app import EdgeConfig, default_store, serve

    server, grpc_port = await start_server(engine, ServerConfig(port=0))
    address = f"127.0.0.1:{grpc_port}"
    print(f"draftwire demo: verifier for {engine.info.target_id} on {address}, draft {draft_path.name}")
    print(f"draftwire demo: {load_backends().summary}")
    try:
        drafter = LlamaDrafter(DrafterConfig(draft_path))

        def ready(url: str, model: str | None = None) -> None:
            print(f"draftwire demo: open {url} (OpenAI API at {url}v1, model {model})", flush=True)

        await serve(
            EdgeConfig(address, store_path=default_store()),
            drafter,
            "127.0.0.1",
            port,
            draft_path.name,
            ready,
        )
    finally:
        await server.stop(grace=1.0)
    return 0
