#!/usr/bin/env bash
# Regenerates the Python code of the wire contract into draftwire/v1/ (committed; a test checks it is current).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/draftwire/v1/draftwire.proto
