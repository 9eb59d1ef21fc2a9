"""Fingerprints by meaning: transformers and llama.cpp agree on real vocabularies and tell others apart.

Run as a script (`.venv/bin/python -m tests.exact.test_vocab`), it prints the family matrix of
docs/vocabularies.md.
"""

import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from draftwire.vocab import (
    TokenTable,
    compare_vocabularies,
    tokens_from_hf,
    tokens_from_llama,
    vocabulary_from_hf,
    vocabulary_from_llama,
)
from edge_client.llama_runtime import Llama

ROOT = Path(__file__).resolve().parents[2]
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

# transformers builds these tokenizers from the GGUF, but they split some of llama.cpp's test texts
# otherwise than the model's own tokenizer did when llama.cpp recorded the expected ids (strict: when a
# transformers upgrade fixes one, the entry must go). The first text each gets wrong is in the reason.
TRANSFORMERS_SPLITS_OTHERWISE = {
    "ggml-vocab-command-r.gguf": "no split regex for pre-tokenizer 'command-r': ' ½' is one piece "
    "where llama.cpp splits off the space (and the vocabulary differs, above)",
    "ggml-vocab-deepseek-coder.gguf": "no split regex for pre-tokenizer 'deepseek-coder': ' ½' is one piece",
    "ggml-vocab-deepseek-llm.gguf": "no split regex for pre-tokenizer 'deepseek-llm': ' ½' is one piece",
    "ggml-vocab-falcon.gguf": "no split regex for pre-tokenizer 'falcon': '\\n =' and runs of spaces "
    "and punctuation split otherwise",
    "ggml-vocab-llama-bpe.gguf": "'Cửa Việt': the composed 'ửa' and 'iệt' come out as smaller pieces",
    "ggml-vocab-llama-spm.gguf": "leading spaces: ' ' gives '▁' where the model's tokenizer gave '▁▁' "
    "(the GGUF path adds no prefix space to text that starts with one)",
    "ggml-vocab-mpt.gguf": "the user-defined whitespace tokens are lost (see above), so runs of spaces "
    "tokenize otherwise",
    "ggml-vocab-refact.gguf": "no split regex for pre-tokenizer 'refact': ' ½' is one piece",
    "ggml-vocab-starcoder.gguf": "no split regex for pre-tokenizer 'starcoder': ' ½' is one piece",
}


@dataclass(frozen=True)
class LlamaView:
    table: TokenTable  # llama.cpp's meaning of every id
    rows: int  # the file's token count: the embedding rows of a model made from it
    tokenized: tuple[tuple[int, ...], ...]  # llama.cpp's ids for each of the file's test texts


def texts_of(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test cases beside a GGUF (tests/test-tokenizer-0.cpp's format): the texts,
    separated by a marker line, and on each line of the .out file the ids the model's own tokenizer
    gave (no BOS, special tokens not parsed)."""
    inp, out = VOCABS / f"{name}.inp", VOCABS / f"{name}.out"
    if not inp.is_file() or not out.is_file():
        return []
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    ids = [[int(x) for x in line.split()] for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(texts) == len(ids), f"{name}: {len(texts)} texts, {len(ids)} expected tokenizations"
    return list(zip(texts, ids, strict=True))


@functools.cache
def llama_view_of(path: Path) -> LlamaView:
    """What llama.cpp makes of a GGUF, cached: the pairwise tests read them all."""
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        cases = texts_of(path.name) if path.parent == VOCABS else []
        tokenized = tuple(tuple(llm.tokenize(t.encode(), add_bos=False, special=False)) for t, _ in cases)
        return LlamaView(tokens_from_llama(llm), llm.n_vocab(), tokenized)
    finally:
        llm.close()


def llama_view(path: Path):
    """llama.cpp's vocabulary of a GGUF and its token count."""
    view = llama_view_of(path)
    return view.table.vocabulary, view.rows


@functools.cache
def _load_transformers(directory: Path, name: str):
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory), gguf_file=name), None
    except ValueError as e:  # what transformers raises for a tokenizer type it has no builder for
        return None, str(e).splitlines()[0][:200]


def transformers_view(directory: Path, name: str):
    """The tokenizer transformers builds from a GGUF. The generic fast class runs the same GGUF
    conversion as AutoTokenizer without building the model's config first, which is ten times faster
    and works for architectures whose config transformers cannot build (baichuan, gemma-4, ...)."""
    tokenizer, why = _load_transformers(directory, name)
    if tokenizer is None:
        pytest.skip(f"transformers cannot build a tokenizer from {name}: {why}")
    return tokenizer


