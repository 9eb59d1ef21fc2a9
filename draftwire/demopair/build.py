"""`draftwire models build`: tokenizer, target, distilled draft, GGUF exports and the model card.

Two stages, both run by default: `train` (tokenizer, target, draft, exports) and `card` (the
measured figures). Everything comes from the standard library of the running interpreter.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from draftwire.demopair.corpus import (
    CHAT_TEMPLATE,
    ROLE_TOKENS,
    chat_messages,
    chat_pairs,
    corpus_files,
)
from draftwire.demopair.train import (
    Shape,
    TokenData,
    TrainConfig,
    compute_per_token,
    distill_draft,
    make_model,
    train_target,
)
from draftwire.modelkit import export_gguf, quantize_gguf, train_bpe_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "models" / "demo"


@dataclass(frozen=True)
class BuildConfig:
    vocab_size: int = 4096  # byte-level BPE vocabulary
    max_positions: int = 1024  # context of both models
    target: Shape = Shape(hidden=320, layers=6, heads=10, kv_heads=5, intermediate=864, tie_embeddings=False)
    draft: Shape = Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=352, tie_embeddings=True)
    target_training: TrainConfig = TrainConfig(steps=900, seed=0)
    draft_training: TrainConfig = TrainConfig(steps=800, lr=3e-3, seed=1)
    threads: int = 2  # torch threads while training


QUICK = BuildConfig(
    vocab_size=512,
    max_positions=512,
    target=Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tie_embeddings=False),
    draft=Shape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, tie_embeddings=True),
    target_training=TrainConfig(steps=20, batch=4, seq_len=64, warmup=5),
    draft_training=TrainConfig(steps=20, batch=4, seq_len=64, warmup=5),
)


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


@dataclass
class BuildLog:
    lines: list[str] = field(default_factory=list)

    def __call__(self, message: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {message}"
        self.lines.append(stamped)
        print(stamped, flush=True)


def token_data(tokenizer, max_tokens: int | None = None) -> TokenData:
    """The training files and the training chat pairs as token streams."""
    files = corpus_files(heldout=False)
    eos = tokenizer.eos_token_id
    code: list[int] = []
    for ids in tokenizer([f.text for f in files])["input_ids"]:
        code += [*ids, eos]
    chat, starts = [], []
    for pair in chat_pairs(files):
        text = tokenizer.apply_chat_template(chat_messages(pair), tokenize=False)
        starts.append(len(chat))
        chat += tokenizer(text)["input_ids"]
    if max_tokens:
        code, chat = code[:max_tokens], chat[:max_tokens]
        starts = [s for s in starts if s < len(chat)]
    return TokenData(torch.tensor(code), torch.tensor(chat), torch.tensor(starts))


def _save(model, tokenizer, out: Path) -> None:
    # bfloat16 on disk halves the size; the engine loads float32 on CPU.
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.to(torch.float32)


def build_models(config: BuildConfig, files: PairFiles, log: BuildLog) -> dict:
    """The train stage: returns its figures (times, sizes, parameter counts)."""
    torch.set_num_threads(config.threads)
    files.root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_files = corpus_files(heldout=False)
    log(f"corpus: {len(train_files)} training files, {sum(len(f.text) for f in train_files)} characters")
    tokenizer_dir = train_bpe_tokenizer(
        (f.text for f in train_files), config.vocab_size, files.root / "tokenizer", CHAT_TEMPLATE, ROLE_TOKENS
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    quick = config.vocab_size < 1024
    data = token_data(tokenizer, max_tokens=200_000 if quick else None)
    log(f"tokens: {len(data.code)} code, {len(data.chat)} chat in {len(data.chat_starts)} conversations")
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.target_training.seed)
    target = make_model(config.target, len(tokenizer), config.max_positions, special)
    target_run = train_target(target, data, config.target_training, log)
    _save(target, tokenizer, files.target)
    torch.manual_seed(config.draft_training.seed)
    draft = make_model(config.draft, len(tokenizer), config.max_positions, special)
    draft_run = distill_draft(draft, target, data, config.draft_training, log)
    _save(draft, tokenizer, files.draft_hf)
    export_gguf(files.draft_hf, files.gguf("f16"), "f16")
    export_gguf(files.draft_hf, files.gguf("q8_0"), "q8_0")
    f32 = export_gguf(files.draft_hf, files.root / "draft-f32.gguf", "f32")
    quantize_gguf(f32, files.gguf("q4_0"), "q4_0")
    f32.unlink()
    log("exported the draft as f16, q8_0 and q4_0 GGUF")
    return {
        "tokens": {"code": len(data.code), "chat": len(data.chat), "conversations": len(data.chat_starts)},
        "target": {
            "parameters": sum(p.numel() for p in target.parameters()),
            "compute_per_token": compute_per_token(target),
            "training": target_run,
        },
        "draft": {
            "parameters": sum(p.numel() for p in draft.parameters()),
            "compute_per_token": compute_per_token(draft),
            "training": draft_run,
        },
        "draft_to_target_compute": compute_per_token(draft) / compute_per_token(target),
        "build_seconds": time.perf_counter() - start,
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "config": asdict(config),
    }


def build(out: Path, stages: tuple[str, ...] = ("train", "card"), quick: bool = False) -> Path:
    """Runs the stages into `out`; returns the card's path. Raises what training and export raise."""
    config = QUICK if quick else BuildConfig()
    files = PairFiles(out)
    log = BuildLog()
    if "train" in stages:
        figures = build_models(config, files, log)
        files.card_json.write_text(json.dumps({"build": figures}, indent=2) + "\n")
    if "card" in stages:
        from draftwire.demopair.card import write_card

        write_card(files, log, quick=quick)
    return files.root / "model_card.md"
