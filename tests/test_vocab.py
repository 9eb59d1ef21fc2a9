"""Fingerprints by meaning: transformers and llama.cpp agree on real vocabularies and tell others apart."""

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from llama_cpp import Llama
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from draftwire.vocab import vocabulary_from_hf, vocabulary_from_llama

ROOT = Path(__file__).resolve().parent.parent
VOCABS = ROOT / "third_party" / "llama-cpp-python" / "vendor" / "llama.cpp" / "models"
GGUFS = sorted(p.name for p in VOCABS.glob("ggml-vocab-*.gguf")) if VOCABS.is_dir() else []
DEMO = ROOT / "models" / "demo"

needs_vocabs = pytest.mark.skipif(not GGUFS, reason=f"no llama.cpp vocabulary GGUFs under {VOCABS}")

# transformers builds these tokenizers from the GGUF, but not the vocabulary the file holds, so the
# fingerprints rightly differ (strict: when a transformers upgrade fixes one, the entry must go).
CONVERSION_CHANGES_THE_VOCABULARY = {
    "ggml-vocab-deepseek-coder.gguf": "transformers re-spells the fullwidth control tokens "
    "(<｜begin▁of▁sentence｜>...) as byte-level text pieces and adds BOS/EOS again as new ids",
    "ggml-vocab-deepseek-llm.gguf": "transformers re-spells the fullwidth control tokens as byte-level text "
    "pieces and adds BOS/EOS again as new ids",
    "ggml-vocab-command-r.gguf": "the file stores ~1,400 byte-level tokens as raw UTF-8: llama.cpp decodes "
    "them to [UNK_BYTE_...], transformers re-spells them and loses 43 ids to the resulting duplicates",
    "ggml-vocab-gpt-neox.gguf": "transformers re-spells the user-defined whitespace tokens into the spelling "
    "of existing pieces, so 23 ids ('ĠĠ'...) vanish from its vocabulary",
    "ggml-vocab-mpt.gguf": "the GPT-NeoX vocabulary: its user-defined whitespace tokens collide with "
    "existing pieces in transformers, so 23 ids vanish",
    "ggml-vocab-nomic-bert-moe.gguf": "transformers builds a T5 tokenizer and renames llama.cpp's padding "
    "[PADn] to T5's <extra_id_n>, so the padding is no longer recognisable as padding",
}
# Different files holding one vocabulary: Qwen3.5 changed only the pre-tokenizer's regex, MPT uses
# GPT-NeoX's tokenizer.
SAME_VOCABULARY = (
    {"ggml-vocab-qwen2.gguf", "ggml-vocab-qwen35.gguf"},
    {"ggml-vocab-gpt-neox.gguf", "ggml-vocab-mpt.gguf"},
)

_llama_views: dict[str, object] = {}


def llama_view(path: Path):
    """llama.cpp's vocabulary of a GGUF and its token count, cached: the pairwise test reads them all."""
    key = str(path)
    if key not in _llama_views:
        llm = Llama(model_path=key, vocab_only=True, verbose=False)
        _llama_views[key] = (vocabulary_from_llama(llm), llm.n_vocab())
        llm.close()
    return _llama_views[key]


def transformers_view(directory: Path, name: str):
    """The tokenizer transformers builds from a GGUF. The generic fast class runs the same GGUF
    conversion as AutoTokenizer without building the model's config first, which is ten times faster
    and works for architectures whose config transformers cannot build (baichuan, gemma-4, ...)."""
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory), gguf_file=name)
    except ValueError as e:  # what transformers raises for a tokenizer type it has no builder for
        pytest.skip(f"transformers cannot build a tokenizer from {name}: {str(e).splitlines()[0][:200]}")


def _params():
    for name in GGUFS:
        marks = []
        if name in CONVERSION_CHANGES_THE_VOCABULARY:
            marks.append(pytest.mark.xfail(strict=True, reason=CONVERSION_CHANGES_THE_VOCABULARY[name]))
        yield pytest.param(name, marks=marks, id=name.removeprefix("ggml-vocab-").removesuffix(".gguf"))


@needs_vocabs
@pytest.mark.parametrize("name", list(_params()))
def test_transformers_and_llama_cpp_fingerprint_a_gguf_alike(name):
    expected, rows = llama_view(VOCABS / name)
    tokenizer = transformers_view(VOCABS, name)
    # A model made from this GGUF has as many embedding rows as the file has tokens (config.vocab_size);
    # ids the tokenizer class adds past them are none of the model's.
    assert vocabulary_from_hf(tokenizer, model_vocab_size=rows) == expected