def family(name: str) -> str:
    return name.removeprefix("ggml-vocab-").removesuffix(".gguf")


def _params(known: dict[str, str] | None = None, names=GGUFS):
    for name in names:
        marks = []
        if known and name in known:
            marks.append(pytest.mark.xfail(strict=True, reason=known[name]))
        yield pytest.param(name, marks=marks, id=family(name))


@needs_vocabs
@pytest.mark.parametrize("name", list(_params(CONVERSION_CHANGES_THE_VOCABULARY)))
def test_transformers_and_llama_cpp_fingerprint_a_gguf_alike(name):
    view = llama_view_of(VOCABS / name)
    tokenizer = transformers_view(VOCABS, name)
    # A model made from this GGUF has as many embedding rows as the file has tokens (config.vocab_size);
    # ids the tokenizer class adds past them are none of the model's.
    table = tokens_from_hf(tokenizer, model_vocab_size=view.rows)
    assert compare_vocabularies(view.table, table, ("llama.cpp", "transformers")) is None
    assert table.vocabulary == vocabulary_from_hf(tokenizer, model_vocab_size=view.rows)


WITH_TEXTS = [n for n in GGUFS if texts_of(n)]


@needs_vocabs
@pytest.mark.parametrize("name", list(_params(names=WITH_TEXTS)))
def test_llama_cpp_tokenizes_the_test_texts_as_expected(name):
    view = llama_view_of(VOCABS / name)
    for (text, expected), got in zip(texts_of(name), view.tokenized, strict=True):
        assert list(got) == expected, text


@needs_vocabs
@pytest.mark.parametrize("name", list(_params(TRANSFORMERS_SPLITS_OTHERWISE, WITH_TEXTS)))
def test_transformers_tokenizes_the_test_texts_as_llama_cpp_expects(name):
    tokenizer = transformers_view(VOCABS, name)
    for text, expected in texts_of(name):
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text


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


def _rewrite_gguf(
    src: Path, dst: Path, arch: str | None = None, tokens=None, token_types=None, flags=None
) -> Path:
    """A copy of a vocabulary-only GGUF with another architecture name, edited tokens or types, and
    boolean keys (`flags`) set."""
    reader = GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in (flags or {}):
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
    for key, value in (flags or {}).items():
        writer.add_bool(key, value)
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


@needs_vocabs
def test_a_single_changed_token_is_refused_and_named(tmp_path):
    """One token's bytes changed, the rest of the file as it was: the pair is refused, and the message
    names the id and what each side holds there."""
    source = VOCABS / "ggml-vocab-llama-spm.gguf"
    original = llama_view_of(source).table
    changed_id = 12345
    before = original.tokens[changed_id].data

    def change(tokens):
        return [t + "x" if i == changed_id else t for i, t in enumerate(tokens)]

    path = _rewrite_gguf(source, tmp_path / "one.gguf", tokens=change)
    edited = llama_view_of(path).table
    assert edited.vocabulary.size == original.vocabulary.size
    assert edited.vocabulary != original.vocabulary
    message = compare_vocabularies(edited, original)
    assert f"the first id that differs is {changed_id}:" in message
    assert f"the draft has {before + b'x'!r} (text), the target {before!r} (text)" in message
    assert "(1 of the 32000 shared ids differ)" in message
    # transformers reading the edited file sees the same change, so it pairs with the edited draft only.
    tokenizer = transformers_view(tmp_path, path.name)
    assert compare_vocabularies(edited, tokens_from_hf(tokenizer, model_vocab_size=32000)) is None


@needs_vocabs
def test_two_different_vocabularies_are_refused_and_named():
    gpt2 = llama_view_of(VOCABS / "ggml-vocab-gpt-2.gguf").table
    starcoder = llama_view_of(VOCABS / "ggml-vocab-starcoder.gguf").table
    message = compare_vocabularies(gpt2, starcoder)
    # GPT-2 starts with '!', StarCoder with its control tokens.
    assert message.startswith("vocabulary mismatch: the draft has 50257 tokens, fingerprint ")
    assert "the target 49152 tokens" in message
    assert (
        "the first id that differs is 0: the draft has b'!' (text), the target b'<|endoftext|>' (special)"
        in message
    )
    assert message.endswith("differ, and the sizes too)")
    # A vocabulary that is another's with tokens added at the end: the message says where they start.
    qwen = llama_view_of(VOCABS / "ggml-vocab-qwen2.gguf").table
    shorter = TokenTable(_vocabulary_of(qwen.tokens[:151000]), qwen.tokens[:151000])
    assert compare_vocabularies(shorter, qwen, ("draft", "target")).endswith(
        f"from id 151000 only the target has tokens (id 151000: {qwen.tokens[151000].describe()})"
    )


