"""Smoke run of `python -m tools.bench.row_padding` on the test target, so that it cannot rot."""

import json

from tools.bench import row_padding
from verifier_service import invariant


def test_row_padding_benchmark_runs_and_the_bits_agree(test_pair, tmp_path, capsys):
    out = tmp_path / "padding.json"
    args = ["--target", str(test_pair.target_dir), "--repeats", "1", "--held", "6", "--json", str(out)]
    assert row_padding.main(args) == 0  # nonzero when the two paddings' logits differ
    report = json.loads(out.read_text())
    assert report["same"] and set(report["ms"]) == {str(n) for n in row_padding.POSITIONS}
    assert report["chosen"] in invariant.PADDINGS
    assert "| 1 |" in capsys.readouterr().out
