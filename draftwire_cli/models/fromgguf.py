"""From a GGUF file to the parts of a pair: a transformers target written from its tensors, drafts
requantized by llama.cpp, and the small file and loader helpers the model fetchers share
(draftwire_cli/models/smollm2.py, draftwire_cli/models/chunks.py)."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


@contextlib.contextmanager
def no_progress_bars():
    """transformers draws bars while reading a GGUF (plain tqdm, called from its GGUF module; TQDM_DISABLE
    is read once, when tqdm is imported, so the module's name is rebound instead) and while loading a
    model (its own switch)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    bar = gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if enabled:
            hf_logging.enable_progress_bar()


def copy_file(source: Path, destination: Path) -> None:
    """Copies through a .partial file, so an interrupted copy is never taken for a whole one."""
    partial = destination.with_name(destination.name + ".partial")
    shutil.copyfile(source, partial)
    partial.replace(destination)


def write_target(
    source: Path, destination: Path, dtype: str = "float32", pre_tokenizer: Callable | None = None
) -> None:
    """A transformers directory from a GGUF: safetensors in `dtype` (float32 keeps a quantized file's
    values exactly; bfloat16 halves the memory, and every verifier dtype then computes with the same
    weights), config, tokenizer, chat template. `pre_tokenizer()`, when given, replaces the tokenizer's
    pre-tokenizer (where transformers' GGUF reader does not rebuild llama.cpp's).

    Raises RuntimeError when the file's tensors do not fit the architecture its metadata names."""
    import numpy as np
    import torch
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
    model.to(getattr(torch, dtype))
    left_on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if left_on_meta:
        raise RuntimeError(f"no weights in {source.name} for {left_on_meta[:5]}")
    model.save_pretrained(partial, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    if pre_tokenizer is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizer()
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
    with stderr_to_file() as log:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"llama_model_quantize({source} -> {destination}, {kind}) returned {status}:\n"
            + log.read()[-3000:]
        )
    return partial.replace(destination)


@contextlib.contextmanager
def stderr_to_file():
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


def record_hash(path: Path) -> str:
    """sha256 in RECORD's spelling: urlsafe base64 without padding."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")


def models_dir(name: str) -> Path:
    """Where a fetched pair lives without --out: $XDG_DATA_HOME/draftwire/models/NAME."""
    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "draftwire" / "models" / name


def file_records(directory: Path, skip: tuple[str, ...]) -> dict[str, dict]:
    """A manifest's `files`: every file under `directory` (but the names in `skip` and anything in a
    hidden directory, such as an interrupted fetch's work space) with its size and sha256."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name not in skip and not any(part.startswith(".") for part in Path(name).parts[:-1]):
            files[name] = {"bytes": path.stat().st_size, "sha256": record_hash(path)}
    return files


def files_present(directory: Path, files: dict[str, dict]) -> bool:
    """Whether a manifest's `files` are all there with their sizes. Sizes, not hashes: a second fetch
    should cost nothing; a changed file of the same size is not something a fetch guards against."""
    return bool(files) and all(
        (directory / name).is_file() and (directory / name).stat().st_size == entry["bytes"]
        for name, entry in files.items()
    )
