"""What a node's digest may say about its cache: only blocks several requests used, never private.

Contract (``AdvertiseGate(builder, min_uses=2)``): sits between the engine's block events and
the ``DigestBuilder`` (register ``gate.on_event`` with ``engine.add_block_listener``).

- A cached block is advertised once at least ``min_uses`` requests used it (their prompts
  contained it; count them with ``note_request(prompt_hashes)``), so one user's prompt is never
  broadcast as fingerprints anyone could test a guessed prompt against. ``min_uses <= 1``
  advertises every cached block (the behaviour without the gate).
- ``private()`` is a context manager around one private request: while any is running, newly
  stored blocks are quarantined; when it ends, ``mark_private(hashes)`` (the blocks of its
  prompt and answer) excludes those for good (bounded memory: the newest ``max_private``), and
  the quarantine is released for the rest. A private block is never advertised, whatever its
  use count, and neither is any block stored after it on the same prefix.
- ``advertised`` counts blocks handed to the builder, ``withheld`` the cached ones it holds back.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from p2pnode.inference.blockhash import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from p2pnode.overlay.cache.digest import DigestBuilder

MAX_PRIVATE = 1 << 18  # ~20 MB of ints at most
MAX_COUNTED = 1 << 18


class AdvertiseGate:
    def __init__(
        self, builder: DigestBuilder, min_uses: int = 2, *, max_private: int = MAX_PRIVATE
    ) -> None:
        if min_uses < 0:
            raise ValueError(f"min_uses must be >= 0, got {min_uses}")
        self.builder = builder
        self.min_uses = min_uses
        self.max_private = max_private
        self._stored: set[int] = set()
        self._shown: set[int] = set()
        self._uses: OrderedDict[int, int] = OrderedDict()
        self._private: OrderedDict[int, None] = OrderedDict()
        self._quarantine: set[int] = set()
        self._private_running = 0

    @property
    def advertised(self) -> int:
        return len(self._shown)

    @property
    def withheld(self) -> int:
        return len(self._stored - self._shown)

    def is_private(self, h: int) -> bool:
        return h in self._private

    # -- requests -----------------------------------------------------------------------------

    def note_request(self, prompt_hashes: Iterable[int]) -> None:
        """One (non-private) request used these blocks."""
        for h in prompt_hashes:
            n = self._uses.pop(h, 0) + 1
            self._uses[h] = n  # most recent last: the oldest counts go first when full
            self._consider(h)
        while len(self._uses) > MAX_COUNTED:
            self._uses.popitem(last=False)

    @contextlib.contextmanager
    def private(self) -> Iterator[None]:
        self._private_running += 1
        try:
            yield
        finally:
            self._private_running -= 1
            if self._private_running == 0:
                held, self._quarantine = self._quarantine, set()
                for h in held:
                    self._consider(h)

    def mark_private(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self._shown:  # already public: min_uses other requests used it first
                continue
            self._private[h] = None
            self._private.move_to_end(h)
        while len(self._private) > self.max_private:
            self._private.popitem(last=False)

    # -- engine events ------------------------------------------------------------------------

    def on_event(self, event: BlockEvent) -> None:
        if isinstance(event, BlockStored):
            parent_private = event.parent is not None and event.parent in self._private
            for h in event.hashes:
                self._stored.add(h)
                if parent_private:
                    self._private[h] = None  # a private prefix makes everything after it private
                elif self._private_running:
                    self._quarantine.add(h)
                else:
                    self._consider(h)
        elif isinstance(event, BlockRemoved):
            gone = [h for h in event.hashes if h in self._shown]
            for h in event.hashes:
                self._stored.discard(h)
                self._quarantine.discard(h)
            self._shown.difference_update(gone)
            if gone:
                self.builder.on_event(BlockRemoved(tuple(gone)))
        elif isinstance(event, AllBlocksCleared):
            self._stored.clear()
            self._shown.clear()
            self._quarantine.clear()
            self.builder.on_event(event)
        else:
            raise TypeError(f"not a block event: {event!r}")

    def sync(self, hashes: Iterable[int]) -> None:
        """Start from the engine's current set (blocks cached before the gate existed)."""
        for h in hashes:
            self._stored.add(h)
            self._consider(h)

    def _consider(self, h: int) -> None:
        if h in self._shown or h not in self._stored or h in self._private:
            return
        if h in self._quarantine:
            return
        if self.min_uses <= 1 or self._uses.get(h, 0) >= self.min_uses:
            self._shown.add(h)
            self.builder.on_event(BlockStored((h,), None))
