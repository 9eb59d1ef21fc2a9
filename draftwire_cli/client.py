"""`generate`, `reference`, `chat` and `edge`: the device's commands (and the target alone, to compare)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import grpc

from draftwire import jsonout, wire
from draftwire_cli import configs
from draftwire_cli.flags import UserError
from draftwire_cli.serving import load_target


def load_vocab(path: Path):
    from edge_client.drafter import VocabOnly

    return VocabOnly(path)


def load_drafter(path: Path, threads: int = 0, share_cpus: bool = False):
    """`share_cpus`: a verifier runs on this machine too; draft on the draft's share (draftwire.cpus)."""
    from draftwire import cpus
    from edge_client.drafter import DrafterConfig, LlamaDrafter
    from edge_client.llama_runtime import load_backends

    print(f"draftwire: {load_backends().summary}", file=sys.stderr, flush=True)
    split = cpus.split(cpus.usable())
    on = split.draft if share_cpus and not split.shared else ()
    if share_cpus:
        print(f"draftwire: {split.describe()}", file=sys.stderr, flush=True)
    return LlamaDrafter(DrafterConfig(model_path=path, n_threads=threads, cpus=on))


def _emit(args, token_ids: list[int], text: str, stats: dict, logprobs=()) -> None:
    if args.json:
        out = {"token_ids": token_ids, "text": text, "stats": stats}
        if args.logprobs is not None:  # one per token: its logprob, and the likeliest [id, logprob] pairs
            out["logprobs"] = [
                {"logprob": t.logprob, "top": [list(pair) for pair in t.top]} for t in logprobs
            ]
        print(jsonout.dumps(out))
    else:
        print(text)


def generate(args) -> int:
    from draftwire.contract import Drafting
    from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, VerifierError

    if args.prompt_ids is None and not (args.draft or args.vocab):
        raise UserError("without --draft, give --prompt-ids, or --vocab FILE.gguf to tokenize")
    credentials = configs.credentials(args)
    drafter = load_drafter(args.draft) if args.draft else None
    tokenizer = drafter or (load_vocab(args.vocab) if args.vocab else None)
    prompt = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer.tokenize(args.prompt))
    sampling = configs.sampling(args)

    tokens, stats = [], GenerationStats()  # what was committed stays here when the verifier fails
    logprobs: list = []
    stops: set[int] = set()  # the target's end-of-sequence ids, once known

    async def run() -> None:
        nonlocal prompt, stops
        async with wire.channel(args.server, credentials) as channel:
            vocabulary = tokenizer.vocabulary if tokenizer else None
            session = EdgeSession(channel, drafter, configs.timeouts(args), vocabulary=vocabulary)
            if args.chat:
                prompt = await _chat_turn(session, tokenizer, args.prompt)
            request = GenerationRequest(
                prompt,
                sampling,
                args.max_new_tokens,
                args.gamma,
                ignore_eos=args.ignore_eos,
                pipeline=args.pipeline,
                drafting=Drafting.EDGE if drafter else Drafting(args.server_drafting),
                top_logprobs=args.logprobs,
                constraint=configs.constraint(args),
            )
            async for _ in session.generate(request, stats, tokens, logprobs):
                pass
            stops = set((await session.model_info()).target.eos_token_ids)

    failed = None
    try:
        asyncio.run(run())
    except (VerifierError, grpc.aio.AioRpcError) as e:
        failed = e
    text = tokenizer.detokenize(tokens).decode("utf-8", "replace") if tokenizer else ""
    if failed is None or tokens:  # the committed text, even when the generation could not finish
        _emit(args, tokens, text, stats.as_json(), logprobs)
    if failed is not None:
        print(
            f"draftwire: generation stopped after {len(tokens)} committed tokens "
            f"({stats.resumes} resumes): {configs.explain(failed, credentials)}",
            file=sys.stderr,
        )
        return 1
    _notes(args, stats, tokens, stops)
    return 0


