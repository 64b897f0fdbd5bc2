"""Every model the swarm serves, on one node: which ones exist, and a routed service for each.

Why: a request may name any model that some node serves, whether this node runs it, runs
another one, or runs none (a light entry node). Each model gets its own ``RoutedService``
(its own router over that model's peers); they share this node's peer views, trust book,
per-peer limits and anti-entropy (one digest-pull handler per node; each model's digest topic
is followed as soon as the model is seen).

Contract:
- ``SwarmModels(node, key, primary=..., make_router=...)``: ``primary`` is the service of the
  model this node runs (None on a light node; then ``antientropy`` is this node's own, run by
  ``run``). ``run`` follows the node records of live peers (each lists the models its node
  serves; records travel by the DHT and by gossip) and starts a routing-only service for each
  model it has not seen yet, every ``poll_s``, and fetches its tokenizer files in the
  background (parsed on the model's first request: see ``text``).
- ``listing() -> {model_id: nodes}``: the models served by this node and its live peers, with
  how many nodes serve each (this node counted); ``local_model``: this node's own (or None).
- ``await service(model_id, wait_s)``: that model's service once its digests have shown at
  least one peer that serves it (or this node runs it), waiting at most ``wait_s``; None for a
  model nobody lists.
- ``await text(model_id)``: its ``TextFront`` (the tokenizer, no weights): read from
  ``tokenizer_dir`` when an earlier fetch left it there, else fetched from a peer that serves
  the model and checked against the id (``tokenizers.py``); the local engine for this node's
  own model. ``TokenizerFetchFailed`` when no serving peer hands over matching files.
  A tokenizer is parsed on the first request for its model, not when the model is seen: a
  parsed 262k-token vocabulary holds ~75 MB (and its parse peaks ~330 MB higher), which a
  light node pays only for the models it is asked for.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2pnode.inference.models import ModelLoadError, release_freed_memory, tokenizer_model
from p2pnode.inference.textfront import TextFront
from p2pnode.overlay.cache.antientropy import AntiEntropy
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.peers import PeerState
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.serve.tokenizers import (
    TokenizerFetchFailed,
    cached_tokenizer,
    fetch_tokenizer,
)

if TYPE_CHECKING:
    from p2pnode.overlay.seams import OverlayHost

log = logging.getLogger("p2pnode.overlay.serve.swarm")

# Builds the routing-only service of one more model (the node's settings are in the closure).
MakeRouter = Callable[[str, AntiEntropy, PeerViews], RoutedService]


class SwarmModels:
    """See the module contract."""

    def __init__(
        self,
        node: OverlayHost,
        *,
        primary: RoutedService | None,
        antientropy: AntiEntropy | None,
        make_router: MakeRouter,
        tokenizer_dir: Path,
        poll_s: float = 1.0,
    ) -> None:
        if primary is None and antientropy is None:
            raise ValueError("a node without a model needs its own anti-entropy")
        self.node = node
        self.primary = primary
        self.antientropy = primary.antientropy if primary is not None else antientropy
        self.views = primary.views if primary is not None else antientropy.views
        self.make_router = make_router
        self.tokenizer_dir = tokenizer_dir
        self.poll_s = poll_s
        self.services: dict[str, RoutedService] = {}
        if primary is not None:
            self.services[primary.model_id] = primary
        self._texts: dict[str, TextFront] = {}
        self._fetched: set[str] = set()  # models whose checked files are in tokenizer_dir
        self._locks: dict[str, trio.Lock] = {}
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()

    @property
    def local_model(self) -> str | None:
        return self.primary.model_id if self.primary is not None else None

    # -- what the swarm serves ----------------------------------------------------------------

    def _servers(self) -> dict[str, list[str]]:
        servers: dict[str, list[str]] = {}
        for peer in self.node.peers.peer_ids(PeerState.UP):
            entry = self.node.peers.get(peer)
            if entry is not None and entry.record is not None:
                for model in entry.record.models:
                    servers.setdefault(model, []).append(peer)
        return servers

    def listing(self) -> dict[str, int]:
        counts = {m: len(p) for m, p in self._servers().items()}
        if self.local_model is not None:
            counts[self.local_model] = counts.get(self.local_model, 0) + 1
        return dict(sorted(counts.items()))

    # -- services -------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.primary is None:
                await nursery.start(self.antientropy.run)
            self._start_new()
            task_status.started()
            while True:
                await trio.sleep(self.poll_s)
                self._start_new()

    def _start_new(self) -> None:
        assert self._nursery is not None
        for model in self._servers():
            if model not in self.services:
                service = self.make_router(model, self.antientropy, self.views)
                self.services[model] = service
                self._nursery.start_soon(service.run)
                self._nursery.start_soon(self._prefetch, model)
                log.info("routing requests for %s, which peers serve", model)
                self._changed.set()
                self._changed = trio.Event()

    def _has_server(self, model: str) -> bool:
        if model == self.local_model:
            return True
        return any(v.model_id == model for v in self.views.views())

    async def service(self, model: str, wait_s: float = 10.0) -> RoutedService | None:
        with trio.move_on_after(wait_s):
            while model not in self.services:
                if model not in self._servers():
                    return None
                await self._changed.wait()
            # A model just seen: its first digest arrives within a gossip round or two (no
            # event marks a view's arrival; polled, bounded by wait_s).
            for _ in range(int(wait_s / 0.1) + 1):
                if self._has_server(model):
                    break
                await trio.sleep(0.1)
        return self.services.get(model)

    # -- text -------------------------------------------------------------------------------------

    def _folder(self, model: str) -> Path:
        safe = model.split("@", 1)[0].replace("/", "_")[:64]
        return self.tokenizer_dir / f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:16]}"

    async def text(self, model: str) -> TextFront:
        if model in self._texts:
            return self._texts[model]
        async with self._locks.setdefault(model, trio.Lock()):
            if model not in self._texts:
                folder = await self._files(model)
                try:
                    light = await trio.to_thread.run_sync(
                        tokenizer_model, folder, model.split("@", 1)[0], model
                    )
                except ModelLoadError as exc:
                    raise TokenizerFetchFailed(str(exc)) from None
                self._texts[model] = TextFront(light)
        return self._texts[model]

    async def _files(self, model: str) -> Path:
        """The folder of the model's checked tokenizer files (the caller holds its lock)."""
        folder = self._folder(model)
        if model not in self._fetched:
            # Read and hashed off the event loop: a 262k vocabulary's files are ~33 MB.
            if await trio.to_thread.run_sync(cached_tokenizer, folder, model) is None:
                await self._fetch(model, folder)
            self._fetched.add(model)
            release_freed_memory()  # the files' bytes, read and received, are garbage now
        return folder

    async def _prefetch(self, model: str) -> None:
        """The tokenizer's files at hand before the first request for the model needs them."""
        try:
            async with self._locks.setdefault(model, trio.Lock()):
                await self._files(model)
        except TokenizerFetchFailed as exc:  # the first request tries again
            log.info("tokenizer of %s not fetched yet: %s", model, exc)

    async def _fetch(self, model: str, folder: Path) -> None:
        failures = []
        for peer in self._servers().get(model, [])[:3]:
            try:
                await fetch_tokenizer(self.node, peer, model, folder)
                log.info("tokenizer of %s fetched from %s into %s", model, peer, folder)
                return
            except TokenizerFetchFailed as exc:
                failures.append(str(exc))
        raise TokenizerFetchFailed(
            f"no peer serving {model} handed over its tokenizer: {failures or 'none reachable'}"
        )
