"""The `draftwire` command's vocabulary of flags: value types that say a bad value in one line, and the
groups of flags several commands share (prompt, sampling, speculation, limits, security, the edge app)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from draftwire.contract import SamplingParams
from draftwire_cli.cliargs import id_list

# γ = 4 with two proposals in flight: the best greedy-and-sampled fixed setting of `draftwire bench` on
# the SmolLM2 pair on the two-device rig (docs/runs/benchmarks-history.md); pipelining is what hides a
# round trip.
# The load test's defaults. generate, chat, demo and edge choose both online unless told
# (edge_client/adaptive.py), starting from these.
GAMMA = 4
PIPELINE = 2
PIPELINE_HELP = "proposals sent ahead of their verdicts (hides round trips; 0: wait for each verdict)"


def default_of(config: type, name: str):
    """A config dataclass field's default: the flag that sets the field takes it, so it is written once
    (tests/unit/test_cli_defaults.py builds every config from a bare command line)."""
    (found,) = (f for f in dataclasses.fields(config) if f.name == name)
    return found.default


class UserError(Exception):
    """A mistake of the user's or a failure to say in one line: `draftwire: MESSAGE`, exit `status`
    (2: the command line asks for something impossible, 1: it failed while running)."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`(default: X)` after the help of every flag that takes a value and has one by default."""

    def _get_help_string(self, action):
        if action.required or action.nargs == 0 or action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse that shows every flag's default in --help and says a usage mistake in one line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"draftwire: {message} (see `{self.prog} --help`)\n")


def bounded(kind, low=None, high=None, low_open: bool = False, what: str = ""):
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


count = bounded(int, 0, what="0 or more")


positive = bounded(int, 1, what="1 or more")


gpus = bounded(float, 0, what="0 or more GPUs")


seconds = bounded(float, 0, what="0 or more seconds")


megabytes = bounded(float, 0, what="0 or more MB")


share = bounded(float, 0, 1, low_open=True, what="above 0 and at most 1 (1: no per-client cap)")


def count_or_auto(text: str) -> int | None:
    """`auto` (None: derived from other limits) or a count."""
    return None if text == "auto" else count(text)


def budget_mb(text: str) -> float | None:
    """`auto` (None: sized from the memory available at start) or megabytes."""
    return None if text == "auto" else megabytes(text)


port = bounded(int, 0, 65535, what="a port is 0 (any free one) to 65535")


VERIFIER_PORT = 50051  # serve's --port, and that of a --server given without one
GRPC_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds")


def server_address(text: str) -> str:
    """--server: HOST:PORT, or HOST alone for serve's default port (gRPC alone would dial 443, HTTPS's);
    a gRPC target with a scheme (`dns:///h:p`, `unix:/path`) is taken as it is."""
    if text.split(":", 1)[0] in GRPC_SCHEMES:
        return text
    if text.startswith("["):  # [IPv6] or [IPv6]:PORT
        host, _, rest = text.partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
        host += "]"
    elif text.count(":") > 1:  # a bare IPv6 address
        host, port_text = f"[{text}]", None
    else:
        host, _, port_text = text.partition(":")
        port_text = port_text if ":" in text else None
    if not host.strip("[]"):
        raise argparse.ArgumentTypeError(f"{text!r} names no host: give HOST:PORT")
    if port_text is None:
        return f"{host}:{VERIFIER_PORT}"
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be 1 to 65535")
    return f"{host}:{int(port_text)}"


temperature = bounded(float, 0, what="0 (greedy) or more")


top_p = bounded(float, 0, 1, low_open=True, what="above 0 and at most 1 (1 keeps every token)")


min_p = bounded(float, 0, 1, what="0 (keeps every token) to 1")


seed = bounded(int, 0, (1 << 64) - 1, what="0 to 2**64 - 1")


penalty = bounded(float, -2, 2, what="-2 to 2")


gamma = bounded(int, 1, what="at least 1 draft token a round (leave --gamma out to have it chosen online)")


