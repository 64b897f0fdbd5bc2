"""Helpers shared by the tests (on the path through pytest's ``pythonpath``)."""

from __future__ import annotations

from collections.abc import Callable

import trio


async def wait_until(predicate: Callable[[], bool], limit_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``limit_s`` saying ``what``.

    Polling on purpose: views, peer tables and engine state owned by other tasks or threads
    have no event to wait on.
    """
    try:
        with trio.fail_after(limit_s):
            while not predicate():  # noqa: ASYNC110
                await trio.sleep(0.05)
    except trio.TooSlowError:
        raise AssertionError(f"not within {limit_s} s: {what}") from None
