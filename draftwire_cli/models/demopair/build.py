"""`draftwire models build`: tokenizer, target, distilled draft, GGUF exports and the model card.

Three stages, all run by default: `target` (tokenizer, target), `draft` (distillation from the saved
target, GGUF exports) and `card` (the measured figures). Everything comes from the standard library
of the running interpreter.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftwire_cli.models.demopair.card import write_card
from draftwire_cli.models.demopair.corpus import (
    CHAT_TEMPLATE,
    ROLE_TOKENS,
    chat_messages,
    chat_pairs,
    corpus_files,
)
from draftwire_cli.models.demopair.files import PairFiles
from draftwire_cli.models.demopair.train import (
    Shape,
    TokenData,
    TrainConfig,
    compute_per_token,
    distill_draft,
    make_model,
    target_continuations,
    train_target,
)
from draftwire_cli.models.kit import export_gguf, quantize_gguf, train_bpe_tokenizer


@dataclass(frozen=True)
class BuildConfig:
    vocab_size: int = 4096  # byte-level BPE vocabulary
    max_positions: int = 1024  # context of both models
    target: Shape = Shape(hidden=320, layers=6, heads=10, kv_heads=5, intermediate=864, tie_embeddings=False)
    draft: Shape = Shape(hidden=192, layers=2, heads=6, kv_heads=3, intermediate=512, tie_embeddings=True)
    target_training: TrainConfig = TrainConfig(steps=900, seed=0)
    # Half the draft's windows are the target's own greedy continuations: the contexts it meets when
    # the target's output is the prefix, as in speculation.
    draft_training: TrainConfig = TrainConfig(steps=1800, lr=3e-3, generated_share=0.6, seed=1)
    generated_rows: int = 1536  # target continuations for the draft's training
    generated_prompt: int = 96  # code tokens each continuation starts from
    threads: int = 2  # torch threads while training


QUICK = BuildConfig(
    vocab_size=512,
    max_positions=512,
    target=Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tie_embeddings=False),
    draft=Shape(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, tie_embeddings=True),
    target_training=TrainConfig(steps=20, batch=4, seq_len=64, warmup=5),
    draft_training=TrainConfig(steps=20, batch=4, seq_len=64, warmup=5, generated_share=0.5),
    generated_rows=8,
    generated_prompt=32,
)


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


def _machine() -> dict:
    return {
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _cpu_model() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def build_target(config: BuildConfig, files: PairFiles, log: BuildLog) -> dict:
    """The target stage: tokenizer and target. Returns its figures."""
    start = time.perf_counter()
    train_files = corpus_files(heldout=False)
    log(f"corpus: {len(train_files)} training files, {sum(len(f.text) for f in train_files)} characters")
    tokenizer_dir = train_bpe_tokenizer(
        (f.text for f in train_files), config.vocab_size, files.root / "tokenizer", CHAT_TEMPLATE, ROLE_TOKENS
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = token_data(tokenizer, max_tokens=200_000 if config.vocab_size < 1024 else None)
    log(f"tokens: {len(data.code)} code, {len(data.chat)} chat in {len(data.chat_starts)} conversations")
    torch.manual_seed(config.target_training.seed)
    target = make_model(config.target, len(tokenizer), config.max_positions, _special(tokenizer))
    run = train_target(target, data, config.target_training, log)
    _save(target, tokenizer, files.target)
    return {
        "tokens": {"code": len(data.code), "chat": len(data.chat), "conversations": len(data.chat_starts)},
        "parameters": sum(p.numel() for p in target.parameters()),
        "compute_per_token": compute_per_token(target),
        "training": run,
        "seconds": time.perf_counter() - start,
    }


def build_draft(config: BuildConfig, files: PairFiles, log: BuildLog) -> dict:
    """The draft stage: distils the saved target into the draft and exports it. Returns its figures."""
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(files.target)
    target = AutoModelForCausalLM.from_pretrained(files.target, dtype=torch.float32).eval()
    data = token_data(tokenizer, max_tokens=200_000 if config.vocab_size < 1024 else None)
    training = config.draft_training
    data.generated = target_continuations(
        target, data, config.generated_rows, training.seq_len + 1, config.generated_prompt, training.seed, log
    )
    torch.manual_seed(training.seed)
    draft = make_model(config.draft, len(tokenizer), config.max_positions, _special(tokenizer))
    run = distill_draft(draft, target, data, training, log)
    _save(draft, tokenizer, files.draft_hf)
    export_gguf(files.draft_hf, files.gguf("f16"), "f16")
    export_gguf(files.draft_hf, files.gguf("q8_0"), "q8_0")
    f32 = export_gguf(files.draft_hf, files.root / "draft-f32.gguf", "f32")
    quantize_gguf(f32, files.gguf("q4_0"), "q4_0")
    f32.unlink()
    log("exported the draft as f16, q8_0 and q4_0 GGUF")
    return {
        "parameters": sum(p.numel() for p in draft.parameters()),
        "compute_per_token": compute_per_token(draft),
        "to_target_compute": compute_per_token(draft) / compute_per_token(target),
        "training": run,
        "seconds": time.perf_counter() - start,
    }


def _special(tokenizer) -> dict[str, int]:
    return dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


STAGES = ("target", "draft", "card")


def build(out: Path, stages: tuple[str, ...] = STAGES, quick: bool = False) -> Path:
    """Runs the stages into `out`; returns the card's path. Raises what training and export raise."""
    config = QUICK if quick else BuildConfig()
    torch.set_num_threads(config.threads)
    files = PairFiles(out)
    files.root.mkdir(parents=True, exist_ok=True)
    log = BuildLog()
    card = json.loads(files.card_json.read_text()) if files.card_json.is_file() else {}
    built = card.setdefault("build", {})
    for stage, step in (("target", build_target), ("draft", build_draft)):
        if stage in stages:
            built[stage] = step(config, files, log)
            built["config"] = asdict(config)
            built["machine"] = _machine()
            files.card_json.write_text(json.dumps(card, indent=2) + "\n")
    if "card" in stages:
        write_card(files, log, quick=quick)
    return files.root / "model_card.md"
