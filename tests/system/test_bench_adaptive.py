"""Smoke runs of `python -m tools.bench.adaptive` and `python -m tools.bench.fallback` on the demo pair at
tiny sizes, so that they cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_adaptive_bench_smoke(tmp_path):
    out = tmp_path / "adaptive"
    cmd = [sys.executable, "-m", "tools.bench.adaptive", "--target", str(DEMO / "target")]
    cmd += ["--draft", str(DEMO / "draft-q8_0.gguf"), "--prompts", "2", "--prompt-tokens", "12"]
    cmd += ["--max-new-tokens", "12", "--gammas", "1,3", "--depths", "0,1", "--rtts", "0,5"]
    cmd += ["--two-device", "0:1", "--rtts-together", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 and 5 ms RTT, greedy" in proc.stderr  # both RTTs' rows in one pass, taking turns
    report = json.loads((out / "adaptive.json").read_text())
    assert [(p["rtt_ms"], p["mode"]) for p in report["points"]] == [
        (0, "greedy"),
        (0, "sampled"),
        (5, "greedy"),
        (5, "sampled"),
    ]
    assert all(p["fixed_settings"] == 4 and p["adaptive_tokens_per_s"] > 0 for p in report["points"])
    assert set(report["overall"]["fixed"]) == {"1,0", "1,1", "3,0", "3,1"}
    assert len(report["exact"]) == 4 * 5 and all(report["exact"].values())
    assert all("adaptive (ended at γ" in r["label"] for r in report["rows"] if r["pipeline"] == -1)
    assert all(r["model_tokens_per_s"] > 0 for r in report["rows"] if r["arm"] in "cd")
    # The warm-up fills the verifier's kept caches, shared through one channel: no row prefills cold.
    assert all(r["reused_positions"] > 0 for r in report["rows"])
    # Each row carries its tuner's view: the verify seconds it holds for the sizes it sent (γ + 1), in
    # turn unpipelined and side by side pipelined (the drafter drafting during the verify).
    fixed_3 = next(r for r in report["rows"] if r["gamma"] == 3 and r["pipeline"] == 0)
    assert fixed_3["tuner"]["in_turn"]["verify_by_positions"]["4"]["count"] > 0, fixed_3["tuner"]
    assert not fixed_3["tuner"]["ahead"]["verify_by_positions"], fixed_3["tuner"]
    piped_3 = next(r for r in report["rows"] if r["gamma"] == 3 and r["pipeline"] == 1)
    assert piped_3["tuner"]["ahead"]["verify_by_positions"]["4"]["count"] > 0, piped_3["tuner"]
    table = (out / "adaptive.md").read_text()
    assert "every output equals the target alone's" in table and "beats every fixed setting" in table
    assert "Model check" in table and "| 5 | sampled |" in table


def test_fallback_bench_smoke(tmp_path):
    """Every row with the right draft and with the wrong one (each token shifted: it never agrees), exact."""
    out = tmp_path / "fallback"
    cmd = [sys.executable, "-m", "tools.bench.fallback", "--target", str(DEMO / "target")]
    cmd += ["--draft", str(DEMO / "draft-q8_0.gguf"), "--prompts", "1", "--prompt-tokens", "12"]
    cmd += ["--max-new-tokens", "12", "--two-device", "0:1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "fallback.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 6 and all(r["exact"] for r in rows)
    wrong = [r["acceptance"] or 0.0 for r in rows if r["draft"] == "wrong"]
    right = [r["acceptance"] or 0.0 for r in rows if r["draft"] == "right"]
    assert max(wrong) < 0.25 < min(right), (wrong, right)
    assert "Last reasons of the fallback rows' tuners" in (out / "fallback.md").read_text()
