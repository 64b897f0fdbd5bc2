"""``wait_until``: the one polling wait of the tests, kept in ``p2pnode.testing.waiting`` so the
benches share it; re-exported here."""

from __future__ import annotations

from p2pnode.testing.waiting import wait_until, wait_until_blocking

__all__ = ["wait_until", "wait_until_blocking"]
