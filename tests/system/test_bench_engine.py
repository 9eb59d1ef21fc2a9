"""Smoke runs of the engine's and the tuner's benches, so that they cannot rot: `python -m tools.bench.engine
--prefill-at` on the demo target at a tiny context (every arm timed, in its order), and
`python -m tools.testkit.tuner_clock` on the virtual clock."""

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


def test_prefill_at_under_the_rounds_kept_length_is_refused():
    cmd = [sys.executable, "-m", "tools.bench.engine", "--target", str(DEMO / "target"), "--prefill-at", "20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--prefill-at must be at least 50" in proc.stderr


def test_the_tuners_clock_compares_every_condition():
    """`python -m tools.testkit.tuner_clock` (virtual time, no model) at one seed: a row per condition."""
    from tools.testkit import tuner_clock

    proc = subprocess.run(
        [sys.executable, "-m", "tools.testkit.tuner_clock", "--seeds", "1"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(tuner_clock.CONDITIONS) and all("below its last γ" in r for r in rows[1:])
