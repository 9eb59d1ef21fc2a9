#!/usr/bin/env bash
# Downloads, into wheels/ (or $1), what the device check (scripts/gpu_check.sh) needs on a GPU machine
# that reaches no package registry, beyond what such a machine has (python3 3.12, torch with CUDA,
# transformers, grpcio, protobuf, numpy, aiohttp, prometheus-client): gRPC's health and reflection
# services, and grpcio and protobuf at the versions the generated code of the wire contract asks for at
# import (draftwire/v1), for CPython 3.12 on x86-64 Linux, without dependencies: about 8 MB.
# gpu_check.sh installs them with --no-index when the folder is there. That machine's own torch and
# transformers stay: the check runs on what a GPU operator has, and says which versions ran.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-wheels}"
mkdir -p "$out"
installed() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
pinned() { sed -nE "s/^ *\"$1==([^\"]+)\".*/\1/p" pyproject.toml | head -1; }
python3 -m pip download -q --dest "$out" --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "grpcio==$(pinned grpcio)" "grpcio-health-checking==$(pinned grpcio-health-checking)" \
    "grpcio-reflection==$(pinned grpcio-reflection)" "protobuf==$(installed protobuf)"
du -sh "$out"
ls "$out"
