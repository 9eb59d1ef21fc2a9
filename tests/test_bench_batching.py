"""Smoke run of the batching benchmark at tiny sizes, so that it cannot rot."""

import json

from draftwire.bench import batching


def test_batching_benchmark_runs_and_stays_exact(test_pair, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["--target", str(test_pair.target_dir), "--sessions", "4", "--new-tokens", "8", "--json", str(out)]
    assert batching.main(args) == 0
    report = json.loads(out.read_text())
    assert [a["exact"] for a in report["arms"]] == [True, True]
    assert report["arms"][0]["mean_batch"] == 1.0
    assert report["speedup"] > 0
    assert "batched / one at a time" in capsys.readouterr().out
