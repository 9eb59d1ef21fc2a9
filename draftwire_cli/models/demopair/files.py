"""Where a model pair's files lie: the one record that building, the card, the demo and the tests share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The committed demo pair.
DEFAULT_OUT = Path(__file__).resolve().parents[3] / "models" / "demo"


@dataclass(frozen=True)
class PairFiles:
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def draft_hf(self) -> Path:
        return self.root / "draft"

    def gguf(self, kind: str) -> Path:
        return self.root / f"draft-{kind}.gguf"

    @property
    def card_json(self) -> Path:
        return self.root / "card.json"
