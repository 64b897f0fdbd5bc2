"""``wait_until``: the one polling wait of the tests and benches."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import trio


async def wait_until(
    predicate: Callable[[], object],
    limit_s: float,
    what: str,
    *,
    step_s: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> float:
    """Poll ``predicate`` every ``step_s`` until it holds and return the seconds that took;
    raise ``AssertionError`` after ``limit_s`` saying ``what`` was not reached, followed by
    ``detail()`` when given (e.g. the tail of a node's log).

    Polling on purpose: views, peer tables and engine state owned by other tasks, threads or
    processes have no event to wait on.
    """
    started = time.monotonic()
    try:
        with trio.fail_after(limit_s):
            while not predicate():  # noqa: ASYNC110
                await trio.sleep(step_s)
    except trio.TooSlowError:
        extra = f"\n{detail()}" if detail is not None else ""
        raise AssertionError(f"not within {limit_s} s: {what}{extra}") from None
    return time.monotonic() - started


def wait_until_blocking(
    predicate: Callable[[], object], limit_s: float, what: str, **options: Any
) -> float:
    """``wait_until`` (same arguments) for code outside an event loop (tests that drive
    processes)."""
    return trio.run(functools.partial(wait_until, predicate, limit_s, what, **options))
