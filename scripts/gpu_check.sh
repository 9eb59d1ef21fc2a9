#!/usr/bin/env bash
# The device check of issue 58 (tools/bench/gpu_check.py): one command that writes gpu_check.json and
# gpu_check.md under --out and prints the markdown; exit status 1 when an exactness check fails.
#
#   scripts/gpu_check.sh [--device cuda|cpu] [--out DIR] [--size small|real] [--layers N] [--budget-s S]
#
# Defaults: --device cuda, --size real on cuda and small on cpu, --out docs/runs/gpu_check (made if absent).
# On a machine without a package registry, the wheels in $DRAFTWIRE_WHEELS (default: wheels/ in the
# checkout), where that directory exists, are installed first from it alone, into a temporary directory
# put on PYTHONPATH: the machine's own Python is left as it was (no system install, no PEP 668 refusal).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
path="$repo"
wheels="${DRAFTWIRE_WHEELS:-$repo/wheels}"
if [[ -d "$wheels" ]]; then
    shopt -s nullglob
    found=("$wheels"/*.whl)
    shopt -u nullglob
    if ((${#found[@]})); then
        site="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")"
        trap 'rm -rf "$site"' EXIT
        python3 -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" \
            --no-deps --target "$site" "${found[@]}"
        path="$repo:$site"
    fi
fi
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" python3 -m tools.bench.gpu_check "$@"
