"""From parsed flags to the typed configs the product runs with: sampling, limits, timeouts, credentials,
TLS and tokens, the chat and the edge app. Each raises UserError, said in one line, for flags that cannot
work together or files that cannot be read."""

from __future__ import annotations

import os
import secrets
import sys

import grpc

from draftwire import wire
from draftwire.contract import SamplingParams
from draftwire_cli.flags import UserError


def calibration_dir() -> str:
    """Where a verifier keeps its timings of round sizes between starts: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "draftwire", "calibration")


def reason(error: BaseException) -> str:
    """An exception's message on one line (an OSError's without its errno)."""
    text = (error.strerror if isinstance(error, OSError) and error.strerror else str(error)) or type(
        error
    ).__name__
    return " ".join(text.split())


def limits(args):
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
        max_refused_opens_per_s=args.max_refused_opens_per_s,
    )
    return admission, LifetimeConfig(args.idle_timeout_s, args.max_session_age_s, args.drain_timeout_s)


def verifier_limits(args):
    from verifier_service.settings import VerifierLimits

    return VerifierLimits(
        max_gamma=args.max_gamma, read_ahead=args.thin_read_ahead, thin_sessions=args.thin_sessions
    )


def batch(args):
    """serve's BatchConfig from its flags."""
    from verifier_service.settings import BatchConfig

    return BatchConfig(
        max_batch=args.max_batch,
        window_s=args.batch_window_ms / 1000,
        max_prefill_positions=args.max_prefill_positions,
        prefill_share=args.prefill_share,
        min_prefill_positions=args.min_prefill_positions,
        max_prefill_s=args.max_prefill_s,
        calibrate=not args.no_calibrate,
        calibration_dir=calibration_dir(),
    )


def prefix_cache(args):
    from verifier_service.settings import PrefixCacheConfig

    return PrefixCacheConfig(int(args.prefix_cache_mb * (1 << 20)), args.prefix_cache_ttl)


def timeouts(args):
    from edge_client.session import Timeouts

    return Timeouts(verdict_s=args.verdict_timeout_s or None, resume_s=args.resume_timeout_s)


def credentials(args) -> wire.ClientCredentials:
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
            raise UserError(f"--token-file {args.token_file}: cannot read it: {reason(e)}") from None
        if not token or len(token.split()) != 1:
            raise UserError(f"--token-file {args.token_file}: expected one token (and nothing else) in it")
    try:
        return wire.ClientCredentials.from_files(args.tls_ca, args.tls_cert, args.tls_key, token)
    except (OSError, ValueError) as e:
        raise UserError(f"{e}") from None


def server_security(args):
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


def sampling(args) -> SamplingParams:
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
            min_p=args.min_p,
            seed=seed,
            logit_bias=tuple(args.logit_bias),
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        ).validate()
    except ValueError as e:
        raise UserError(str(e)) from None


def constraint(args):
    """The --json-object / --json-schema / --grammar / --regex constraint, or None. Raises UserError for a
    file it cannot read."""
    from draftwire.contract import Constraint, ConstraintKind

    if getattr(args, "json_object", False):
        return Constraint(ConstraintKind.JSON_OBJECT)
    if getattr(args, "regex", None) is not None:
        return Constraint(ConstraintKind.REGEX, args.regex)
    for name, kind in (("json_schema", ConstraintKind.JSON_SCHEMA), ("grammar", ConstraintKind.GRAMMAR)):
        path = getattr(args, name, None)
        if path is not None:
            try:
                return Constraint(kind, path.read_text())
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"--{name.replace('_', '-')} {path}: {e}") from None
    return None


def chat_config(args):
    from edge_client.chat import ChatConfig

    return ChatConfig(
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling(args),
        pipeline=args.pipeline,
        ignore_eos=args.ignore_eos,
    )


def edge_config(args, server: str):
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
        credentials=credentials(args),
        **edge_safety(args),
    )


def edge_safety(args) -> dict:
    """The edge app's Host, Origin and API key settings, its body and queue limits (edge_client.guard)."""
    from edge_client.guard import Guard, read_api_key

    if not hasattr(args, "allowed_hosts"):
        return {}
    try:
        key = read_api_key(args.api_key_file)
    except (OSError, ValueError) as e:
        why = reason(e) if isinstance(e, OSError) else e
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


def explain(error, credentials: wire.ClientCredentials) -> str:
    """A VerifierError's or an AioRpcError's status, said with what it likely means for this client."""
    if isinstance(error, grpc.aio.AioRpcError):
        return wire.explain(error.code(), error.details() or "", credentials)
    return wire.explain(error.code, error.details, credentials)