def _vocabulary_of(tokens):
    """A table's fingerprint computed from its tokens, as the module does."""
    from draftwire import vocab

    return vocab._table([vocab._Token(t.special, t.data, "") for t in tokens]).vocabulary


@needs_vocabs
def test_user_defined_whitespace_runs_pair_with_plain_pieces(tmp_path):
    """Gemma 3's case (issue 31): its GGUF stores the whitespace runs as user-defined tokens made of
    spaces, transformers' Gemma tokenizer has them as plain `▁▁...` pieces. Same bytes, produced from
    text on both sides: the pair is accepted.

    Splitting is the tokenizers' business, not the fingerprint's, and here it shows: llama.cpp matches a
    user-defined run whole before SentencePiece runs, transformers' BPE may prefer `▁▁` + `▁Hello` for
    three spaces and a word. On llama.cpp's test texts, with this (llama's) vocabulary under Gemma's
    rules, that is the one text the two split otherwise; the real Gemma 3 pair is checked on its own."""
    user_defined = 4  # GGUF token type
    source = VOCABS / "ggml-vocab-llama-spm.gguf"
    stored = GGUFReader(source).fields["tokenizer.ggml.tokens"].contents()
    runs = {i for i, t in enumerate(stored) if len(t) > 1 and set(t) == {"\u2581"}}
    assert len(runs) >= 10

    def as_spaces(tokens):
        return [t.replace("\u2581", " ") if i in runs else t for i, t in enumerate(tokens)]

    def as_user_defined(types):
        return [user_defined if i in runs else t for i, t in enumerate(types)]

    path = _rewrite_gguf(
        source,
        tmp_path / "g.gguf",
        "gemma3",
        as_spaces,
        as_user_defined,
        flags={"tokenizer.ggml.add_space_prefix": False},  # Gemma's, as its GGUFs say
    )
    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name)
        assert all(llm._model.token_get_attr(i) & 16 for i in runs)  # llama.cpp: user-defined
        assert not runs & set(tokenizer.added_tokens_decoder)  # transformers: plain pieces
        draft, target = tokens_from_llama(llm), tokens_from_hf(tokenizer, model_vocab_size=llm.n_vocab())
        assert compare_vocabularies(draft, target) is None
        split_otherwise = [
            text
            for text, _ in texts_of(source.name)
            if llm.tokenize(text.encode(), add_bos=False, special=False)
            != tokenizer.encode(text, add_special_tokens=False)
        ]
        assert split_otherwise == ["   Hello"]
    finally:
        llm.close()


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


def matrix() -> str:
    """docs/vocabularies.md's table: each llama.cpp test vocabulary read by llama.cpp and by transformers."""
    rows = [
        "| family | transformers loads it | llama.cpp's ids as expected | transformers' ids as expected "
        "| fingerprints equal |",
        "|---|---|---|---|---|",
    ]
    for name in GGUFS:
        view = llama_view_of(VOCABS / name)
        cases = texts_of(name)
        ours = sum(list(got) == want for (_, want), got in zip(cases, view.tokenized, strict=True))
        llama_ok = f"{ours}/{len(cases)}" if cases else "no test texts"
        tokenizer, why = _load_transformers(VOCABS, name)
        if tokenizer is None:
            rows.append(f"| {family(name)} | no: {why} | {llama_ok} | skipped | skipped |")
            continue
        theirs = "no test texts"
        if cases:
            wrong = [t for t, want in cases if tokenizer.encode(t, add_special_tokens=False) != want]
            theirs = f"{len(cases) - len(wrong)}/{len(cases)}"
            if wrong:
                theirs += f", first wrong: {wrong[0][:24]!r}"
        differ = compare_vocabularies(
            view.table, tokens_from_hf(tokenizer, model_vocab_size=view.rows), ("llama.cpp", "transformers")
        )
        same = "yes" if differ is None else "no: " + differ.split("; ", 1)[1]
        cells = [family(name), "yes", llama_ok, theirs, same]
        rows.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", "\\n") for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(matrix())
