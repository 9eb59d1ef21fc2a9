"""`draftwire demo`: a verifier on a free loopback port and a chat against it, in one process; with
`--web`, the edge app (its web page and OpenAI-compatible API) instead of the terminal chat."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc

from draftwire import cpus
from draftwire_cli import configs, sharing
from draftwire_cli.serving import say_calibration
from edge_client.chat import ChatConfig, chat
from edge_client.llama_runtime import load_backends
from edge_client.session import EdgeSession
from verifier_service.batcher import BatchConfig
from verifier_service.engine import TargetEngine
from verifier_service.servicer import ServerConfig, start_server


def _server_config() -> ServerConfig:
    """A verifier on a free loopback port that keeps its timings of round sizes for the next demo."""
    return ServerConfig(port=0, batch=BatchConfig(calibration_dir=configs.calibration_dir()))


async def _start_verifier(engine: TargetEngine):
    """The demo's verifier, started; says first where the start times the round sizes (once a machine,
    target and dtype: seconds, tens of them on a 1.5B target)."""
    config = _server_config()
    say_calibration(engine, config)
    return await start_server(engine, config)


async def share_the_machine(engine: TargetEngine, draft_path: Path):
    """The drafter on its share of this process's CPUs, the target alone's speed measured on all of
    them (before they are divided), and the rest given to the verifier (draftwire_cli.sharing).
    Returns the drafter, the prompt to measure speculation with, and the division."""
    split = cpus.split(cpus.usable())
    drafter = sharing.load_drafter(draft_path, split)
    prompt = await sharing.prompt_ids(engine, drafter)
    # Seconds on a small target, 15 s or more on a 1.5B one on 2 cores: said, not silent.
    print(
        f"draftwire demo: timing the target alone ({sharing.STEPS + 1} tokens, for a {sharing.TOKENS}-token "
        "reply), to compare speculation with",
        flush=True,
    )
    alone, threads = sharing.target_alone(engine, prompt)
    sharing.divide(split)
    return drafter, prompt, lambda tps: sharing.Measured(tps, alone, threads, sharing.TOKENS, split)


async def run_demo(engine: TargetEngine, draft_path: Path, config: ChatConfig, prompt: str | None) -> int:
    """The terminal chat against a verifier of `engine` (the target of the pair the caller found)."""
    print(f"draftwire demo: {load_backends().summary}")
    drafter, measure_prompt, measured = await share_the_machine(engine, draft_path)
    server, port = await _start_verifier(engine)
    address = f"127.0.0.1:{port}"
    print(f"draftwire demo: verifier for {engine.info.target_id} on {address}, draft {draft_path.name}")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            session = EdgeSession(channel, drafter)
            speed = await sharing.speculation(session, measure_prompt, config)
            print(f"draftwire demo: {measured(speed).line()}", flush=True)
            await chat(session, config, sys.stdout, once=prompt)
    finally:
        await server.stop(grace=1.0)
    return 0


async def run_web_demo(engine: TargetEngine, draft_path: Path, port: int) -> int:
    from edge_client.app import EdgeConfig, default_store, serve

    print(f"draftwire demo: {load_backends().summary}")
    drafter, measure_prompt, measured = await share_the_machine(engine, draft_path)
    server, grpc_port = await _start_verifier(engine)
    address = f"127.0.0.1:{grpc_port}"
    print(f"draftwire demo: verifier for {engine.info.target_id} on {address}, draft {draft_path.name}")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            speed = await sharing.speculation(EdgeSession(channel, drafter), measure_prompt, ChatConfig())
        print(f"draftwire demo: {measured(speed).line()}", flush=True)

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
