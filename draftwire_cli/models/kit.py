"""Builds small random Llama models, their tokenizer and their GGUF exports entirely from local data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

_BOS, _EOS, _PAD = "<s>", "</s>", "<pad>"

# llama.cpp's token_to_piece writes into a 32-byte buffer, so a longer token would detokenize to nothing.
_MAX_TOKEN_BYTES = 32

_OUTTYPES = ("f32", "f16", "q8_0")

# Runs llama.cpp's converter with two facts about our tokenizer patched in, instead of copying its code:
# - it refuses a BPE pre-tokenizer whose hash it does not know; ours is a ByteLevel pre-tokenizer with
#   GPT-2's regex, which is exactly what llama.cpp calls "gpt-2";
# - its Llama vocabulary loader tries sentencepiece first and, without that package installed, dies on
#   the ImportError instead of falling back; ours is always a GPT-2-style BPE, so go there directly.
# Putting gguf-py first makes the converter use its own gguf package, as it does when run as a script.
_CONVERT_PROGRAM = """
import sys
llama_dir, argv = sys.argv[1], sys.argv[2:]
sys.path[:0] = [llama_dir + "/gguf-py", llama_dir]
from conversion.base import TextModel
from conversion.llama import LlamaModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
LlamaModel.set_vocab = TextModel._set_vocab_gpt2
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *argv]
convert_hf_to_gguf.main()
"""


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: Path,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
) -> Path:
    """Trains a byte-level BPE tokenizer and saves it as a transformers tokenizer directory.

    No BOS is added on encode, and the GGUF export inherits that (`tokenizer.ggml.add_bos_token`
    false), so `tok(text)["input_ids"]` and llama.cpp's `tokenize(..., add_bos=True)` agree.

    Raises ValueError if vocab_size cannot hold the 256 byte tokens and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [_BOS, _EOS, _PAD, *extra_special_tokens]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"vocab_size {vocab_size} < {len(alphabet) + len(specials)} (bytes + specials)")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # A ByteLevel post-processor adds nothing; the converter reads it as "no BOS, no EOS".
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        # Every byte gets a token, so any text (emoji, unseen scripts) encodes without an unknown token.
        initial_alphabet=alphabet,
        max_token_length=_MAX_TOKEN_BYTES,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=_BOS, eos_token=_EOS, pad_token=_PAD)
    if extra_special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
    if chat_template is not None:
        fast.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Said explicitly too, because the converter also reads these flags from tokenizer_config.json.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(add_bos_token=False, add_eos_token=False)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


