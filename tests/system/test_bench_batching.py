"""Smoke runs of the batching benchmarks at tiny sizes, so that they cannot rot."""

import json

from tools.bench import batching
from tools.bench import engine as engine_bench


def test_batching_benchmark_runs_and_stays_exact(test_pair, tmp_path, capsys):
    out = tmp_path / "report.json"
    args = ["--target", str(test_pair.target_dir), "--sessions", "4", "--new-tokens", "8", "--repeats", "1"]
    args += ["--json", str(out)]
    assert batching.main(args) == 0
    report = json.loads(out.read_text())
    assert [a["exact"] for a in report["arms"]] == [True, True]
    serial, batched = report["arms"]
    assert serial["mean_batch"] == 1.0 and batched["mean_batch"] > 1.0  # the batched arm did batch
    assert report["speedup"] == batched["tokens_per_s"] / serial["tokens_per_s"]
    assert "batched / one at a time" in capsys.readouterr().out


def test_engine_benchmark_runs(test_pair, capsys):
    args = ["--target", str(test_pair.target_dir), "--sessions", "3", "--lengths", "4,9", "--repeats", "1"]
    assert engine_bench.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 to 10")]
    assert len(rows) == 1 and rows[0].endswith(" x |")


def test_batching_benchmark_through_a_ray_pool(test_pair, tmp_path):
    """--pool: each arm is `serve --ray --replicas 1`, a local Ray cluster with the front before it."""
    out = tmp_path / "report.json"
    args = ["--target", str(test_pair.target_dir), "--sessions", "3", "--new-tokens", "6", "--repeats", "1"]
    assert batching.main([*args, "--pool", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [a["exact"] for a in report["arms"]] == [True, True]
    assert report["arms"][0]["mean_batch"] == 1.0  # the replica honours --max-batch 1 through the pool
