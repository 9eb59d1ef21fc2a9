"""llama.cpp's CPU kernels chosen at run time (edge_client/llama_runtime.py): in a fresh process the best
installed variant for this CPU registers, and a model decodes on it."""

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client import llama_runtime

DRAFT = Path(__file__).resolve().parents[3] / "models" / "demo" / "draft-q8_0.gguf"

FRESH = """
import json, numpy as np
from edge_client.llama_runtime import Llama, load_backends
llm = Llama(model_path=%r, n_ctx=64, verbose=False)
llm.eval(llm.tokenize(b"def main():"))
token = int(np.argmax(llm._scores[-1]))
backend = load_backends()
print(json.dumps({"variant": backend.variant, "features": backend.features, "token": token}))
"""


def test_a_fresh_process_picks_a_variant_and_decodes():
    out = subprocess.run(
        [sys.executable, "-c", FRESH % str(DRAFT)], capture_output=True, text=True, timeout=120, check=True
    )
    assert "load_backend" not in out.stderr  # ggml's own log line is kept quiet
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["variant"] in llama_runtime.installed_variants()
    assert result["features"]  # the chosen module says what it was built with
    assert 0 <= result["token"]


def test_the_chosen_variant_scores_best_among_those_installed():
    """ggml's own rule, checked from outside: each module scores the CPU (0: cannot run here); the one
    registered has the highest score."""
    chosen = llama_runtime.load_backends().variant
    if chosen == "built-in":
        pytest.skip("this llama.cpp links its CPU backend in: there is no variant to choose")
    scores = {}
    for variant in llama_runtime.installed_variants():
        module = ctypes.CDLL(str(next(llama_runtime.LIB_DIR.glob(f"libggml-cpu-{variant}.so*"))))
        module.ggml_backend_score.restype = ctypes.c_int
        scores[variant] = module.ggml_backend_score()
    assert scores[chosen] == max(scores.values()) > 0
    assert "sapphirerapids" not in scores  # the AMX variant is left out of the build


def test_no_cpu_backend_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_runtime, "_backend", None)
    monkeypatch.setattr(llama_runtime, "LIB_DIR", tmp_path)

    class NoRegistry:
        def __getattr__(self, name):
            return lambda *args: None

    monkeypatch.setattr(llama_runtime, "_ggml", lambda: NoRegistry())
    with pytest.raises(llama_runtime.NoCpuBackend, match="no CPU backend.*scripts/llama_wheel.sh"):
        llama_runtime.load_backends()
