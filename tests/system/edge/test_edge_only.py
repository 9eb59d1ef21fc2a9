"""The edge alone: with only the edge extra installed, it drafts and chats against a real verifier.

CI runs tests/*/edge in an environment with `draftwire[edge]` only (DRAFTWIRE_EDGE_ONLY=1), against a
verifier started from the full environment's `draftwire` (DRAFTWIRE_VERIFIER); elsewhere these run
like any other test, with this environment's own `draftwire` on both sides.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.rig.serverproc import ServerProcess

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo"
EDGE = str(Path(sys.executable).parent / "draftwire")
VERIFIER = os.environ.get("DRAFTWIRE_VERIFIER") or EDGE
PROMPT_IDS = "15,27,300,1024,77,5,900"


def test_the_edge_environment_has_no_torch_transformers_or_ray():
    if not os.environ.get("DRAFTWIRE_EDGE_ONLY"):
        pytest.skip("asserted in CI's edge-only environment")
    for name in ("torch", "transformers", "ray", "matplotlib"):
        assert importlib.util.find_spec(name) is None, f"{name} is importable in the edge-only environment"


@pytest.fixture(scope="module")
def verifier():
    with ServerProcess(DEMO / "target", executable=VERIFIER) as server:
        yield server


def _json(*argv: str) -> dict:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.8", "--seed", "11")], ids=["greedy", "seeded"])
def test_generate_on_the_edge_equals_the_target_alone(verifier, sampling):
    common = ("--prompt-ids", PROMPT_IDS, "--max-new-tokens", "40", "--ignore-eos", "--json", *sampling)
    draft = str(DEMO / "draft-q8_0.gguf")
    edge = _json(EDGE, "generate", "--server", verifier.address, "--draft", draft, "--pipeline", "1", *common)
    alone = _json(VERIFIER, "reference", "--target", str(DEMO / "target"), *common)
    assert edge["token_ids"] == alone["token_ids"] and len(edge["token_ids"]) == 40
    assert edge["stats"].keys() == alone["stats"].keys()  # one schema for both


def test_chat_on_the_edge(verifier):
    out = subprocess.run(
        [EDGE, "chat", "--server", verifier.address, "--draft", str(DEMO / "draft-q8_0.gguf")]
        + ["--max-new-tokens", "16"],
        input="Return the sum of a list.\n\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "draftwire> " in out.stdout and "tokens/s]" in out.stdout
