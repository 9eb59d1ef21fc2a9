"""The locally built test models: llama.cpp and transformers must see the same tokens and the same model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from draftwire_cli.models import kit as modelkit
from draftwire_cli.models.kit import TestPair, build_test_pair, stdlib_texts
from edge_client.llama_runtime import Llama

# Text the tokenizer never saw: build_test_pair trains on the first 400k characters of the same files.
_HELD_OUT = "".join(stdlib_texts(8000, skip_chars=1_000_000))

_EDGE_CASES = [
    "",
    " ",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\ttabbed\n",
    "\t\tdef f(x):\n        return x  # done\r\n",
    "héllo wörld, ünïcödé\u00a0nbsp and \u200b zero width",
    "日本語のテキストと中文",
    "emoji 🚀🦙 😶\u200d🌫️ ✅",
    "😀" * 12,
    "digits 0 12 345 6789 3.14159 1e-9 0x1F 1_000_000",
    "I've 'RE you'll 'd",
    "a" * 100,
    "\x00\x01 control",
]


@pytest.fixture(scope="module")
def pair(test_pair: TestPair) -> TestPair:
    # conftest's session-wide pair, built once by build_test_pair for every test module.
    return test_pair


@pytest.fixture(scope="module")
def tokenizer(pair: TestPair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair.target_dir)


@pytest.fixture(scope="module")
def target(pair: TestPair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pair.target_dir).eval()


@pytest.fixture(scope="module")
def vocab_only(pair: TestPair) -> Iterator[Llama]:
    llm = Llama(model_path=str(pair.draft_f16), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def _llama_logits(path: Path, token_ids: list[int]) -> np.ndarray:  # [len(token_ids), vocab]
    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)
    try:
        llm.eval(token_ids)
        return np.array(llm.scores[: len(token_ids)])
    finally:
        llm.close()


def _target_logits(target, token_ids: list[int]) -> np.ndarray:  # [len(token_ids), vocab]
    with torch.no_grad():
        return target(torch.tensor([token_ids])).logits[0].numpy()


def test_build_is_idempotent(pair: TestPair) -> None:
    assert pair.is_complete()
    before = pair.draft_f16.stat().st_mtime_ns
    assert build_test_pair(pair.target_dir.parent) == pair
    assert pair.draft_f16.stat().st_mtime_ns == before


def test_target_loads_with_matching_special_ids(pair: TestPair, tokenizer, target) -> None:
    assert len(tokenizer) == target.config.vocab_size == 512
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    config = target.config
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert not config.tie_word_embeddings
    assert target.dtype == torch.float32
    assert all(len(token) <= 32 for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def test_gguf_metadata_says_gpt2_and_no_bos(pair: TestPair, tokenizer) -> None:
    for path in (pair.draft_f16, pair.draft_q4_0, pair.other_draft_f16):
        fields = GGUFReader(path).fields
        assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
        assert fields["tokenizer.ggml.add_bos_token"].contents() is False
        assert fields["tokenizer.ggml.bos_token_id"].contents() == tokenizer.bos_token_id
        assert fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id
        # Same spelling of every token on both sides, so a vocabulary fingerprint can be compared.
        tokens = fields["tokenizer.ggml.tokens"].contents()
        assert tokens == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    types = {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(pair.draft_q4_0).tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q4_0"


@pytest.mark.parametrize("text", [_HELD_OUT, *_EDGE_CASES], ids=["held_out", *map(repr, _EDGE_CASES)])
def test_llama_cpp_tokenizes_like_transformers(text: str, tokenizer, vocab_only) -> None:
    expected = tokenizer(text)["input_ids"]
    assert vocab_only.tokenize(text.encode(), add_bos=True, special=False) == expected
    assert vocab_only.detokenize(expected).decode() == text
    assert tokenizer.decode(expected) == text


def test_held_out_text_is_long_and_compressed(tokenizer) -> None:
    assert len(_HELD_OUT) >= 8000
    assert len(tokenizer(_HELD_OUT)["input_ids"]) < 0.75 * len(_HELD_OUT)


def test_special_token_text_needs_special_parsing_in_llama_cpp(tokenizer, vocab_only) -> None:
    # transformers parses "<s>" in text as the special token; llama.cpp only does so with special=True.
    text = "<s>x</s>"
    expected = tokenizer(text)["input_ids"]
    assert expected[0] == tokenizer.bos_token_id
    assert vocab_only.tokenize(text.encode(), add_bos=True, special=True) == expected
    assert vocab_only.tokenize(text.encode(), add_bos=True, special=False) != expected


def test_target_logits_are_peaked(target, tokenizer) -> None:
    token_ids = tokenizer(_HELD_OUT)["input_ids"]
    top2 = torch.tensor(_target_logits(target, token_ids[:256])).topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.5


def test_incremental_greedy_matches_one_forward(target, tokenizer) -> None:
    prompt = tokenizer(_HELD_OUT)["input_ids"][:20]
    with torch.no_grad():
        generated = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0].tolist()
    # Greedy continuation computed one position per forward must be the argmax of one forward over all.
    assert (
        _target_logits(target, generated)[len(prompt) - 1 : -1].argmax(-1).tolist()
        == generated[len(prompt) :]
    )
    assert len(set(generated[len(prompt) :])) > 5


def test_f16_gguf_computes_the_target(pair: TestPair, target, tokenizer) -> None:
    prompt = tokenizer(_HELD_OUT)["input_ids"][:60]
    expected = _target_logits(target, prompt)
    actual = _llama_logits(pair.draft_f16, prompt)
    assert actual.shape == expected.shape == (60, 512)
    assert (actual.argmax(-1) == expected.argmax(-1)).mean() >= 0.95
    assert np.abs(actual - expected).max() < 0.5
    assert np.abs(actual - expected).mean() < 0.05


def test_q4_0_runs_and_other_draft_differs(pair: TestPair, target, tokenizer) -> None:
    prompt = tokenizer(_HELD_OUT)["input_ids"][:60]
    expected = _target_logits(target, prompt).argmax(-1)
    quantized = _llama_logits(pair.draft_q4_0, prompt)
    other = _llama_logits(pair.other_draft_f16, prompt)
    assert np.isfinite(quantized).all() and np.isfinite(other).all()
    quantized_agree = (quantized.argmax(-1) == expected).mean()
    other_agree = (other.argmax(-1) == expected).mean()
    assert quantized_agree > 0.3
    assert other_agree < 0.2 < quantized_agree - other_agree


def test_export_rejects_unknown_outtype(pair: TestPair, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outtype"):
        modelkit.export_gguf(pair.target_dir, tmp_path / "x.gguf", "q4_k")


def test_export_failure_reports_converter_stderr(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(RuntimeError, match="convert_hf_to_gguf failed"):
        modelkit.export_gguf(tmp_path, tmp_path / "x.gguf", "f16")


def test_missing_llama_cpp_source_names_install_script(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="install.sh"):
        modelkit.export_gguf(tmp_path, tmp_path / "x.gguf", "f16", llama_cpp_src=tmp_path / "nowhere")


def test_quantize_failure_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qtype"):
        modelkit.quantize_gguf(tmp_path / "in.gguf", tmp_path / "out.gguf", "q2_k")
    (tmp_path / "in.gguf").write_bytes(b"not a gguf")
    with pytest.raises(RuntimeError, match="llama_model_quantize"):
        modelkit.quantize_gguf(tmp_path / "in.gguf", tmp_path / "out.gguf", "q4_0")
    assert not list(tmp_path.glob("out.gguf*"))
