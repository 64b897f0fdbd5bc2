"""``wait_until``: the one polling wait of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import trio


async def wait_until(
    predicate: Callable[[], object], limit_s: float, what: str, *, step_s: float = 0.05
) -> float:
    """Poll ``predicate`` every ``step_s`` until it holds and return the seconds that took;
    fail the test after ``limit_s`` saying ``what`` was not reached.

    Polling on purpose: views, peer tables and engine state owned by other tasks or threads
    have no event to wait on.
    """
    started = time.monotonic()
    try:
        with trio.fail_after(limit_s):
            while not predicate():  # noqa: ASYNC110
                await trio.sleep(step_s)
    except trio.TooSlowError:
        raise AssertionError(f"not within {limit_s} s: {what}") from None
    return time.monotonic() - started
