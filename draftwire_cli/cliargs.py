"""Argument types and groups that the CLI and the bench scripts share."""

from __future__ import annotations

import argparse
import os


def id_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of token ids: {text!r}") from None


def rig(text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        edge, verifier = text.split(":")
        return id_list(edge), id_list(verifier)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not EDGE_CPUS:VERIFIER_CPUS (e.g. 0:1 or 0,1:2,3): {text!r}"
        ) from None


def device_name(text: str) -> str:
    """--device's syntax (verifier_service.numerics.device_name); whether this machine has the device is
    the load's question."""
    from verifier_service import numerics  # no torch: the edge's commands parse with it too

    try:
        return numerics.device_name(text)
    except numerics.NoSuchDevice as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="where the target runs: auto (the first CUDA GPU torch sees, else the CPU), cpu, cuda or "
        "cuda:N; on a GPU the bit-exact kernels are the portable ones, proven at load (docs/gpu.md)",
    )


def add_target_numerics(p: argparse.ArgumentParser) -> None:
    add_device(p)
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the target's weights and compute (auto: bfloat16 where the CPU computes it natively, else "
        "float32, proven bit-exact at load; `draftwire doctor` shows what this machine can run)",
    )
    p.add_argument(
        "--no-bit-exact",
        dest="invariant",
        action="store_false",
        help="plain kernels: a position's logits then depend on what shares its forward, and the output "
        "may differ from the target alone's at near-ties (the default kernels are bit-exact)",
    )
    p.add_argument(
        "--kernels",
        choices=("auto", "onednn", "portable"),
        # The environment's default lets a test run (.ci/run) put every verifier it starts on a backend.
        default=os.environ.get("DRAFTWIRE_KERNELS", "auto"),
        help="the bit-exact kernels (auto: onednn on a CPU that has it, else portable, plain torch that "
        "runs on any device; docs/invariance.md)",
    )
