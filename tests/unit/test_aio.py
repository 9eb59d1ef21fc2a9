"""draftwire.aio.within: a wait with a time limit that keeps a cancellation arriving with the result."""

import asyncio
import sys

import pytest

from draftwire.aio import within


async def cancelled_as_woken(wait) -> str:
    """A task waits on an event through `wait`; the event is set and the task cancelled at once (as the
    batcher's worker is, at shutdown, when a release wakes it). How the task ended."""
    woken = asyncio.Event()

    async def waiter():
        await wait(woken.wait(), 10)
        return "went on"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    woken.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_a_cancellation_that_arrives_with_the_result_is_kept():
    assert asyncio.run(cancelled_as_woken(within)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 rewrote wait_for on asyncio.timeout")
def test_asyncio_wait_for_loses_it_on_this_python():
    """The control: the race the helper is for is real here."""
    assert asyncio.run(cancelled_as_woken(asyncio.wait_for)) == "went on"


def test_a_limit_raises_timeout_and_a_result_passes_through():
    async def go():
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(10), 0.01)
        return await within(asyncio.sleep(0, result=7), 1), await within(asyncio.sleep(0, result=8), None)

    assert asyncio.run(go()) == (7, 8)
