"""`serve` (one verifier, or a Ray pool with --ray), `loadtest` and `top`: the operator's commands."""

from __future__ import annotations

import asyncio
import sys

import grpc

from draftwire import cpus, jsonout, wire
from draftwire_cli import configs
from draftwire_cli.flags import UserError


def serve(args) -> int:
    from draftwire.ports import check_free

    tls, auth = configs.server_security(args)
    # A busy port is said before torch and the target load (the server checks again when it binds).
    check_free(args.host, args.port)
    if args.metrics_port is not None:
        check_metrics_flags(args)
    if args.metrics_port:
        check_free(args.metrics_host, args.metrics_port)

    from verifier_service.gamma_cap import CapConfig
    from verifier_service.grpc_kit import ServerConfig

    admission, lifetime = configs.limits(args)
    config = ServerConfig(
        args.host,
        args.port,
        args.max_message_bytes,
        configs.verifier_limits(args),
        configs.batch(args),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metrics_token_file=args.metrics_token_file,
        prefix_cache=configs.prefix_cache(args),
        tls=tls,
        auth=auth,
        admission=admission,
        lifetime=lifetime,
        gamma_cap=CapConfig(enabled=not args.no_gamma_cap),
    )
    if args.ray:
        return _serve_pool(args, config)
    if args.share_cpus:  # before torch loads: its threads, and every thread started after, take them
        split = cpus.split(cpus.usable())
        print(f"draftwire: {split.describe()}", file=sys.stderr, flush=True)
        if not split.shared:
            cpus.pin(split.verifier)
            args.threads = args.threads or len(split.verifier)
    engine = load_target(args)
    if engine is None:
        return 2
    from verifier_service.grpc_kit import run_until_signal

    run_until_signal(lambda stop: _serve_until_signal(engine, config, stop))
    return 0


def check_metrics_flags(args) -> None:
    """Raises UserError for an empty --metrics-host or an unreadable --metrics-token-file."""
    from draftwire import metrics

    if not args.metrics_host:
        raise UserError(metrics.EMPTY_HOST)
    if args.metrics_token_file is not None:
        try:
            metrics.read_token(args.metrics_token_file)
        except OSError as e:
            raise UserError(f"--metrics-token-file {args.metrics_token_file}: {configs.reason(e)}") from None
        except ValueError as e:
            raise UserError(f"--metrics-token-file {e}") from None


def load_target(args):
    """The target engine as `--target`, `--dtype` and `--no-bit-exact` ask; None, said on stderr, where
    there are no bit-exact kernels for it."""
    import torch

    from verifier_service.engine import NoExactPath, TargetEngine, UnsupportedModel
    from verifier_service.numerics import NoSuchDevice

    # Before the load, whose checks and timings run on these threads (draftwire.cpus.threads).
    torch.set_num_threads(getattr(args, "threads", 0) or cpus.threads())
    try:
        engine = TargetEngine.load(
            args.target, args.device, dtype=args.dtype, invariant=args.invariant, kernels=args.kernels
        )
    except NoSuchDevice as e:
        raise UserError(str(e)) from None
    except NoExactPath as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return None
    except UnsupportedModel as e:
        raise UserError(f"--target {args.target}: {e}", 1) from None
    except (OSError, ValueError, KeyError) as e:  # no model there, or one transformers cannot read
        raise UserError(
            f"--target {args.target}: cannot load a model from it: {configs.reason(e)}", 1
        ) from None
    print(f"draftwire: {numerics_line(engine)}", file=sys.stderr, flush=True)
    return engine


def say_calibration(engine, config) -> None:
    """Says on the terminal that the start times the round sizes, where it will (seconds to minutes on a
    busy machine; once, since the figures are kept)."""
    from verifier_service.batcher import calibration_file

    positions = config.limits.max_gamma + 1
    path = calibration_file(config.batch.calibration_dir, engine, positions)
    if config.batch.calibrate and not (path and path.exists()):
        where = f", kept for the next start in {path.parent}" if path else ""
        print(f"draftwire: timing the target's forwards of 1 to {positions} positions{where}", flush=True)


def numerics_line(engine) -> str:
    """The startup line that says which exact path runs (and why auto passed over a faster one)."""
    n = engine.numerics
    exact = "bit-exact" if n.exact else "not bit-exact (--no-bit-exact)"
    line = f"target {engine.info.target_id}: {n.dtype} on {n.device} with {n.kernels} kernels, {exact}"
    if n.device == "cpu":
        import torch

        line += f", {torch.get_num_threads()} threads on {len(cpus.usable())} CPUs"
    if engine.padding:
        line += f", small calls padded to {engine.padding} rows"
    if engine.passed_over:
        line += f" (passed over {'; '.join(engine.passed_over)})"
    return line


async def _serve_until_signal(engine, config, stop) -> None:
    from verifier_service.servicer import start_server

    say_calibration(engine, config)
    server, port = await start_server(engine, config)
    print(f"draftwire: serving {engine.info.target_id} on {config.host}:{port}", flush=True)
    if server.metrics_port is not None:  # the bound port: --metrics-port 0 picks one
        print(f"draftwire: metrics on http://{config.metrics_host}:{server.metrics_port}/metrics", flush=True)
    await stop.wait()
    drain_s = config.lifetime.drain_timeout_s
    print(f"draftwire: draining (up to {drain_s:g} s; a second Ctrl-C stops at once)", flush=True)
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
            kernels=args.kernels,
            device=args.device,
            num_gpus=args.gpus_per_replica,
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


def loadtest(args) -> int:
    from draftwire_cli.loadtest import LoadConfig, report_text, run_load
    from edge_client.session import VerifierError

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

    credentials = configs.credentials(args)

    async def run() -> dict:
        async with wire.channel(args.server, credentials) as channel:
            return await run_load(channel, config)

    try:
        report = asyncio.run(run())
    except (VerifierError, grpc.aio.AioRpcError) as e:
        print(
            f"draftwire: loadtest could not record its scripts: {configs.explain(e, credentials)}",
            file=sys.stderr,
        )
        return 1
    print(jsonout.dumps(report) if args.json else report_text(report))
    return 0 if report["errors"] == {} and report["mismatches"] == 0 else 1


def top(args) -> int:
    from draftwire_cli.top import run

    credentials = configs.credentials(args)
    try:
        return run(args.server, args.interval, args.once, credentials)
    except grpc.aio.AioRpcError as e:
        print(f"draftwire: top: {configs.explain(e, credentials)}", file=sys.stderr)
        return 1