def add_prompt(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text, tokenized by this side's tokenizer")
    g.add_argument("--prompt-ids", type=id_list, help="prompt as comma-separated token ids")


def add_sampling(p: argparse.ArgumentParser, max_new_tokens: int = 64) -> None:
    p.add_argument(
        "--max-new-tokens",
        type=count,
        default=max_new_tokens,
        help="tokens to generate at most (0: to the context's end)",
    )

    def default(name):
        return default_of(SamplingParams, name)

    p.add_argument("--temperature", type=temperature, default=default("temperature"), help="0 is greedy")
    p.add_argument(
        "--top-k",
        type=count,
        default=default("top_k"),
        help="sample among the K likeliest tokens (0 keeps all)",
    )
    p.add_argument(
        "--top-p",
        type=top_p,
        default=default("top_p"),
        help="sample among the likeliest tokens of this total mass",
    )
    p.add_argument(
        "--min-p",
        type=min_p,
        default=default("min_p"),
        help="then among the tokens at least this fraction as likely as the likeliest (0 keeps all)",
    )
    p.add_argument(
        "--seed",
        type=seed,
        default=None,
        help="key of the sampling noise (unset: a random one, printed on stderr so the run can be repeated)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate max-new-tokens whatever the target says"
    )
    _add_penalties(p, default)


def _add_penalties(p: argparse.ArgumentParser, default) -> None:
    g = p.add_argument_group("penalties and bias (applied by the target, and the draft, at every position)")
    g.add_argument(
        "--frequency-penalty",
        type=penalty,
        default=default("frequency_penalty"),
        help="OpenAI's: minus this times a token's count among the generated ones; -2 to 2",
    )
    g.add_argument(
        "--presence-penalty",
        type=penalty,
        default=default("presence_penalty"),
        help="OpenAI's: minus this once a token was generated; -2 to 2",
    )
    g.add_argument(
        "--repetition-penalty",
        type=bounded(float, 0, 10, low_open=True, what="above 0 and at most 10 (1 is off)"),
        default=default("repetition_penalty"),
        help="transformers': a seen token's logit divided (negative: multiplied) by it; 1 is off",
    )
    g.add_argument(
        "--logit-bias",
        type=bias,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit; repeatable (-100 bans it)",
    )


def bias(text: str) -> tuple[int, float]:
    try:
        token, bias = text.split("=")
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not ID=BIAS (e.g. 13=-100): {text!r}") from None


def add_logprobs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--logprobs",
        type=bounded(int, 0, 20, what="0 to 20 alternatives"),
        default=None,
        metavar="K",
        help="with --json: each token's log-probability under the target and the K likeliest tokens'",
    )


def add_constraint(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "structured output (docs/edge-app.md#structured-output-and-tools)"
    ).add_mutually_exclusive_group()
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument(
        "--json-schema", type=Path, metavar="FILE", help="the output is JSON valid under this schema"
    )
    g.add_argument(
        "--grammar", type=Path, metavar="FILE", help="the output matches this Lark grammar (llguidance's)"
    )
    g.add_argument("--regex", metavar="RE", help="the output matches this regular expression")


def add_speculation(p: argparse.ArgumentParser) -> None:
    adaptive = "; unset: chosen online for the most tokens/s (adaptive)"
    p.add_argument("--gamma", type=gamma, default=None, help="draft tokens per round" + adaptive)
    p.add_argument("--pipeline", type=count, default=None, help=PIPELINE_HELP + adaptive)


def add_client_security(p: argparse.ArgumentParser) -> None:
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


def add_timeouts(p: argparse.ArgumentParser) -> None:
    from edge_client.session import Timeouts

    g = p.add_argument_group("waiting on the verifier")
    g.add_argument(
        "--resume-timeout-s",
        type=seconds,
        default=default_of(Timeouts, "resume_s"),
        help="after UNAVAILABLE, keep re-opening (with backoff) this long without progress",
    )
    g.add_argument(
        "--verdict-timeout-s",
        type=seconds,
        default=default_of(Timeouts, "verdict_s"),
        help="no verdict this long: the verifier is hung (0: wait)",
    )


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def add_edge_app(p: argparse.ArgumentParser) -> None:
    from edge_client.openai_api import Settings

    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP server")
    p.add_argument("--port", type=port, default=8080, help="0 picks a free port (printed)")
    p.add_argument(
        "--db", type=Path, default=None, help="conversations (default: $XDG_DATA_HOME/draftwire/edge.sqlite3)"
    )
    p.add_argument(
        "--threads", type=count, default=0, help="llama.cpp threads of the draft (0: one per CPU left free)"
    )
    p.add_argument(
        "--share-cpus",
        action="store_true",
        help="the verifier runs on this machine too (serve --share-cpus): draft on the draft's share of "
        "the CPUs, as demo divides them (docs/sharing.md)",
    )
    add_speculation(p)
    defaults = Settings()
    p.add_argument(
        "--max-tokens",
        type=positive,
        default=defaults.max_tokens,
        help="a reply's tokens when a request sets none",
    )
    p.add_argument(
        "--temperature", type=temperature, default=defaults.temperature, help="when a request sets none"
    )


def add_edge_safety(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-hosts",
        type=names,
        default=(),
        help="Host header names accepted besides loopback and the bound address (comma-separated; * any)",
    )
    p.add_argument(
        "--allowed-origins",
        type=names,
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
    from edge_client.config import EdgeConfig

    p.add_argument(
        "--max-body",
        type=positive,
        default=default_of(EdgeConfig, "max_body"),
        help="bytes of a request body",
    )
    p.add_argument(
        "--max-waiting",
        type=count,
        default=default_of(EdgeConfig, "max_waiting"),
        help="requests waiting for the draft; more get 429",
    )
    p.add_argument(
        "--model-alias",
        action="append",
        default=[],
        help="a name a request's model may give besides the target's own (repeatable)",
    )


def names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def add_thin(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--server-drafting",
        choices=("ngram", "none"),
        default="ngram",
        help="without --draft: the verifier drafts by prompt lookup (ngram) or decodes alone (none)",
    )
    p.add_argument("--vocab", type=Path, help="without --draft: a GGUF whose vocabulary tokenizes the text")


def add_chat(p: argparse.ArgumentParser) -> None:
    add_speculation(p)
    add_sampling(p, max_new_tokens=128)
