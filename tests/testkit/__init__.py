"""Helpers the tests share, importable as ``testkit`` (pytest's ``pythonpath = ["tests"]``).

- ``wait_until(predicate, limit_s, what)``: poll state owned by other tasks; seconds it took
  (``wait_until_blocking`` outside an event loop). Both live in ``p2pnode.testing.waiting``.
- ``FakeClock``: a clock the test moves by hand, for code that takes ``clock=``.
- ``testkit.streams``: feed bytes to a stream handler and read back its frames (the decoder
  fuzz tests and ``bench/fuzz_long.py``).
- ``testkit.routing``: digests, prompts and load figures of a made-up model, for router tests.
- ``testkit.cluster``: ``overlay_nodes(n)``, real overlay nodes on 127.0.0.1 in a full mesh.

The real model is a fixture (``loaded``, one load per run) in ``tests/conftest.py``. Only
tests and benchmarks import this package, never ``p2pnode``.
"""

from __future__ import annotations

from testkit.clock import FakeClock
from testkit.waiting import wait_until, wait_until_blocking

__all__ = ["FakeClock", "wait_until", "wait_until_blocking"]
