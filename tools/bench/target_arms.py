"""The bench's arms without draftwire: (a) the target alone through our engine, one token per forward;
(b) transformers' assisted generation with the draft's transformers form, and its prompt-lookup decoding
(what a user without a draft model picks). `draftwire bench` runs them in a child process pinned to the
verifier's cores, where the target lives in the two-device rig.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftwire.contract import SessionSpec
from tools.bench.arms import BenchConfig, Row, params_for
from verifier_service.batcher import Batcher
from verifier_service.engine import TargetEngine
from verifier_service.session import decode_alone

PROMPT_LOOKUP_TOKENS = 10  # transformers' suggested n-gram continuation length


async def run_target_alone(config: BenchConfig, batcher: Batcher, mode: str) -> Row:
    row = Row("a", "target alone (one token per forward)", mode)
    start = time.perf_counter()
    for i, prompt in enumerate(config.prompts):
        spec = SessionSpec(prompt, params_for(mode, config, i), config.max_new_tokens, ignore_eos=True)
        row.outputs.append(await decode_alone(batcher, spec))
    row.wall_s = time.perf_counter() - start
    row.tokens = sum(map(len, row.outputs))
    row.tokens_per_round = row.target_positions_per_token = 1.0
    return row


def _dtype(config: BenchConfig) -> torch.dtype:
    """transformers' arms run in the target's dtype ("auto" is bfloat16, as in TargetEngine.load)."""
    return getattr(torch, "bfloat16" if config.dtype == "auto" else config.dtype)


def run_transformers(config: BenchConfig, label: str, **generate_kwargs) -> Row:
    """transformers' own greedy `generate` with the given speculation (assistant model, prompt lookup)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(config.target_dir, dtype=_dtype(config)).eval()
    row = Row("b", label, "greedy")
    start = time.perf_counter()
    for prompt in config.prompts:
        ids = torch.tensor([prompt])
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=config.max_new_tokens,
            min_new_tokens=config.max_new_tokens,
            pad_token_id=target.config.pad_token_id,
            **generate_kwargs,
        )
        row.outputs.append(out[0, len(prompt) :].tolist())
    row.wall_s = time.perf_counter() - start
    row.tokens = sum(map(len, row.outputs))
    return row


async def run(config: BenchConfig, log=print, transformers: bool = True) -> list[Row]:
    """The target alone (a), greedy and sampled; then, with `transformers`, transformers' own speculative
    arms (b)."""
    rows = []
    engine = TargetEngine.load(
        config.target_dir, dtype=config.dtype, invariant=config.invariant, kernels=config.kernels
    )
    batcher = Batcher(engine)
    try:
        for mode in ("greedy", "sampled"):
            log(f"(a) target alone, {mode}")
            rows.append(await run_target_alone(config, batcher, mode))
    finally:
        batcher.close()
    if not transformers:
        return rows
    if config.draft_hf is not None:
        from transformers import AutoModelForCausalLM

        log("(b) transformers assisted generation, greedy")
        draft = AutoModelForCausalLM.from_pretrained(config.draft_hf, dtype=_dtype(config)).eval()
        rows.append(run_transformers(config, "transformers assisted generation", assistant_model=draft))
    log("(b) transformers prompt-lookup decoding, greedy")
    rows.append(
        run_transformers(
            config, "transformers prompt-lookup decoding", prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS
        )
    )
    return rows


def in_child(config: BenchConfig, log=print, transformers: bool = True) -> list[Row]:
    """`run` in a child process on the verifier's cores (config.verifier_cpus; all when empty), with as
    many torch threads as it has cores there. Raises RuntimeError when the child fails."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "config.json", Path(tmp) / "rows.json"
        spec.write_text(json.dumps(_to_json(config)))
        cpus = config.verifier_cpus
        proc = subprocess.run(
            [sys.executable, "-m", "tools.bench.target_arms", str(spec), str(out)]
            + ([] if transformers else ["--alone"]),
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            stdout=sys.stderr,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the target's arms failed (exit {proc.returncode})")
        return [Row(**r) for r in json.loads(out.read_text())]


def _to_json(config: BenchConfig) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}


def _from_json(raw: dict) -> BenchConfig:
    paths = {"target_dir", "draft_gguf", "draft_hf"}
    fields = {k: (Path(v) if k in paths and v is not None else v) for k, v in raw.items()}
    fields["prompts"] = tuple(tuple(p) for p in fields["prompts"])
    for name in ("gammas", "rtts_ms", "pipelines", "edge_cpus", "verifier_cpus"):
        fields[name] = tuple(fields[name])
    return BenchConfig(**fields)


def main(argv: list[str]) -> int:
    config = _from_json(json.loads(Path(argv[0]).read_text()))
    threads = len(config.verifier_cpus) or config.verifier_threads
    if threads:
        torch.set_num_threads(threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = asyncio.run(run(config, log, transformers="--alone" not in argv[2:]))
    Path(argv[1]).write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
