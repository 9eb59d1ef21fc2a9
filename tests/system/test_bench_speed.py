"""Smoke run of `draftwire bench` at tiny sizes, so that it cannot rot."""

import json
import subprocess

from tools.bench.speed import expected_tokens_per_round
from tools.rig.serverproc import DRAFTWIRE


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert abs(expected_tokens_per_round(0.5, 2) - 1.75) < 1e-12


def test_bench_smoke(test_pair, tmp_path):
    out = tmp_path / "bench"
    cmd = [DRAFTWIRE, "bench", "--target", str(test_pair.target_dir), "--draft", str(test_pair.draft_f16)]
    cmd += [
        "--draft-hf",
        str(test_pair.target_dir.parent / "other"),
        "--prompts",
        "2",
        "--prompt-tokens",
        "12",
    ]
    cmd += ["--max-new-tokens", "10", "--gammas", "1,3", "--rtts", "5", "--out", str(out)]
    cmd += ["--two-device", "0:1"]  # the edge on core 0, the verifier and the target alone on core 1
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    arms = {(r["arm"], r["mode"], r["gamma"]) for r in report["rows"]}
    assert {
        ("a", "greedy", 0),
        ("b", "greedy", 0),
        ("c", "greedy", 1),
        ("c", "sampled", 3),
        ("d", "sampled", 4),
    } <= arms
    assert all(report["exact"].values())
    assert {r["label"] for r in report["rows"] if r["arm"] == "b"} == {
        "transformers assisted generation",
        "transformers prompt-lookup decoding",
    }
    drafted = [r for r in report["rows"] if r["arm"] in "cd"]
    assert all(r["bound_tokens_per_s"] > 0 and r["share_of_bound"] > 0 for r in drafted)
    assert (out / "bench.png").stat().st_size > 10_000
    assert "every arm's output equals (a)'s" in (out / "bench.md").read_text()
    delayed = [r for r in report["rows"] if r["arm"] == "d"]
    assert all(r["round_ms_p50"] >= 5 for r in delayed)  # the proxy's RTT shows in every round
