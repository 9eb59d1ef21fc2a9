"""Benchmark: the verifier's resident memory through a load, against the weights in the serving dtype.

Loads the target as `serve` does (TargetEngine.load: the checks at load included), sampling the process's
resident memory every 20 ms, and prints the peak, the memory once loaded and the weights' bytes in the
dtype served, with their ratios. The KV budget comes on top of these (no session is open).

    python -m tools.bench.load_memory --target DIR [--dtype auto] [--kernels auto]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernels", default="auto")
    args = ap.parse_args(argv)
    peak = [resident_bytes()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], resident_bytes())

    threading.Thread(target=sample, daemon=True).start()
    import torch  # noqa: F401  (imported after the sampler starts: its own memory counts)
    from transformers import AutoConfig

    from verifier_service.engine import TargetEngine

    start = time.perf_counter()
    engine = TargetEngine.load(args.target, dtype=args.dtype, kernels=args.kernels)
    seconds = time.perf_counter() - start
    done.set()
    loaded = resident_bytes()
    peak[0] = max(peak[0], loaded)
    config = AutoConfig.from_pretrained(args.target)
    params = engine.model.num_parameters() if hasattr(engine.model, "num_parameters") else 0
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    weights = params * engine.model.dtype.itemsize
    report = {
        "numerics": engine.numerics.identity,
        "passed_over": list(engine.passed_over),
        "load_s": round(seconds, 1),
        "weights_gb": round(weights / 1e9, 3),
        "tied_embeddings": tied,
        "peak_gb": round(peak[0] / 1e9, 3),
        "loaded_gb": round(loaded / 1e9, 3),
        "peak_over_weights": round(peak[0] / weights, 2),
        "loaded_over_weights": round(loaded / weights, 2),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
