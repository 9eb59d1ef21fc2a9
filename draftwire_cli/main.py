"""The `draftwire` command: serve, generate, reference, chat, edge, demo and the rest (`draftwire --help`).
The typed configs are built once, from the flags, in draftwire_cli.configs."""

from __future__ import annotations

import os
import sys

from draftwire import cpus
from draftwire.ports import PortInUse
from draftwire_cli import configs
from draftwire_cli.client import chat, edge, generate, reference
from draftwire_cli.flags import UserError
from draftwire_cli.local import bench, demo, doctor, models
from draftwire_cli.parser import parser
from draftwire_cli.serving import loadtest, serve, top


def fail(message: str, status: int) -> int:
    print(f"draftwire: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return status


def is_gguf(path) -> bool:
    """Whether the file starts as a GGUF model does (its magic), so that another file is named as such."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return True  # unreadable: left to the loader's own message


def check_inputs(args) -> None:
    """Raises UserError for a model file or directory that is not there, before anything loads."""
    for flag in ("draft", "vocab", "draft_hf"):
        path = getattr(args, flag, None)
        if path is not None and not (path.is_dir() if flag == "draft_hf" else path.is_file()):
            raise UserError(
                f"--{flag.replace('_', '-')} {path}: no such {'directory' if flag == 'draft_hf' else 'file'}"
            )
        if path is not None and flag != "draft_hf" and not is_gguf(path):
            raise UserError(
                f"--{flag} {path}: not a GGUF file (llama.cpp's model format: the .gguf file of a pair, as "
                "`draftwire models fetch` writes it)"
            )
    target = getattr(args, "target", None)
    if target is not None and not target.is_dir():
        raise UserError(f"--target {target}: no such directory (a transformers model directory)")
    if getattr(args, "chat", False) and args.command == "generate":
        if args.prompt is None:
            raise UserError("--chat formats --prompt TEXT with the target's chat template: give --prompt")
        if args.draft is None and args.vocab is None:
            raise UserError("--chat needs a tokenizer: --draft FILE.gguf, or --vocab FILE.gguf")


COMMANDS = {
    "serve": serve,
    "loadtest": loadtest,
    "generate": generate,
    "reference": reference,
    "chat": chat,
    "edge": edge,
    "top": top,
    "demo": demo,
    "models": models,
    "doctor": doctor,
}


def main(argv: list[str] | None = None) -> int:
    """The `draftwire` command. Every mistake and failure ends with one `draftwire: ...` line on stderr:
    exit 2 for a command line that cannot work, 1 for a failure while running (DRAFTWIRE_DEBUG=1 shows
    the traceback of an unexpected one)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the checkout's bench parses its own flags
        return said("bench", lambda: bench(argv[1:]))
    args = parser().parse_args(argv)
    cpus.sleep_while_waiting()  # before any command loads torch or llama.cpp (they read it once, at load)

    def run() -> int:
        check_inputs(args)
        return COMMANDS[args.command](args)

    return said(args.command, run)


def said(command: str, run) -> int:
    """run()'s exit status, its mistake or failure said in one line."""
    try:
        return run()
    except KeyboardInterrupt:
        return 130
    except UserError as e:
        return fail(str(e), e.status)
    except PortInUse as e:
        return fail(str(e), 1)
    except Exception as e:
        if os.environ.get("DRAFTWIRE_DEBUG"):
            raise
        return fail(
            f"{command} failed: {type(e).__name__}: {configs.reason(e)} (DRAFTWIRE_DEBUG=1 shows where)", 1
        )