def _notes(args, stats, tokens: list[int], stops: set[int]) -> None:
    """What the user should know of a generation that succeeded, on stderr."""
    if stats.plain_steps or stats.legs:  # speculation did not pay for part of it (edge_client.adaptive)
        done = f"{stats.plain_steps} of {stats.rounds} rounds ran without speculation"
        if stats.legs:
            done = f"the verifier decoded {stats.server_tokens} of {stats.generated_tokens} tokens alone"
        print(
            f"draftwire: {done}; {stats.speculation_reason or 'speculation ' + stats.speculation}",
            file=sys.stderr,
        )
    if not args.ignore_eos and all(t in stops for t in tokens):  # nothing but an end-of-sequence
        hint = "" if args.chat else "; an instruct model may need --chat (its chat template)"
        print(f"draftwire: the target ended at once: no tokens generated{hint}", file=sys.stderr)


async def _chat_turn(session, tokenizer, text: str) -> tuple[int, ...]:
    """`text` as the user's turn in the target's chat template, as `chat` sends it."""
    from edge_client.chat import chat_prompt_async

    info = await session.model_info()
    if not info.target.chat_template:
        print("draftwire: the target has no chat template: --chat sends the plain prompt", file=sys.stderr)
    return tuple(await chat_prompt_async(info, tokenizer, [{"role": "user", "content": text}]))


def reference(args) -> int:
    from transformers import AutoTokenizer

    from draftwire.contract import SessionSpec
    from edge_client.planner import GenerationStats
    from verifier_service.session import SessionError, reference_decode

    engine = load_target(args)
    if engine is None:
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer(args.prompt)["input_ids"])
    spec = SessionSpec(
        prompt,
        configs.sampling(args),
        args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        top_logprobs=args.logprobs,
        constraint=configs.constraint(args),
    )
    start = time.perf_counter()
    logprobs: list = []
    try:
        tokens = reference_decode(engine, spec, logprobs)
    except SessionError as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return 1
    # The same figures as `generate --json`: one round per token, nothing drafted.
    stats = GenerationStats(
        rounds=len(tokens), generated_tokens=len(tokens), wall_s=time.perf_counter() - start
    )
    _emit(args, tokens, tokenizer.decode(tokens, skip_special_tokens=True), stats.as_json(), logprobs)
    return 0


def chat(args) -> int:
    from edge_client.chat import chat as chat_loop
    from edge_client.session import EdgeSession, VerifierError

    drafter = load_drafter(args.draft)
    credentials = configs.credentials(args)

    async def run() -> None:
        async with wire.channel(args.server, credentials) as channel:
            session = EdgeSession(channel, drafter, configs.timeouts(args))
            await chat_loop(session, configs.chat_config(args), sys.stdout)

    try:
        asyncio.run(run())
    except (VerifierError, grpc.aio.AioRpcError) as e:
        print(
            f"\ndraftwire: the reply stopped (its text so far is above): {configs.explain(e, credentials)}",
            file=sys.stderr,
        )
        return 1
    return 0


def edge(args) -> int:
    from draftwire.ports import check_free
    from edge_client.app import serve
    from edge_client.guard import UnsafeBind, is_loopback
    from edge_client.trust import UntrustedVerifier

    if not (args.draft or args.vocab):
        raise UserError("give --draft FILE.gguf, or for a thin device --vocab FILE.gguf")
    config = configs.edge_config(args, args.server)
    if not is_loopback(args.host) and config.guard.api_key is None and not args.public_without_key:
        raise UserError(
            f"refusing to listen on {args.host} without an API key: give --api-key-file FILE (or set "
            "$DRAFTWIRE_EDGE_API_KEY), or --public-without-key to do it anyway"
        )
    check_free(args.host, args.port)  # a busy port is said before the draft loads (serve checks again)
    drafter = (
        load_drafter(args.draft, args.threads, args.share_cpus) if args.draft else load_vocab(args.vocab)
    )
    name = args.draft.name if args.draft else f"none (thin, server drafting {args.server_drafting})"

    def ready(url: str, model: str | None = None) -> None:
        shown = model or "not known yet: the verifier is unreachable"
        print(f"draftwire edge: {url} (model {shown}, verifier {args.server}, draft {name})", flush=True)

    try:
        asyncio.run(serve(config, drafter, args.host, args.port, name, ready))
    except (UntrustedVerifier, UnsafeBind) as e:
        raise UserError(str(e)) from None
    return 0
