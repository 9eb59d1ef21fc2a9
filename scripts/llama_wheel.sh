#!/usr/bin/env bash
# Installs llama-cpp-python into the active environment from a wheel built once, with portable CPU flags,
# from its source distribution. The source stays in third_party/llama-cpp-python (llama.cpp's HF-to-GGUF
# converter ships only there), the wheel in third_party/wheels for every other environment.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
SRC=third_party/llama-cpp-python
WHEELS=third_party/wheels

if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  tmp=$(mktemp -d)
  python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  mkdir -p third_party
  tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
  rm -rf "$SRC" && mv "$tmp/llama_cpp_python-$VERSION" "$SRC"
  rm -rf "$tmp"
fi
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  # Portable build: GGML_NATIVE would compile in AMX kernels that crash on some CPUs at the first decode.
  echo "building llama-cpp-python $VERSION from source (about 4 minutes)..."
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON" \
    python -m pip wheel -q --no-deps -w "$WHEELS" "./$SRC"
fi
if ! python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  python -m pip install -q "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl
fi
