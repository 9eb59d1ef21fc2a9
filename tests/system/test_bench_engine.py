"""Smoke run of `python -m tools.bench.engine --prefill-at` on the demo target at a tiny context, so that
it cannot rot: every arm is timed, in its order."""

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_prefill_costs_time_every_arm():
    cmd = [sys.executable, "-m", "tools.bench.engine", "--target", str(DEMO / "target")]
    cmd += ["--prefill-at", "96", "--repeats", "2", "--dtype", "float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:3] for line in proc.stdout.splitlines() if line.startswith("| ")]
    names = [name.strip() for name, _ in rows[1:]]
    arms = [(f"{k} prefill alone", f"round + {k} prefill") for k in (1, 2, 4)]
    assert names == ["round alone", *(name for pair in arms for name in pair)]
    assert all(float(ms) > 0 for _, ms in rows[1:])