def make_random_llama(
    tokenizer_dir: Path,
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 512,
    seed: int = 0,
    init_std: float = 0.1,
    lm_head_std: float = 1.0,
) -> Path:
    """Saves a float32 LlamaForCausalLM with random weights (safetensors) next to the tokenizer files.

    lm_head_std is large so that the logits are peaked: greedy decoding then picks the same token
    whether positions are computed one per forward or several at once (those differ at 1e-6).

    Raises OSError if the tokenizer directory cannot be loaded.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    # Copied rather than re-saved: a re-save drops our add_bos_token flags and adds loader state.
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            shutil.copyfile(path, out_dir / path.name)
    return out_dir


def llama_cpp_source_dir() -> Path:
    """Returns the extracted llama-cpp-python source distribution under third_party/.

    Raises FileNotFoundError if it (or the llama.cpp converter inside it) is missing.
    """
    source = Path(__file__).resolve().parents[2] / "third_party" / "llama-cpp-python"
    if not (source / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(
            f"llama.cpp's converter is missing under {source}; run `bash install.sh` from the repository root"
        )
    return source


def export_gguf(
    hf_dir: Path, out_path: Path, outtype: str = "f16", llama_cpp_src: Path | None = None
) -> Path:
    """Converts a transformers Llama directory to GGUF with llama.cpp's own converter.

    Raises ValueError for an unknown outtype, FileNotFoundError if the llama.cpp source is missing,
    and RuntimeError (with the converter's stderr tail) if the conversion fails.
    """
    if outtype not in _OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {_OUTTYPES}")
    llama_dir = (llama_cpp_src or llama_cpp_source_dir()) / "vendor" / "llama.cpp"
    if not (llama_dir / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py in {llama_dir}; run `bash install.sh`")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(out_path)
    argv = [str(hf_dir), "--outfile", str(partial), "--outtype", outtype]
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT_PROGRAM, str(llama_dir), *argv],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"convert_hf_to_gguf failed (exit {done.returncode}) on {hf_dir}:\n{done.stderr[-3000:]}"
        )
    return partial.replace(out_path)


def quantize_gguf(src: Path, dst: Path, qtype: str = "q4_0") -> Path:
    """Quantizes an f32/f16 GGUF with llama.cpp's quantizer; q4_0 needs row sizes divisible by 32.

    Raises ValueError for an unknown qtype and RuntimeError if llama.cpp reports a failure.
    """
    import llama_cpp

    from edge_client.llama_runtime import load_backends

    load_backends()
    ftypes = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}
    if qtype not in ftypes:
        raise ValueError(f"qtype {qtype!r} is not one of {tuple(ftypes)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftypes[qtype]
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial(dst)
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(partial).encode(), params)
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {qtype}) returned {status}")
    return partial.replace(dst)


def _partial(path: Path) -> Path:
    # Written under another name and renamed when whole, so an interrupted build never leaves a
    # truncated file where build_test_pair would take it as done.
    return path.with_name(path.name + ".partial")


def stdlib_texts(max_chars: int, skip_chars: int = 0) -> list[str]:
    """Reads the standard library's top-level .py files in name order, after skipping skip_chars of
    them, until max_chars are collected: the same local text on every run of the same Python.

    Raises FileNotFoundError if the standard library sources are not installed.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py sources in {stdlib}")
    texts: list[str] = []
    skipped = collected = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if skipped < skip_chars:
            skipped += len(text)
            continue
        texts.append(text[: max_chars - collected])
        collected += len(texts[-1])
        if collected >= max_chars:
            break
    return texts


# Enough text for 512 tokens' worth of merges while training stays well under a second.
_TRAINING_CHARS = 400_000


@dataclass(frozen=True)
class TestPair:
    """A target and its drafts that share one tokenizer."""

    __test__ = False  # not a pytest test class despite the name

    target_dir: Path  # transformers LlamaForCausalLM + tokenizer, seed 0
    draft_f16: Path  # the target itself as an f16 GGUF: a draft that almost always agrees
    draft_q4_0: Path  # the target quantized to q4_0: a draft that mostly agrees
    other_draft_f16: Path  # a different random model (seed 1), same tokenizer: a draft that rarely agrees

    def is_complete(self) -> bool:
        files = [self.draft_f16, self.draft_q4_0, self.other_draft_f16]
        files += [self.target_dir / "config.json", self.target_dir / "model.safetensors"]
        files += [self.target_dir / "tokenizer.json"]
        return all(path.is_file() for path in files)


def build_test_pair(out_dir: Path, vocab_size: int = 512) -> TestPair:
    """Builds (or returns the complete one already in out_dir) a target, its f16 and q4_0 GGUF
    exports and an unrelated f16 draft, all sharing a tokenizer trained on standard-library source.

    Raises what train_bpe_tokenizer, export_gguf and quantize_gguf raise.
    """
    pair = TestPair(
        target_dir=out_dir / "target",
        draft_f16=out_dir / "target-f16.gguf",
        draft_q4_0=out_dir / "target-q4_0.gguf",
        other_draft_f16=out_dir / "other-f16.gguf",
    )
    if pair.is_complete():
        return pair
    tokenizer_dir = train_bpe_tokenizer(stdlib_texts(_TRAINING_CHARS), vocab_size, out_dir / "tokenizer")
    make_random_llama(tokenizer_dir, pair.target_dir, seed=0)
    # Quantizing the f16 export saves a converter run (seconds of imports); q4_0's rounding dwarfs f16's.
    quantize_gguf(export_gguf(pair.target_dir, pair.draft_f16, "f16"), pair.draft_q4_0, "q4_0")
    other_dir = make_random_llama(tokenizer_dir, out_dir / "other", seed=1, num_layers=1)
    export_gguf(other_dir, pair.other_draft_f16, "f16")
    return pair
