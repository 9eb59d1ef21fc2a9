"""Waiting with a time limit, without losing a cancellation.

Python 3.11's `asyncio.wait_for` returns the awaited result when the task is cancelled just as that result
arrives, so the cancellation is lost: a batcher worker cancelled at shutdown as a release woke it went on
waiting forever, and `asyncio.run` hung cancelling it (seen in CI, two test files at a time). `within`
waits under `asyncio.timeout`, which keeps the cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """`await awaitable`, raising TimeoutError past `timeout_s` seconds (None: no limit)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable
