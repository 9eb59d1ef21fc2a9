"""SmolLM2's model card: the fetched pair (draftwire_cli/models/smollm2.py) measured, agreement, costs and the
acceptance of `draftwire serve` and `generate` run as a user runs them, into DIR/card.json and
DIR/model_card.md (`draftwire models card smollm2`, minutes)."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from draftwire_cli.models.fromgguf import (
    chat_ids,
    no_progress_bars,
)
from draftwire_cli.models.smollm2 import (
    CARD_JSON,
    CARD_MD,
    DRAFT_KINDS,
    MODEL_NAME,
    PACKAGE,
    SHIPPED_NAME,
    TARGET,
    VERSION,
    default_dir,
    draft_path,
    is_fetched,
)

# Held out from everything else here (nothing was tuned on them): varied chat turns, short and long,
# facts, code, arithmetic, advice, rewriting, lists.
CARD_PROMPTS = (
    "What is the capital of Japan?",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for sleeping better.",
    "What is 17 multiplied by 23?",
    "Translate 'good morning, how are you?' into French.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "How do I boil an egg so that the yolk stays soft?",
    "Who wrote 'Pride and Prejudice'?",
    "List five animals that live in the Arctic.",
    "Explain what a black hole is to a ten-year-old.",
    "Rewrite this sentence to sound more formal: 'we gotta fix this bug asap'.",
    "What is photosynthesis?",
    "Suggest a name for a small coffee shop near the sea.",
    "How many days are there in a leap year, and why?",
    "Write a short email asking my manager for a day off next Friday.",
    "What does HTTP stand for, and what is it used for?",
    "Give me a simple recipe for pancakes.",
    "Why do we have seasons on Earth?",
    "Write a SQL query that returns the ten most recent orders from a table named orders.",
    "What is the difference between weather and climate?",
    "Tell me a fun fact about octopuses.",
)
CARD_MAX_NEW_TOKENS = 128
CARD_TEMPERATURE = 0.7
_FORWARD_POSITIONS = (1, 5, 9)


def write_card(directory: Path | None = None, acceptance_prompts: int = 6, log=print) -> dict:
    """Measures the fetched pair and writes DIR/card.json and DIR/model_card.md; returns the card.

    Agreement and costs run in this process; acceptance runs `draftwire serve` and `draftwire generate`
    as child processes, the way a user runs them. Raises RuntimeError when DIR holds no complete fetch
    or a child process fails.
    """
    import torch

    directory = Path(directory) if directory is not None else default_dir()
    if not is_fetched(directory):
        raise RuntimeError(
            f"no complete {MODEL_NAME} fetch in {directory}; run `draftwire models fetch smollm2`"
        )
    threads = torch.get_num_threads()
    # One thread throughout: the costs are per core by definition, and on a loaded two-core machine
    # two torch threads made a greedy step 17 times slower (2.4 s instead of 0.14 s) by waiting on
    # each other.
    torch.set_num_threads(1)
    try:
        with no_progress_bars():
            card = _measure(directory, acceptance_prompts, log)
    finally:
        torch.set_num_threads(threads)
    (directory / CARD_JSON).write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
    (directory / CARD_MD).write_text(render_card(card), encoding="utf-8")
    log(f"card: written to {directory / CARD_MD} ({card['seconds']:.0f} s)")
    return card


def _measure(directory: Path, acceptance_prompts: int, log) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started, machine = time.monotonic(), _machine()
    target_dir = directory / TARGET
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = [chat_ids(tokenizer, text) for text in CARD_PROMPTS]

    log(f"card: the target's greedy replies to {len(prompts)} held-out prompts")
    replies = [_greedy(model, ids, tokenizer.eos_token_id) for ids in prompts]
    log("card: the target's cost per forward on one thread")
    forward_ms = _target_forward_ms(model, prompts[0])
    del model

    drafts = []
    for kind in DRAFT_KINDS:
        path = draft_path(directory, kind)
        log(f"card: {path.name}: agreement and cost per token")
        drafts.append(
            {
                "kind": kind,
                "file": path.name,
                "bytes": path.stat().st_size,
                "agreement": _agreement(path, prompts, replies),
                "ms_per_token": _draft_ms_per_token(path, prompts[0]),
            }
        )
    log(f"card: acceptance through `draftwire serve` and `generate` on {acceptance_prompts} prompts")
    acceptance = _acceptance(
        target_dir, [draft_path(directory, d["kind"]) for d in drafts], prompts[:acceptance_prompts]
    )
    for draft in drafts:
        draft["acceptance"] = acceptance[draft["file"]]
        draft["cost_ratio"] = draft["ms_per_token"] / forward_ms["1"]

    return {
        "model": MODEL_NAME,
        "source": f"{PACKAGE}=={VERSION} ({SHIPPED_NAME})",
        "target": {
            "dir": TARGET,
            "dtype": "float32",
            "bytes": sum(p.stat().st_size for p in target_dir.iterdir() if p.is_file()),
            "parameters": _parameter_count(target_dir),
            "forward_ms": forward_ms,
        },
        "drafts": drafts,
        "prompts": {
            "count": len(prompts),
            "acceptance_count": min(acceptance_prompts, len(prompts)),
            "max_new_tokens": CARD_MAX_NEW_TOKENS,
            "mean_prompt_tokens": statistics.fmean(len(p) for p in prompts),
            "mean_reply_tokens": statistics.fmean(len(r) for r in replies),
        },
        "machine": machine,
        "seconds": round(time.monotonic() - started, 1),
    }


def _greedy(model, ids: list[int], eos: int) -> list[int]:
    """The target's greedy continuation, stopping after its end of turn."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=CARD_MAX_NEW_TOKENS, do_sample=False, pad_token_id=eos
        )
    return out[0, len(ids) :].tolist()


