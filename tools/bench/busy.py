"""Beside other work (docs/sharing.md): `serve`'s start-up, the target alone's decode rate through it, and
`demo --prompt`'s run and reply rate, from a source tree, with N CPU-burning processes beside them.

    python -m tools.bench.busy --tree /path/to/checkout --burners 2 [--models models/demo]
    python -m tools.bench.busy --steps   # one decode step and one draft token, each way of waiting

Prints one JSON line. Run it for two trees (git worktree add --detach DIR COMMIT), interleaved, to compare
them under the same background; OMP_WAIT_POLICY is removed from the children's environment, so each tree
applies its own policy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

PROMPT = "Write a function that returns the sum of a list."
TOKENS = 96


def _draftwire(tree: str, *argv: str, **kw):
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("OMP_WAIT_POLICY", None)
    return [sys.executable, "-m", "draftwire_cli", *argv], {"cwd": tree, "env": env, "text": True, **kw}


def measure(tree: str, burners: int, models: str) -> dict:
    out: dict = {"tree": tree, "burners": burners, "load": os.getloadavg()[0]}
    burn = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(burners)]
    serve = None
    try:
        time.sleep(0.5)
        start = time.perf_counter()
        argv, kw = _draftwire(tree, "serve", "--target", f"{models}/target", "--port", "0")
        serve = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
        for line in serve.stdout:
            if found := re.search(r"serving \S+ on (\S+)", line):
                break
        else:
            raise SystemExit("serve ended before serving")
        out["serve_ready_s"] = round(time.perf_counter() - start, 1)
        ids = ",".join(map(str, range(5, 37)))
        argv, kw = _draftwire(tree, "generate", "--server", found.group(1), "--prompt-ids", ids)
        argv += ["--server-drafting", "none", "--max-new-tokens", str(TOKENS), "--ignore-eos", "--json"]
        stats = json.loads(subprocess.run(argv, capture_output=True, check=True, **kw).stdout)["stats"]
        out["alone_tokens_per_s"] = round(TOKENS / stats["wall_s"], 1)
        serve.kill()
        start = time.perf_counter()
        argv, kw = _draftwire(tree, "demo", "--models", models, "--prompt", PROMPT)
        demo = subprocess.run([*argv, "--max-new-tokens", str(TOKENS)], capture_output=True, check=True, **kw)
        out["demo_s"] = round(time.perf_counter() - start, 1)
        if m := re.search(r"([\d.]+) tokens/s\]", demo.stdout):
            out["demo_reply_tokens_per_s"] = float(m.group(1))
        if m := re.search(r"draftwire demo: (verifier on .*)", demo.stdout):
            out["demo_measured"] = m.group(1)
    finally:
        for p in [*burn, serve]:
            if p is not None:
                p.kill()
    return out


STEP = """
import json, os, sys, time
t0 = time.perf_counter()
import torch
from pathlib import Path
threads = int(sys.argv[2])
torch.set_num_threads(threads)
from draftwire.contract import SamplingParams
from edge_client.drafter import DrafterConfig, LlamaDrafter
from verifier_service.engine import TargetEngine
engine = TargetEngine.load(Path(sys.argv[1]) / "target")
load_s = time.perf_counter() - t0
ids = list(range(5, 37))
engine.forward("k", 0, ids, wants_logits=False)
for i in range(110):
    if i == 10:
        start = time.perf_counter()
    engine.forward("k", len(ids) + i, [7])
step_ms = (time.perf_counter() - start) / 100 * 1e3
draft = LlamaDrafter(DrafterConfig(Path(sys.argv[1]) / "draft-q8_0.gguf", n_ctx=512, n_threads=threads))
seq = draft.tokenize("def total(xs):\\n    return sum(xs)\\n" * 4)
draft.propose(seq, 1, SamplingParams())
start = time.perf_counter()
for _ in range(40):
    draft.propose(seq, 8, SamplingParams())
token_ms = (time.perf_counter() - start) / 320 * 1e3
start = time.perf_counter()
for _ in range(5):
    draft._cached = []
    draft.propose(seq, 1, SamplingParams())
prompt_ms = (time.perf_counter() - start) / 5 * 1e3
print(json.dumps({"wait": os.environ.get("OMP_WAIT_POLICY", "default"), "threads": threads,
                  "load_s": round(load_s, 1), "target_step_ms": round(step_ms, 2),
                  "draft_token_ms": round(token_ms, 2), "draft_prompt_ms": round(prompt_ms, 1)}))
"""


def steps(tree: str, models: str) -> None:
    """The target's decode step and the draft's token in one process, each way of waiting and threads."""
    cpus = len(os.sched_getaffinity(0))
    for wait, threads in (("default", cpus), ("PASSIVE", cpus), ("PASSIVE", 1)):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if wait != "default":
            env["OMP_WAIT_POLICY"] = wait
        env["PYTHONPATH"] = tree
        argv = [sys.executable, "-c", STEP, models, str(threads)]
        line = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
        print(line.strip().splitlines()[-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", default=".", help="the checkout whose draftwire runs")
    p.add_argument("--burners", type=int, default=0, help="CPU-burning processes beside it")
    p.add_argument("--models", default="models/demo", help="a pair directory, relative to the tree")
    p.add_argument("--steps", action="store_true", help="time a decode step and a draft token instead")
    args = p.parse_args()
    if args.steps:
        return steps(os.path.abspath(args.tree), args.models)
    print(json.dumps(measure(os.path.abspath(args.tree), args.burners, args.models)), flush=True)


if __name__ == "__main__":
    main()
