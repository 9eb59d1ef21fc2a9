"""Every subcommand, given a mistake, says it in one `draftwire: ...` line with exit status 2 (a command
line that cannot work) or 1 (a failure while running), and never with a traceback. No model loads: the
mistakes are caught before (or instead of) loading one."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from draftwire_cli.parser import parser

ROOT = Path(__file__).resolve().parents[2]


def draftwire(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "draftwire_cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_subcommand_says_a_mistake_in_one_line(tmp_path, busy_port, closed_port):
    target = tmp_path / "target"  # exists, holds no model: nothing gets as far as loading it
    target.mkdir()
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")  # a GGUF's magic, no model: the checks before loading pass it
    tokens = tmp_path / "tokens"
    tokens.write_text("alice t0k3n\n")
    missing = str(tmp_path / "missing.gguf")
    busy, closed = str(busy_port), f"127.0.0.1:{closed_port}"
    gen = ["generate", "--server", closed, "--prompt-ids", "1,2,3"]
    serve = ["serve", "--target", str(target)]
    # (argv, exit status, what stderr's `draftwire:` line says)
    cases = [
        ([], 2, "required"),
        ([*gen, "--temperature", "-1"], 2, "--temperature"),
        ([*gen, "--top-p", "0"], 2, "--top-p"),
        ([*gen, "--top-p", "1.5"], 2, "--top-p"),
        ([*gen, "--top-k", "-3"], 2, "--top-k"),
        ([*gen, "--gamma", "0"], 2, "--gamma"),
        ([*gen, "--pipeline", "-1"], 2, "--pipeline"),
        ([*gen, "--seed", "-1"], 2, "--seed"),
        ([*gen, "--max-new-tokens", "ten"], 2, "not an integer"),
        ([*gen, "--draft", missing], 2, "no such file"),
        ([*gen, "--vocab", missing], 2, "no such file"),
        (["generate", "--server", closed, "--prompt", "hi"], 2, "--prompt-ids"),
        ([*gen, "--chat"], 2, "--chat"),
        ([*gen, "--token", "s3cret"], 2, "/proc/PID/cmdline"),
        ([*gen, "--token-file", missing], 2, "--token-file"),
        ([*gen, "--token-file", str(tokens)], 2, "one token"),
        ([*gen, "--tls-ca", missing], 2, "missing.gguf"),
        ([*gen, "--resume-timeout-s", "0"], 1, "UNAVAILABLE"),  # nothing listens there
        ([*gen, "--resume-timeout-s", "0", "--temperature", "0.7"], 1, "UNAVAILABLE"),
        (["serve", "--target", missing], 2, "no such directory"),
        ([*serve, "--port", "70000"], 2, "--port"),
        ([*serve, "--device", "gpu"], 2, "--device"),
        ([*serve, "--device", "cuda:1"], 2, "torch sees 0 CUDA devices here"),  # this CPU-only torch
        ([*serve, "--max-gamma", "0"], 2, "--max-gamma"),
        ([*serve, "--kv-budget-mb", "-1"], 2, "--kv-budget-mb"),
        ([*serve, "--tls-cert", missing], 2, "TLS needs"),
        ([*serve, "--auth-tokens", str(tokens)], 2, "needs TLS"),
        ([*serve, "--port", busy], 1, f"port {busy} is already in use"),
        ([*serve, "--port", "0", "--metrics-port", busy], 1, f"port {busy} is already in use"),
        (["edge", "--server", closed, "--draft", str(draft), "--port", busy], 1, f"port {busy} is already"),
        (["edge", "--server", closed], 2, "--draft"),
        (["edge", "--server", closed, "--draft", missing], 2, "no such file"),
        (["edge", "--server", closed, "--draft", str(draft), "--temperature", "-2"], 2, "--temperature"),
        (["chat", "--server", closed, "--draft", missing], 2, "no such file"),
        (["chat", "--server", closed, "--draft", str(draft), "--gamma", "0"], 2, "--gamma"),
        (["reference", "--target", missing, "--prompt-ids", "1"], 2, "no such directory"),
        (["reference", "--target", str(target), "--prompt-ids", "1", "--top-p", "-1"], 2, "--top-p"),
        (["loadtest", "--server", closed, "--gamma", "0"], 2, "--gamma"),
        (["loadtest", "--server", closed, "--token", "s3cret"], 2, "/proc/PID/cmdline"),
        (["top", closed, "--once"], 1, "UNAVAILABLE"),
        (["top", closed, "--interval", "-1"], 2, "--interval"),
        (["bench", "--target", str(target), "--draft", missing], 2, "no such file"),
        (["demo", "--port", "-1"], 2, "--port"),
        (["models", "fetch", "nosuch"], 2, "invalid choice"),
        (["models", "build", "--stage", "nosuch"], 2, "invalid choice"),
        (["doctor", "--nosuch"], 2, "unrecognized"),
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda case: draftwire(*case[0]), cases))
    for (argv, status, said), done in zip(cases, results, strict=True):
        err = done.stderr
        assert "Traceback" not in err, (argv, err)
        assert done.returncode == status, (argv, done.returncode, err)
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("draftwire: ") and said in lines[-1], (argv, err)
        if "already in use" in said:  # exactly that one line
            assert lines == [f"draftwire: port {busy} is already in use"], (argv, err)
    sampled = next(done for (argv, *_), done in zip(cases, results, strict=True) if "0.7" in argv)
    assert "draftwire: sampling with seed " in sampled.stderr  # a sampled run can be repeated


def test_help_describes_every_flag_with_its_default():
    def parsers(p: argparse.ArgumentParser):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    for p in parsers(parser()):
        for action in p._actions:
            assert action.help, (p.prog, action.option_strings or action.dest)
        p.format_help()  # every help text formats
    generate = draftwire("generate", "--help")
    assert generate.returncode == 0
    for shown in ("(default: 64)", "(default: 0.0)", "(default: 1.0)", "--chat", "--token-file"):
        assert shown in generate.stdout, shown
