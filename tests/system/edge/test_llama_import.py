"""The llama-cpp-python that scripts/llama_wheel.sh installs works outside draftwire: a plain
`llama_cpp.Llama(model_path=...)` loads a model (its CPU modules are registered on import,
scripts/llama_import_hook.py), and with verbose=False says nothing on stderr (ggml's warnings are read
as warnings, not errors)."""

import subprocess
import sys
from pathlib import Path

DRAFT = Path(__file__).resolve().parents[3] / "models" / "demo" / "draft-q8_0.gguf"

PLAIN = """
import sys
import llama_cpp
assert not any(m.startswith(("draftwire", "edge_client")) for m in sys.modules)
vocab = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)
llm.eval(llm.tokenize(b"def add(a, b):"))
print(vocab.n_vocab(), llm.n_vocab())
"""


def test_plain_llama_cpp_loads_a_model_quietly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, str(DRAFT)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    vocab, llm = done.stdout.split()
    assert vocab == llm and int(vocab) > 0
    assert done.stderr == ""
