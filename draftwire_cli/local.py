"""`bench`, `models`, `demo` and `doctor`: what runs on this machine alone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from draftwire import jsonout
from draftwire_cli import configs
from draftwire_cli.flags import UserError
from draftwire_cli.models.pairs import PAIRS
from draftwire_cli.serving import load_target


def bench(argv: list[str]) -> int:
    """`draftwire bench ARGS`: the checkout's tools/bench/speed.py (the benches are not in the wheel)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "tools" / "bench" / "speed.py").is_file():
        raise UserError("bench needs a checkout of draftwire (git clone, then pip install -e .)")
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return subprocess.call(
        [sys.executable, "-m", "tools.bench.speed", *argv], env={**os.environ, "PYTHONPATH": path}
    )


def models(args) -> int:
    if args.models_command == "check":
        return _models_check(args)
    if args.models_command == "fetch" and args.name in PAIRS:
        from draftwire_cli.models import chunks

        if args.card:
            raise UserError(f"--card measures smollm2 only; docs/benchmarks.md has {args.name}'s figures")
        chunks.fetch(PAIRS[args.name], args.out, force=args.force)
        return 0
    if args.models_command == "fetch":
        from draftwire_cli.models import smollm2, smollm2_card

        directory = smollm2.fetch(args.out or smollm2.default_dir(), force=args.force)
        if args.card:
            smollm2_card.write_card(directory)
        return 0
    from draftwire_cli.models.demopair.build import STAGES, build
    from draftwire_cli.models.demopair.files import DEFAULT_OUT

    card = build(args.out or DEFAULT_OUT, tuple(args.stage or STAGES), quick=args.quick)
    print(f"draftwire: model pair built; card at {card}")
    return 0


def _models_check(args) -> int:
    from draftwire_cli.models.check import as_json, check_pair

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
            kernels=args.kernels,
            device=args.device,
            log=lambda m: print(f"draftwire: {m}", file=sys.stderr, flush=True),
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read the pair: {configs.reason(e)}", 1) from None
    print(jsonout.dumps(as_json(report), indent=2) if args.json else "\n".join(report.lines()))
    return 0 if report.accepted else 1


def demo(args) -> int:
    from draftwire import ports

    if args.web:  # said at once, not after the models load
        ports.check_free("127.0.0.1", args.port)
    from draftwire_cli.demo import run_demo, run_web_demo
    from draftwire_cli.models.find import find_pair

    try:
        target_dir, draft_path = find_pair(args.models)
    except FileNotFoundError as e:
        print(f"draftwire: {e}", file=sys.stderr)
        return 2
    args.target = target_dir
    engine = load_target(args)
    if engine is None:
        return 2
    if args.web:
        return asyncio.run(run_web_demo(engine, draft_path, args.port))
    return asyncio.run(run_demo(engine, draft_path, configs.chat_config(args), args.prompt))


def doctor(args) -> int:
    from draftwire_cli.doctor import report

    return report(probe=not args.no_probe, as_json=args.json)
