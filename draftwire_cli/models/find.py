"""Which model pair a name or a directory means: a fetched pair by its name (`draftwire models fetch NAME`),
or a pair directory (a target directory and `draft-*.gguf` files beside it, as `models/demo`)."""

from __future__ import annotations

from pathlib import Path

from draftwire_cli.models.demopair.files import PairFiles

# Which draft of a pair the demo runs, the first that the pair has: SmolLM2's shipped Q4_1 file, the demo
# pair's q8_0 (chosen by their cards' acceptance and speed).
DRAFT_PREFERENCE = ("q4_1", "q8_0", "q4_0", "f16")
DEMO_DRAFT = "q8_0"  # the committed demo pair's


def find_pair(models: Path | None) -> tuple[Path, Path]:
    """(target directory, draft GGUF) of a pair directory, or of a fetched pair named by `draftwire
    models fetch NAME` (`smollm2`, the default; draftwire_cli/models/pairs.py's); `models/demo` is the
    committed small pair. The draft is the first of DRAFT_PREFERENCE the pair has, else its only
    `draft-*.gguf`. Raises FileNotFoundError naming the command that makes the pair."""
    from draftwire_cli.models import chunks, smollm2
    from draftwire_cli.models.pairs import PAIRS

    fetched = {"smollm2": smollm2.default_dir(), **{n: chunks.default_dir(p) for n, p in PAIRS.items()}}
    name = "smollm2" if models is None else str(models)
    root = fetched[name] if name in fetched and not Path(name).is_dir() else Path(models)
    if name not in fetched and not root.is_dir():
        raise FileNotFoundError(
            f"{root}: no such directory (--models takes a pair directory, or a fetched pair's name: "
            f"{', '.join(fetched)})"
        )
    files = PairFiles(root)
    preferred = [files.gguf(kind) for kind in DRAFT_PREFERENCE if files.gguf(kind).is_file()]
    draft = preferred[0] if preferred else chunks.draft_file(root)
    if not (files.target / "config.json").is_file() or draft is None:
        if name in fetched:
            raise FileNotFoundError(f"no model pair in {files.root}: run `draftwire models fetch {name}`")
        raise FileNotFoundError(
            f"no model pair in {files.root}: a pair directory holds the target's transformers directory "
            "(target/) and a draft-*.gguf beside it, as `draftwire models fetch NAME` writes them"
        )
    return files.target, draft
