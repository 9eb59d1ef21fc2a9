"""Benchmark: what bit-exact (invariant) verification costs against transformers' own plain forward.

In one run and one dtype, side by side: transformers' model as it loads (its default attention, sdpa,
and a DynamicCache), and the engine in invariant mode on each backend asked for (onednn, portable). The
cases are the issue's: a prefill of a long prompt, a verify batch of 16 sessions x 5 positions over
1,000 cached positions each, and a one-position decode step over the same context. Cached positions are
random keys and values (the cost of attention is the same; no prefill of 16 sessions is timed), and
every call is cut back to them after. The arms take turns within each repeat (median of the repeats),
so a load that comes and goes touches them alike.

    python -m tools.bench.invariance --target DIR --dtype float32 [--arms plain,onednn,portable]
        [--prefill 2000] [--held 1000] [--repeats 3] [--threads 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from verifier_service.engine import Forward, TargetEngine

SESSIONS, WIDTH = 16, 5  # the verify batch


class Plain:
    """transformers' own forward: the model as from_pretrained gives it, a DynamicCache per case."""

    def __init__(self, target: Path, dtype: str):
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).eval()
        config = self.model.config.get_text_config()
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layers = config.num_hidden_layers
        self.caches: dict[int, DynamicCache] = {}

    def cache(self, batch: int, held: int) -> DynamicCache:
        """A cache of `batch` rows holding `held` random positions (made once per batch size)."""
        if batch not in self.caches:
            cache = DynamicCache(config=self.model.config)
            g = torch.Generator().manual_seed(batch)
            for layer in range(self.layers):
                shape = (batch, self.kv_heads, held, self.head_dim)
                k, v = (torch.randn(shape, generator=g).to(self.model.dtype) for _ in "kv")
                cache.update(k, v, layer)
            self.caches[batch] = cache
        return self.caches[batch]

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> None:
        self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def rows(self, ids: list[list[int]], held: int) -> None:
        cache = self.cache(len(ids), held)
        self.model(input_ids=torch.tensor(ids), past_key_values=cache, use_cache=True)
        cache.crop(-len(ids[0]))


class EngineArm:
    """A TargetEngine (invariant on one backend, or plain) whose sessions s0, s1, ... each hold `held`
    random positions."""

    def __init__(self, engine: TargetEngine, held: int, sessions: int = SESSIONS):
        self.engine = engine
        g = torch.Generator().manual_seed(0)
        vocab = engine.info.vocabulary.size
        for s in range(sessions):
            engine.forward(f"s{s}", 0, [0], wants_logits=False)  # the session's layers, then its context
            engine._fill(f"s{s}", [random.Random(s).randrange(vocab) for _ in range(held)], g)

    @classmethod
    def invariant(cls, target: Path, dtype: str, kernels: str, held: int) -> EngineArm:
        """The engine in invariant mode on one backend (onednn, portable)."""
        return cls(TargetEngine.load(target, dtype=dtype, kernels=kernels), held)

    def prefill(self, ids: list[int]) -> None:
        self.engine.forward("prefill", 0, ids, wants_logits=False)

    def rows(self, ids: list[list[int]], held: int) -> None:
        self.engine.forward_many([Forward(f"s{s}", held, tuple(row)) for s, row in enumerate(ids)])


def cases(prefill: int, held: int, vocab: int) -> dict[str, Callable[[object], None]]:
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(prefill)]
    batch = [[rng.randrange(vocab) for _ in range(WIDTH)] for _ in range(SESSIONS)]
    return {
        f"prefill of {prefill} positions": lambda arm: arm.prefill(prompt),
        f"verify {SESSIONS} sessions x {WIDTH} positions at {held}": lambda arm: arm.rows(batch, held),
        f"decode 1 position at {held}": lambda arm: arm.rows([batch[0][:1]], held),
    }


def interleaved(
    call: Callable[[object], None],
    arms: dict[str, object],
    repeats: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median milliseconds of `call(arm)` per arm: a warm-up each (kernels, caches' capacity), then the
    arms take turns within each repeat. `sync` waits for the device's queued work (CUDA's is
    asynchronous) before and after each timed call."""
    times: dict[str, list[float]] = {label: [] for label in arms}
    for arm in arms.values():
        call(arm)
    for _ in range(repeats):
        for label, arm in arms.items():
            sync()
            start = time.perf_counter()
            call(arm)
            sync()
            times[label].append(time.perf_counter() - start)
    return {label: 1000 * statistics.median(t) for label, t in times.items()}


def measure(target: Path, dtype: str, arms: list[str], prefill: int, held: int, repeats: int) -> dict:
    """Median milliseconds per case and arm, and what each invariant arm reports of itself."""
    loaded: dict[str, object] = {}
    for arm in arms:
        plain = arm == "plain"
        loaded[arm] = Plain(target, dtype) if plain else EngineArm.invariant(target, dtype, arm, held)
    vocab = next(a.engine for a in loaded.values() if isinstance(a, EngineArm)).info.vocabulary.size
    results = {name: interleaved(call, loaded, repeats) for name, call in cases(prefill, held, vocab).items()}
    numerics = {
        label: arm.engine.numerics.identity for label, arm in loaded.items() if isinstance(arm, EngineArm)
    }
    return {"ms": results, "numerics": numerics}


def markdown(dtype: str, results: dict) -> str:
    arms = list(next(iter(results["ms"].values())))
    exact = [a for a in arms if a != "plain"]
    head = ["forward", *(f"{a} (ms)" for a in arms), *(f"{a} / plain" for a in exact)]
    lines = [f"**{dtype}**", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, ms in results["ms"].items():
        cells = [f"{ms[a]:.1f}" for a in arms] + [f"{ms[a] / ms['plain']:.2f}" for a in exact]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    ap.add_argument("--arms", default="plain,onednn,portable", help="plain and the backends to time")
    ap.add_argument("--prefill", type=int, default=2000, help="prompt length of the prefill case")
    ap.add_argument("--held", type=int, default=1000, help="cached positions of the verify and decode cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    arms = args.arms.split(",")
    if "plain" not in arms:
        ap.error("--arms must include plain, the baseline")
    results = measure(args.target, args.dtype, arms, args.prefill, args.held, args.repeats)
    print(f"{torch.get_num_threads()} torch thread(s), median of {args.repeats}; {results['numerics']}\n")
    print(markdown(args.dtype, results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
