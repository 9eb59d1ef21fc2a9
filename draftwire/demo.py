"""`draftwire demo`: a verifier on a free loopback port and a chat against it, in one process."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

from draftwire.modelkit import build_test_pair
from edge_client.chat import ChatConfig, chat
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession
from verifier_service.engine import TargetEngine
from verifier_service.servicer import ServerConfig, start_server

# Until the trained demo pair is committed, the demo builds the small random pair that the tests use.
DEFAULT_PAIR_DIR = Path.home() / ".cache" / "draftwire" / "demo-pair"


def demo_pair(models: Path | None) -> tuple[Path, Path]:
    """(target directory, draft GGUF) of the demo; builds the pair when it is missing."""
    pair = build_test_pair(models or DEFAULT_PAIR_DIR)
    return pair.target_dir, pair.draft_q4_0


async def run_demo(models: Path | None, config: ChatConfig, prompt: str | None) -> int:
    target_dir, draft_path = demo_pair(models)
    engine = TargetEngine.load(target_dir)
    server, port = await start_server(engine, ServerConfig(port=0))
    address = f"127.0.0.1:{port}"
    print(f"draftwire demo: verifier for {engine.info.target_id} on {address}, draft {draft_path.name}")
    try:
        drafter = LlamaDrafter(DrafterConfig(draft_path))
        async with grpc.aio.insecure_channel(address) as channel:
            await chat(EdgeSession(channel, drafter), config, sys.stdout, once=prompt)
    finally:
        await server.stop(grace=1.0)
    return 0