@needs_vocabs
@pytest.mark.parametrize(
    "name", ["ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf", "ggml-vocab-gpt-2.gguf"]
)
def test_auto_tokenizer_gives_the_same_vocabulary(name):
    if name not in GGUFS:
        pytest.skip(f"{name} is not in {VOCABS}")
    tokenizer = AutoTokenizer.from_pretrained(str(VOCABS), gguf_file=name)
    expected, rows = llama_view(VOCABS / name)
    assert vocabulary_from_hf(tokenizer, model_vocab_size=rows) == expected


@needs_vocabs
def test_different_vocabularies_differ():
    views = {name: llama_view(VOCABS / name)[0] for name in GGUFS}
    groups: list[set[str]] = []
    for name in GGUFS:
        same = next((g for g in SAME_VOCABULARY if name in g), {name})
        if same not in groups:
            groups.append(same)
    for group in groups:
        assert len({views[n] for n in group if n in views}) == 1, group
    representatives = [views[next(iter(sorted(g & set(views))))] for g in groups if g & set(views)]
    assert len({v.fingerprint for v in representatives}) == len(representatives)


def _rewrite_gguf(src: Path, dst: Path, arch: str | None = None, tokens=None, token_types=None) -> Path:
    """A copy of a vocabulary-only GGUF with another architecture name and edited tokens or types."""
    reader = GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens" and tokens is not None:
            value = tokens(value)
        if key == "tokenizer.ggml.token_type" and token_types is not None:
            value = token_types(value)
        if key.startswith(old_arch + "."):
            key = (arch or old_arch) + key[len(old_arch) :]
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return dst


@needs_vocabs
def test_whitespace_tokens_stored_as_spaces_match_their_marked_spelling(tmp_path):
    """Gemma 3's GGUFs store the tokens made of spaces with spaces, and transformers' Gemma tokenizer
    spells them `▁▁...`: a fingerprint of spellings refused such a pair, one of meanings does not."""

    def runs_as_spaces(tokens):
        return [t.replace("\u2581", " ") if len(t) > 1 and set(t) == {"\u2581"} else t for t in tokens]

    path = _rewrite_gguf(VOCABS / "ggml-vocab-llama-spm.gguf", tmp_path / "g.gguf", "gemma3", runs_as_spaces)
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name)
    stored = [llm._model.token_get_text(i) for i in range(llm.n_vocab())]
    spelled = tokenizer.convert_ids_to_tokens(list(range(llm.n_vocab())))
    differently = [(a, b) for a, b in zip(stored, spelled, strict=True) if a != b]
    assert len(differently) >= 10 and all(set(b) == {"\u2581"} and set(a) == {" "} for a, b in differently)
    assert vocabulary_from_hf(tokenizer, model_vocab_size=llm.n_vocab()) == vocabulary_from_llama(llm)


@needs_vocabs
def test_a_control_token_differs_from_text_spelled_alike(tmp_path):
    """StarCoder's `<fim_prefix>` (id 1) as a control token, and as a plain piece of text."""
    source = VOCABS / "ggml-vocab-starcoder.gguf"
    normal, control = 1, 3  # GGUF token types

    def as_text(types):
        assert types[1] == control
        return [normal if i == 1 else t for i, t in enumerate(types)]

    path = _rewrite_gguf(source, tmp_path / "s.gguf", token_types=as_text)
    original = Llama(model_path=str(source), vocab_only=True, verbose=False)
    edited = Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert [original._model.token_get_text(i) for i in range(3)] == [
        edited._model.token_get_text(i) for i in range(3)
    ]
    assert vocabulary_from_llama(edited) != vocabulary_from_llama(original)
    # transformers, given the edited file, sees a plain token too, and agrees with llama.cpp again.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert 1 not in tokenizer.added_tokens_decoder
    assert vocabulary_from_hf(tokenizer, model_vocab_size=edited.n_vocab()) == vocabulary_from_llama(edited)


@needs_vocabs
def test_one_changed_piece_changes_the_fingerprint(tmp_path):
    def swap(tokens):
        tokens = list(tokens)
        tokens[1000], tokens[1001] = tokens[1001], tokens[1000]
        return tokens

    path = _rewrite_gguf(VOCABS / "ggml-vocab-llama-spm.gguf", tmp_path / "x.gguf", tokens=swap)
    assert llama_view(path)[0] != llama_view(VOCABS / "ggml-vocab-llama-spm.gguf")[0]


@pytest.mark.skipif(not (DEMO / "target").is_dir(), reason="the committed demo pair is missing")
def test_the_demo_pair_still_matches():
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "target")
    rows = AutoConfig.from_pretrained(DEMO / "target").vocab_size
    expected = vocabulary_from_hf(tokenizer, model_vocab_size=rows)
    for name in ("draft-q8_0.gguf", "draft-q4_0.gguf"):
        assert llama_view(DEMO / name)[0] == expected


def test_the_module_imports_no_heavy_library():
    code = (
        "import sys, draftwire.vocab; heavy = {'torch', 'transformers', 'llama_cpp', 'numpy'}; "
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]"
