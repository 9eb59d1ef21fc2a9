"""Ctrl-C while `serve` starts (its target loaded, its server starting) ends it quietly: exit 130 and no
`Exception ignored ... Event loop is closed` from a gRPC server left to be collected after its loop."""

import os
import signal
import subprocess
import time

import pytest

from tools.rig.serverproc import DRAFTWIRE


@pytest.mark.parametrize("after_s", [0.0, 0.3, 0.6])
def test_ctrl_c_during_start_up_ends_serve_quietly(test_pair, after_s):
    serve = subprocess.Popen(
        [DRAFTWIRE, "serve", "--target", str(test_pair.target_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT prints every thread's stack
    )
    try:
        seen = []
        for line in serve.stdout:  # the target's line: loaded, the server about to start
            seen.append(line)
            if line.startswith("draftwire: target"):
                break
        time.sleep(after_s)
        serve.send_signal(signal.SIGINT)
        try:
            rest, _ = serve.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # where it hangs, for the failure to say
            serve.send_signal(signal.SIGABRT)
            stacks, _ = serve.communicate(timeout=60)
            pytest.fail(f"serve still runs 60 s after SIGINT:\n{''.join(seen)}{stacks}")
    finally:
        if serve.poll() is None:
            serve.kill()
    said = "".join(seen) + rest
    assert serve.returncode in (0, 130), said  # 0: it had started, and drained
    assert "Exception ignored" not in said and "Event loop is closed" not in said, said
    assert "Traceback" not in said, said
