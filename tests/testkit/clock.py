"""``FakeClock``: time that moves only when the test says so."""

from __future__ import annotations


class FakeClock:
    """A ``clock=`` argument (a callable returning seconds) whose time is ``now``; a test moves
    it with ``clock.now += s`` or sets it outright."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
