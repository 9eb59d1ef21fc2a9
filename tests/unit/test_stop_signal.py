"""A server's run under `run_until_signal`: a signal while it starts cuts the start short (however long
the start keeps the loop busy), the first once it serves starts the drain, and a second ends the drain."""

import asyncio
import os
import signal
import threading
import time

import pytest

from verifier_service.grpc_kit import run_until_signal


def _send(sig: int, *after_s: float) -> threading.Thread:
    """Sends `sig` to this process from another thread, once after each delay (from the start)."""

    def send() -> None:
        start = time.monotonic()
        for at in after_s:
            time.sleep(max(0.0, start + at - time.monotonic()))
            os.kill(os.getpid(), sig)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_server_starts_cuts_the_start_short(sig):
    seen = []

    async def main(stop):
        _send(sig, 0.1)
        await asyncio.sleep(60)  # a start that waits (a pool's replicas loading)
        seen.append("started")
        await stop.wait()

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_until_signal(main)
    assert seen == []
    assert time.monotonic() - start < 30  # not the start's minute
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own, back


def test_a_signal_while_the_start_holds_the_loop_is_not_lost():
    """A start that keeps the loop busy (a calibration's forwards, a load) sees the signal once it
    yields: the start is cut short, or, if the start ended first, the drain begins and ends the run."""
    seen = []

    async def main(stop):
        _send(signal.SIGINT, 0.05)
        time.sleep(0.5)  # the signal lands meanwhile, on whichever thread
        await asyncio.sleep(0)
        seen.append("started")
        await stop.wait()
        seen.append("drained")

    try:
        run_until_signal(main)
    except KeyboardInterrupt:
        assert seen in ([], ["started"])
    else:
        assert seen == ["started", "drained"]


def test_the_first_signal_once_serving_starts_the_drain():
    seen = []

    async def main(stop):
        _send(signal.SIGINT, 0.1)
        await stop.wait()
        seen.append("draining")
        await asyncio.sleep(0.1)
        seen.append("drained")

    run_until_signal(main)
    assert seen == ["draining", "drained"]


def test_a_second_signal_ends_the_drain_at_once():
    seen = []

    async def main(stop):
        _send(signal.SIGINT, 0.1, 0.3)
        await stop.wait()
        seen.append("draining")
        await asyncio.sleep(60)  # a drain that would wait for its sessions
        seen.append("drained")

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_until_signal(main)
    assert seen == ["draining"]
    assert time.monotonic() - start < 30  # not the drain's minute (a bound far from the 0.3 s it takes)