def _agreement(path: Path, prompts: list[list[int]], replies: list[list[int]]) -> float:
    """Teacher-forced: the share of reply positions where the draft's argmax is the target's token."""
    import numpy as np

    from edge_client.llama_runtime import Llama

    n_ctx = max(len(p) + len(r) for p, r in zip(prompts, replies, strict=True))
    llm = Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False)
    hits = total = 0
    try:
        for prompt, reply in zip(prompts, replies, strict=True):
            llm.reset()
            llm.eval(prompt + reply[:-1])
            # Row i of the scores predicts position i + 1: the reply starts at row len(prompt) - 1.
            scores = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) - 1 + len(reply)])
            hits += int((scores.argmax(-1) == np.asarray(reply)).sum())
            total += len(reply)
    finally:
        llm.close()
    return hits / total


def _draft_ms_per_token(path: Path, prompt: list[int], tokens: int = 48) -> float:
    """Median milliseconds of one single-token decode on one thread, after the prompt."""
    from edge_client.llama_runtime import Llama

    llm = Llama(
        model_path=str(path), n_ctx=len(prompt) + tokens + 8, n_threads=1, n_threads_batch=1, verbose=False
    )
    try:
        llm.eval(prompt)
        times = []
        token = prompt[-1]
        for _ in range(tokens):
            begin = time.perf_counter()
            llm.eval([token])
            times.append(time.perf_counter() - begin)
    finally:
        llm.close()
    return 1000 * statistics.median(times)


def _target_forward_ms(model, prompt: list[int], repeats: int = 7) -> dict[str, float]:
    """Median milliseconds of one forward over 1, 5 and 9 new positions on top of the prompt's KV cache
    (the caller sets one torch thread): what a verification round costs at gamma 0, 4 and 8."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
        kept = len(prompt) - 1
        result = {}
        for positions in _FORWARD_POSITIONS:
            new = torch.tensor([prompt[-1:] * positions])
            times = []
            for _ in range(repeats):
                cache.crop(kept - cache.get_seq_length())  # a negative count drops that many
                begin = time.perf_counter()
                model(input_ids=new, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - begin)
            result[str(positions)] = 1000 * statistics.median(times)
    return result


def _draftwire_command() -> list[str]:
    script = Path(sys.executable).parent / "draftwire"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "draftwire_cli"]


def _acceptance(target: Path, drafts: list[Path], prompts: list[list[int]]) -> dict[str, dict]:
    """Acceptance of real runs at generate's default settings, greedy and at T = 0.7 (seeded), through
    `draftwire serve` and `draftwire generate` child processes."""
    command = _draftwire_command()
    server = subprocess.Popen(
        # One torch thread, leaving the other core to the drafter (llama-cpp-python's default on two
        # cores is one thread): acceptance does not depend on speed, but the card's duration does.
        [*command, "serve", "--target", str(target), "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        address = _served_address(server)
        result = {}
        for draft in drafts:
            modes = {}
            for mode, flags in (
                ("greedy", []),
                (f"t{CARD_TEMPERATURE}", ["--temperature", str(CARD_TEMPERATURE)]),
            ):
                # No speeds: acceptance is fixed by the pair and the seed, speed by whatever else the
                # machine runs; `draftwire bench` measures speed on pinned cores.
                totals = {"draft_tokens": 0, "accepted_tokens": 0, "rounds": 0, "generated": 0}
                for seed, prompt in enumerate(prompts):
                    seeded = [*flags, "--seed", str(seed)] if flags else []
                    stats, generated = _generate(command, address, draft, prompt, seeded)
                    for key in ("draft_tokens", "accepted_tokens", "rounds"):
                        totals[key] += stats[key]
                    totals["generated"] += generated
                modes[mode] = {
                    "acceptance_rate": totals["accepted_tokens"] / max(totals["draft_tokens"], 1),
                    "tokens_per_round": totals["generated"] / max(totals["rounds"], 1),
                    **totals,
                }
            result[draft.name] = modes
        return result
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


def _served_address(server: subprocess.Popen, timeout: float = 180) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            break
        seen.append(line)
        match = re.search(r"draftwire: serving .* on (\S+:\d+)", line)
        if match:
            return match.group(1)
    raise RuntimeError("`draftwire serve` did not start:\n" + "".join(seen[-40:]))


def _generate(
    command: list[str], address: str, draft: Path, prompt: list[int], flags: list[str]
) -> tuple[dict, int]:
    ids = ",".join(map(str, prompt))
    argv = [*command, "generate", "--server", address, "--draft", str(draft), "--prompt-ids", ids]
    argv += ["--max-new-tokens", str(CARD_MAX_NEW_TOKENS), "--json", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"`draftwire generate` failed ({done.returncode}):\n{done.stderr[-3000:]}")
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    return reply["stats"], len(reply["token_ids"])


def _parameter_count(target: Path) -> int:
    from safetensors import safe_open

    count = 0
    for path in target.glob("*.safetensors"):
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                count += math.prod(shape)
    return count


def _machine() -> dict:
    """The machine, and how busy it was: the costs are wall-clock times on shared cores."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import llama_cpp
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "llama_cpp_python": llama_cpp.__version__,
    }


