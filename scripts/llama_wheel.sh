#!/usr/bin/env bash
# Installs llama-cpp-python into the active environment from a wheel built once from its source
# distribution, with ggml's CPU kernels as run-time variants: every x86-64 level from plain x86-64 and
# SSE4.2 to Zen 4 (or every ARM level from armv8.0 to armv9.2), one of which ggml picks by the CPU the
# process runs on (edge_client/llama_runtime.py loads them). Nothing is tuned for the build machine, so
# a wheel built here runs on any CPU of its architecture.
#
# - The AMX variant (sapphirerapids) is left out: its q8_0/q4 kernels segfault at the first decode on
#   some of the AMX CPUs this project meets, so the build drops that one line from ggml's variant list.
# - The wheel is cached under a key of the version, the flags, the patch and the architecture
#   ($DRAFTWIRE_WHEEL_CACHE, default ~/.cache/draftwire/wheels/<version>-<key>/), so a wheel built with
#   other flags (an older AVX-512 build, another architecture) is never reused, and a fresh clone on the
#   same machine does not build again. The build takes about 12 minutes on 2 cores (16 CPU variants; 4 for one).
# - The source stays in third_party/llama-cpp-python (llama.cpp's HF-to-GGUF converter ships only there).
# - The installed copy registers its CPU modules on import (scripts/llama_import_hook.py, appended to its
#   llama_cpp/__init__.py), so that `llama_cpp.Llama(model_path=...)` loads a model in any program, not
#   only through draftwire. That is done after the install, not in the build: the cached wheel stays.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
SRC=third_party/llama-cpp-python
# Every CPU variant as a loadable module next to libllama (llama_cpp/lib); no multimodal library.
FLAGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
PATCH='drop the AMX variant: ggml_add_cpu_backend_variant(sapphirerapids'
KEY=$(printf '%s\n%s\n%s\n' "$FLAGS" "$PATCH" "$(uname -m)" | sha256sum | cut -c1-12)
WHEELS=${DRAFTWIRE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/draftwire/wheels}/$VERSION-$KEY

if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  tmp=$(mktemp -d)
  python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  mkdir -p third_party
  tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
  rm -rf "$SRC" && mv "$tmp/llama_cpp_python-$VERSION" "$SRC"
  rm -rf "$tmp"
fi
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION from source with every CPU variant (about 12 minutes on 2 cores, once)..."
  build=$(mktemp -d)
  cp -r "$SRC" "$build/src"
  sed -i '/ggml_add_cpu_backend_variant(sapphirerapids/d' "$build/src/vendor/llama.cpp/ggml/src/CMakeLists.txt"
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CMAKE_ARGS="$FLAGS" \
    python -m pip wheel -q --no-deps -w "$build/out" "$build/src"
  mkdir -p "$WHEELS" && mv "$build"/out/llama_cpp_python-"$VERSION"-*.whl "$WHEELS"/
  rm -rf "$build"
fi
# The installed copy names its build and its import hook; another build, hook (or none) is replaced.
HOOK=scripts/llama_import_hook.py
INSTALLED_KEY="$VERSION-$KEY-hook-$(sha256sum "$HOOK" | cut -c1-12)"
installed_key=$(python -c "import llama_cpp, pathlib; print((pathlib.Path(llama_cpp.__file__).parent / 'lib' / 'draftwire-build-key').read_text().strip())" 2>/dev/null || true)
if [ "$installed_key" != "$INSTALLED_KEY" ]; then
  python -m pip install -q --force-reinstall --no-deps "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl
  python -m pip install -q "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl
  python - "$INSTALLED_KEY" "$HOOK" <<'PY'
import importlib.util, pathlib, sys
package = pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent  # found, not imported
init = package / "__init__.py"
init.write_text(init.read_text() + "\n\n" + pathlib.Path(sys.argv[2]).read_text())
(package / "lib" / "draftwire-build-key").write_text(sys.argv[1] + "\n")
PY
fi
