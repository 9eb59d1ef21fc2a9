#!/usr/bin/env bash
# Sets draftwire up on a fresh machine: a virtual environment in .venv (or $VENV), PyTorch's CPU wheel,
# llama-cpp-python built from its source distribution with portable CPU flags, then the project itself.
# The source distribution stays in third_party/llama-cpp-python: llama.cpp's HF-to-GGUF converter lives
# there and nowhere in the wheel.
set -euo pipefail
cd "$(dirname "$0")"
LLAMA_CPP_PYTHON=0.3.36
VENV=${VENV:-.venv}
SRC=third_party/llama-cpp-python

[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# First, and pinned: an open range for torch resolves to CUDA builds several GB large.
python -m pip install -q torch==2.13.0

if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  tmp=$(mktemp -d)
  python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$tmp"
  mkdir -p third_party
  tar xzf "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$tmp"
  rm -rf "$SRC" && mv "$tmp/llama_cpp_python-$LLAMA_CPP_PYTHON" "$SRC"
  rm -rf "$tmp"
fi

if ! python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON')" 2>/dev/null; then
  # Portable build: GGML_NATIVE would compile in AMX kernels that crash on some CPUs at the first decode.
  echo "building llama-cpp-python $LLAMA_CPP_PYTHON from source (about 4 minutes)..."
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON" \
    python -m pip install -q "./$SRC"
fi

python -m pip install -q -e ".[dev]"
echo "draftwire installed in $VENV: activate it with '. $VENV/bin/activate'"