def render_card(card: dict) -> str:
    target, prompts, machine = card["target"], card["prompts"], card["machine"]
    ms, accepted = target["forward_ms"], prompts["acceptance_count"]
    sampled = f"t{CARD_TEMPERATURE}"
    lines = [
        f"# {card['model']}: the real pair",
        "",
        f"Made by `draftwire models fetch smollm2` from `{card['source']}`. The target is the shipped",
        "Q4_1 file dequantized exactly to float32, so the Q4_1 draft holds the target's own weights; the",
        "other drafts are requantized from that file by llama.cpp.",
        "",
        f"Target: {target['parameters'] / 1e6:.1f} M parameters, float32, {target['bytes'] / 1e6:.0f} MB. "
        "One forward on one torch thread,",
        f"over 1 / 5 / 9 new positions: {ms['1']:.1f} / {ms['5']:.1f} / {ms['9']:.1f} ms.",
        "",
        f"{prompts['count']} held-out chat prompts (mean {prompts['mean_prompt_tokens']:.0f} tokens with the "
        f"chat template), replies of up to {prompts['max_new_tokens']}",
        f"tokens (mean {prompts['mean_reply_tokens']:.0f}). Agreement is teacher-forced: the share of the "
        "target's greedy reply tokens that are",
        "the draft's argmax. Acceptance comes from real `draftwire serve` + `draftwire generate --json` runs",
        f"at generate's default settings on the first {accepted} prompts, greedy and at "
        f"T = {CARD_TEMPERATURE} (seeds 0 to {accepted - 1}).",
        "",
        "| draft | size | agreement | ms/token, 1 thread | cost vs target forward | acceptance greedy "
        f"| acceptance T={CARD_TEMPERATURE} | tokens/round greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in card["drafts"]:
        greedy, warm = d["acceptance"]["greedy"], d["acceptance"][sampled]
        cells = [
            f"`{d['file']}`",
            f"{d['bytes'] / 1e6:.1f} MB",
            f"{d['agreement']:.3f}",
            f"{d['ms_per_token']:.1f}",
            f"{d['cost_ratio']:.3f}",
            f"{greedy['acceptance_rate']:.3f}",
            f"{warm['acceptance_rate']:.3f}",
            f"{greedy['tokens_per_round']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"load average {machine['load_average_1min']} when the card began;",
        f"Python {machine['python']}, torch {machine['torch']}, "
        f"llama-cpp-python {machine['llama_cpp_python']}. The card took {card['seconds']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`python -m draftwire_cli.models.smollm2_card [--out DIR]`: the card of a fetched pair (what
    `draftwire models fetch smollm2 --card` runs after the fetch)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m draftwire_cli.models.smollm2_card")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--acceptance-prompts", type=int, default=6)
    args = parser.parse_args(argv)
    write_card(args.out or default_dir(), acceptance_prompts=args.acceptance_prompts)


if __name__ == "__main__":
    main()
