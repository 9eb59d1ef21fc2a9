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
from tools.models.demopair.files import PairFiles
from verifier_service.engine import TargetEngine
from verifier_service.servicer import ServerConfig, start_server

# Which draft of a pair the demo runs, the first that the pair has: SmolLM2's shipped Q4_1 file, the demo
# pair's q8_0 (chosen by their cards' acceptance and speed).
DRAFT_PREFERENCE = ("q4_1", "q8_0", "q4_0", "f16")
DEMO_DRAFT = "q8_0"  # the committed demo pair's


def demo_pair(models: Path | None) -> tuple[Path, Path]:
    """(target directory, draft GGUF) of a pair directory, or of a fetched pair named by `draftwire
    models fetch NAME` (`smollm2`, the default; tools/models/pairs.py's); `models/demo` is the committed
    small pair. The draft is the first of DRAFT_PREFERENCE the pair has, else its only `draft-*.gguf`. Raises
    FileNotFoundError naming the command that makes the pair."""
    from tools.models import chunks, smollm2
    from tools.models.pairs import PAIRS

    fetched = {"smollm2": smollm2.default_dir(), **{n: chunks.default_dir(p) for n, p in PAIRS.items()}}
    name = "smollm2" if models is None else str(models)
    root = fetched[name] if name in fetched and not Path(name).is_dir() else Path(models)
    files = PairFiles(root)
    drafts = [files.gguf(kind) for kind in DRAFT_PREFERENCE if files.gguf(kind).is_file()]
    drafts = drafts or sorted(root.glob("draft-*.gguf"))
    if not (files.target / "config.json").is_file() or not drafts:
        make = f"draftwire models fetch {name}" if name in fetched else f"draftwire models build --out {root}"
        raise FileNotFoundError(f"no model pair in {files.root}: run `{make}`")
    return files.target, drafts[0]


async def run_demo(engine: TargetEngine, draft_path: Path, config: ChatConfig, prompt: str | None) -> int:
    """The terminal chat against a verifier of `engine` (loaded by the caller, `demo_pair`'s target)."""
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
