"""`draftwire demo`: a verifier on a free loopback port and a chat against it, in one process."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

from edge_client.chat import ChatConfig, chat
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession
from tools.models.demopair.files import DEFAULT_OUT, PairFiles
from verifier_service.engine import TargetEngine
from verifier_service.servicer import ServerConfig, start_server

# The draft the demo runs: chosen by the card's acceptance and speed (models/demo/model_card.md).
DEMO_DRAFT = "q8_0"


def demo_pair(models: Path | None, draft_kind: str = DEMO_DRAFT) -> tuple[Path, Path]:
    """(target directory, draft GGUF) of a pair built by `draftwire models build` (default: the
    committed one). Raises FileNotFoundError naming the command that builds it."""
    files = PairFiles(models or DEFAULT_OUT)
    if not (files.target / "config.json").is_file() or not files.gguf(draft_kind).is_file():
        raise FileNotFoundError(
            f"no model pair in {files.root}: run `draftwire models build --out {files.root}`"
        )
    return files.target, files.gguf(draft_kind)


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
