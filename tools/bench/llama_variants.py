"""The draft's decode speed on each llama.cpp CPU variant this CPU can run, side by side in one run: what
run-time dispatch buys over a portable baseline build (x64, SSE4.2) on the same machine and model.

    python -m tools.bench.llama_variants [--draft FILE.gguf] [--tokens 64] [--repeats 3]

Each variant runs in a fresh process pinned to one core (DRAFTWIRE_LLAMA_VARIANT forces it), decoding
`--tokens` greedy tokens one at a time after a short prompt, `--repeats` times, interleaved across
variants; the table gives each variant's median ms/token and its ratio to ggml's own choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from edge_client import llama_runtime

CHILD = """
import json, sys, time
import numpy as np
from edge_client.llama_runtime import Llama, load_backends
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False)
tokens = llm.tokenize(b"def fibonacci(n):")
llm.eval(tokens)
n = int(sys.argv[2])
start = time.perf_counter()
for _ in range(n):
    token = int(np.argmax(llm._scores[-1]))
    llm.eval([token])
ms = 1000 * (time.perf_counter() - start) / n
print(json.dumps({"variant": load_backends().variant, "ms_per_token": ms}))
"""


def runnable_variants() -> list[str]:
    import ctypes

    out = []
    for variant in llama_runtime.installed_variants():
        module = ctypes.CDLL(str(next(llama_runtime.LIB_DIR.glob(f"libggml-cpu-{variant}.so*"))))
        module.ggml_backend_score.restype = ctypes.c_int
        if module.ggml_backend_score() > 0:
            out.append(variant)
    return out


def measure(draft: str, variant: str | None, tokens: int) -> dict:
    env = dict(os.environ)
    env.pop(llama_runtime.VARIANT_ENV, None)
    if variant:
        env[llama_runtime.VARIANT_ENV] = variant
    pin = ["taskset", "-c", "0"] if _has_taskset() else []
    out = subprocess.run(
        [*pin, sys.executable, "-c", CHILD, draft, str(tokens)],
        capture_output=True, text=True, env=env, check=True, timeout=600,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_taskset() -> bool:
    return subprocess.run(["sh", "-c", "command -v taskset"], capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    from draftwire_cli.models import smollm2

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default=str(smollm2.draft_path(smollm2.default_dir())))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    chosen = llama_runtime.load_backends().variant
    variants = runnable_variants()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            times[variant].append(measure(args.draft, variant, args.tokens)["ms_per_token"])
    base = statistics.median(times[chosen]) if chosen in times else None
    print(f"draft {os.path.basename(args.draft)}, {args.tokens} tokens x {args.repeats}, one core")
    print("| variant | ms/token (median) | vs ggml's choice |")
    print("|---|---|---|")
    for variant in variants:
        median = statistics.median(times[variant])
        ratio = f"{median / base:.2f}x" if base else "-"
        mark = " (ggml's choice)" if variant == chosen else ""
        print(f"| {variant}{mark} | {median:.2f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
