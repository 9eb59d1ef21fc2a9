"""The draft's llama.cpp threads: one per CPU the process may use (llama-cpp-python's defaults count every
core of the machine, which oversubscribes a process pinned to fewer), and on the CPUs it is given."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRAFT = Path(__file__).resolve().parents[3] / "models" / "demo" / "draft-q8_0.gguf"

PROBE = """
import json, os, sys
from draftwire.contract import SamplingParams
from edge_client.drafter import DrafterConfig, LlamaDrafter
cpus = tuple(json.loads(sys.argv[2]))
drafter = LlamaDrafter(DrafterConfig(sys.argv[1], n_ctx=64, cpus=cpus))
p = drafter.llm.context_params
on = drafter.executor.submit(lambda: sorted(os.sched_getaffinity(0))).result()
drafter.propose(drafter.tokenize("def main():"), 2, SamplingParams())
print(json.dumps({"threads": p.n_threads, "batch": p.n_threads_batch, "on": on}))
"""

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")


def _probe(affinity: set[int], cpus: tuple[int, ...] = ()) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(DRAFT), json.dumps(cpus)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, affinity),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_pinned_to_one_cpu_drafts_on_one_thread():
    one = min(os.sched_getaffinity(0))
    assert _probe({one}) == {"threads": 1, "batch": 1, "on": [one]}


def test_the_draft_runs_on_the_cpus_it_is_given():
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("one CPU: nothing to divide")
    assert _probe(set(usable), (usable[-1],)) == {"threads": 1, "batch": 1, "on": [usable[-1]]}
    whole = _probe(set(usable))  # one per CPU that other work leaves free (draftwire.cpus.threads)
    assert 1 <= whole["threads"] == whole["batch"] <= len(usable)
