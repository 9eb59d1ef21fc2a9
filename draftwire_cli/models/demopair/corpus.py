"""The demo corpus: the running interpreter's standard-library source, split by file, and its chat form.

The split is a hash of each file's relative path, so it does not move when files are added or removed.
The chat form pairs a function's docstring (the request) with the function's source (the answer).
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

# Directories that hold tests, vendored packages or generated tables rather than ordinary code.
_SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
_MAX_FILE_BYTES = 300_000

WINDOW = 256  # tokens per held-out evaluation window

ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# Rendered the same by transformers' apply_chat_template and edge_client.chat.render_chat. Each turn
# ends with the EOS token, so an answer stops by itself.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


@dataclass(frozen=True)
class CorpusFile:
    path: Path  # relative to the standard library
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: Path, every: int = 20) -> bool:
    """One file in `every`, chosen by a hash of its path: never trained on."""
    return int(hashlib.sha1(relative.as_posix().encode()).hexdigest(), 16) % every == 0


def corpus_files(heldout: bool, root: Path | None = None) -> list[CorpusFile]:
    """The training (heldout=False) or held-out (heldout=True) files, in path order."""
    root = root or stdlib_dir()
    paths = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_PARTS]  # pruned, not walked then dropped
        paths += [Path(folder) / n for n in names if n.endswith(".py")]
    files = []
    for path in sorted(paths):
        relative = path.relative_to(root)
        if path.stat().st_size > _MAX_FILE_BYTES:
            continue
        if is_heldout(relative) != heldout:
            continue
        files.append(CorpusFile(relative, path.read_text(encoding="utf-8", errors="replace")))
    return files


@dataclass(frozen=True)
class ChatPair:
    request: str  # the docstring's first paragraph
    answer: str  # the function's source


def chat_pairs(files: list[CorpusFile], max_answer_chars: int = 1200) -> list[ChatPair]:
    """Docstring-to-function pairs mined with `ast`: short functions with a real docstring."""
    pairs = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(f.text, node)
            if not doc or not source:
                continue
            request = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            answer = textwrap.dedent(" " * node.col_offset + source)
            if 20 <= len(request) <= 300 and len(answer) <= max_answer_chars:
                pairs.append(ChatPair(request, answer))
    return pairs


def chat_messages(pair: ChatPair) -> list[dict[str, str]]:
    return [{"role": "user", "content": pair.request}, {"role": "assistant", "content": pair.answer}]


def heldout_stream(tokenizer) -> list[int]:
    """Every held-out file's tokens, EOS-separated, in path order."""
    stream: list[int] = []
    for ids in tokenizer([f.text for f in corpus_files(heldout=True)])["input_ids"]:
        stream += [*ids, tokenizer.eos_token_id]
    return stream


def heldout_windows(tokenizer, count: int, length: int = WINDOW) -> list[list[int]]:
    """Consecutive, non-overlapping windows of the held-out stream."""
    stream = heldout_stream(tokenizer)
    windows = [stream[i * length : (i + 1) * length] for i in range(min(count, len(stream) // length))]
    return windows
