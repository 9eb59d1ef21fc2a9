"""draftwire.cpus: how a process's compute threads share its CPUs (threads from its affinity, passive
OpenMP waits, the verifier/draft split of one machine)."""

import os
import subprocess
import sys

import pytest

from draftwire import cpus


@pytest.mark.parametrize(
    "usable, verifier, draft",
    [
        ((0,), (0,), (0,)),  # one CPU: shared
        ((0, 1), (0,), (1,)),
        ((2, 0, 1), (0, 1), (2,)),
        ((0, 1, 2, 3, 4, 5), (0, 1, 2, 3), (4, 5)),
        ((4, 6, 8, 10), (4, 6, 8), (10,)),
    ],
)
def test_split_gives_the_draft_a_third_and_never_shares_two_cpus_or_more(usable, verifier, draft):
    split = cpus.split(usable)
    assert (split.verifier, split.draft) == (verifier, draft)
    assert split.shared == (len(usable) == 1)
    if not split.shared:
        assert not set(split.verifier) & set(split.draft)
        assert sorted(split.verifier + split.draft) == sorted(usable)


def test_split_describes_itself():
    assert cpus.split((0, 1, 2, 3, 6, 7)).describe() == "verifier on CPU 0-3, draft on CPU 6-7"
    assert cpus.split((0, 1, 2, 5)).describe() == "verifier on CPU 0-2, draft on CPU 5"
    assert cpus.split((3,)).describe() == "verifier and draft share CPU 3"


def test_waiting_threads_sleep_unless_the_user_chose_otherwise():
    environ = {}
    cpus.sleep_while_waiting(environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    cpus.sleep_while_waiting(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.parametrize(
    "usable, busy, threads", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 2.0, 1), (8, 3.0, 5)]
)
def test_threads_are_the_cpus_other_work_leaves_free(usable, busy, threads):
    assert cpus.threads_for(usable, busy) == threads


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat")
def test_a_cpu_another_process_keeps_busy_is_counted_busy():
    one = min(os.sched_getaffinity(0))
    burner = subprocess.Popen(
        [sys.executable, "-c", "while 1: pass"], preexec_fn=lambda: os.sched_setaffinity(0, {one})
    )
    try:
        assert cpus.busy_elsewhere((one,), seconds=0.5) > 0.5
    finally:
        burner.kill()
        burner.wait()


COMMAND = """
import os, sys
os.environ.pop("OMP_WAIT_POLICY", None)
from draftwire_cli.main import main
main(["models", "check", "--target", "/nonexistent", "--draft", "/nonexistent"])  # fails at once
print("policy", os.environ.get("OMP_WAIT_POLICY"), file=sys.stderr)
"""


def test_the_command_sets_the_wait_policy_before_its_libraries_load():
    out = subprocess.run([sys.executable, "-c", COMMAND], capture_output=True, text=True, timeout=120)
    assert "policy PASSIVE" in out.stderr, out.stderr


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_threads_follow_the_affinity_not_the_machine():
    one = min(os.sched_getaffinity(0))
    code = "from draftwire import cpus; print(cpus.usable(), cpus.threads())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {one}),
    )
    assert out.stdout.split() == [f"({one},)", "1"]


def test_the_demo_counts_the_target_alones_reply_from_its_prefill_and_timed_steps(monkeypatch):
    # draftwire_cli.sharing.target_alone: a reply of 64 timed as its prefill and first token, then the
    # mean step of 16 more; the arithmetic, with the replies' seconds scripted (1 s, then 1 s + 16 x 0.1).
    from draftwire_cli import sharing

    seconds = {1: 1.0, 17: 2.6}
    monkeypatch.setattr(sharing, "_reply_seconds", lambda engine, prompt, tokens: seconds[tokens])
    rate, _ = sharing.target_alone(None, [1, 2, 3], tokens=64, steps=16)
    assert rate == pytest.approx(64 / (1.0 + 63 * 0.1))
    seconds[17] = 0.9  # a second run faster than the first (noise): no negative step
    assert sharing.target_alone(None, [1], tokens=64, steps=16)[0] == pytest.approx(64.0)
