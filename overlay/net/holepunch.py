"""Hole punching: two NAT'd peers that met through a relay move to a direct connection.

When a node holds only a relayed connection to a peer, one of the two (the larger peer id, so
the sessions never cross) runs DCUtR over it (``patches/dcutr.py``: py-libp2p's protocol with
the fixes that make it work here): both exchange their public addresses (the IP dial-back
servers saw, with the listen port) and dial each other at once FROM their listen ports, a TCP
simultaneous open that a port-preserving, endpoint-independent NAT (Linux MASQUERADE, most home
routers) lets through. A failed attempt is retried after ``BACKOFF_S`` (doubling, with jitter,
capped), for as long as the relayed connection lasts.

After a punch the direct connection carries every new stream (libp2p prefers direct
connections); the relayed one is closed once it carries no stream but gossipsub's (which
pubsub reopens on the direct connection): a stream in flight on it completes; at the latest
after ``DRAIN_S``.

Contract: ``async with open_hole_punching(node, public_ips=callable) as punch:`` on a running
``OverlayNode`` (``public_ips``: our IPs as dial-back servers saw them, reachability.py).
``punch.punched(conn)``: did this connection come from a hole punch (``connection_kind``
says "hole-punched" for it); ``punch.why_relayed(peer_id)``: why a relayed peer is still
relayed (the last attempt's failure, or that one is pending), None otherwise;
``punch.status()``: counters and per-peer state for ``/status``.
"""

from __future__ import annotations

import logging
import random
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID
from libp2p.tools.anyio_service import background_trio_service

from p2pnode.overlay.net.patches.dcutr import OverlayDCUtR, in_flight, is_relayed_conn

if TYPE_CHECKING:
    from p2pnode.overlay.net.node import OverlayNode

__all__ = ["BACKOFF_S", "DRAIN_S", "HolePunching", "open_hole_punching"]

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # how often relayed-only peers and draining circuits are looked at
FIRST_TRY_S = 1.0  # a new relayed peer is punched this long after we see it (hello first)
BACKOFF_S = (5.0, 300.0)  # after a failed attempt: first wait, cap (doubling, +-25 % jitter)
ATTEMPT_S = 40.0  # one attempt: stream, address exchange, 3 dial rounds of 5 s
DRAIN_S = 120.0  # a relayed connection still busy this long after the punch is closed anyway


@dataclass
class _PeerState:
    failures: int = 0
    next_try: float = 0.0
    busy: bool = False
    reason: str | None = None


class HolePunching:
    """DCUtR on one overlay node; create with ``open_hole_punching`` (module doc)."""

    def __init__(self, node: OverlayNode, public_ips: Callable[[], Sequence[str]]) -> None:
        self.node = node
        self.host = node.host
        self.dcutr = OverlayDCUtR(self.host, public_ips=public_ips)
        self.counters: Counter[str] = Counter()
        self._peers: dict[str, _PeerState] = {}
        self._punched: weakref.WeakSet[Any] = weakref.WeakSet()
        self._drain_since: dict[int, float] = {}
        self._rng = random.Random(node.peer_id)  # jitter; seeded, so runs repeat
        self.dcutr.on_punched = self._on_punched

    # -- public face --------------------------------------------------------------------

    def punched(self, conn: Any) -> bool:
        if conn in self._punched:
            return True
        # a direct connection that appears while a punch with its peer runs is the punch's
        # (until the punch verifies it and marks it for good)
        try:
            return conn.muxed_conn.peer_id in self.dcutr._in_progress
        except AttributeError:
            return False

    def why_relayed(self, peer_id: str) -> str | None:
        if self.node.connection_kind(peer_id) != "relayed":
            return None
        state = self._peers.get(peer_id)
        if state is None or (state.reason is None and state.failures == 0):
            if self.node.peer_id < peer_id:
                return "hole punch pending (the peer initiates)"
            return "hole punch pending"
        return state.reason

    def status(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "relayed": {
                pid: {"failures": s.failures, "reason": s.reason}
                for pid, s in sorted(self._peers.items())
                if self.node.connection_kind(pid) == "relayed"
            },
        }

    # -- loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                self._tick(nursery)
                await trio.sleep(CHECK_EVERY_S)

    def _tick(self, nursery: trio.Nursery) -> None:
        network = self.host.get_network()
        now = trio.current_time()
        self._forget_gone(network.connections)
        for peer, conns in list(network.connections.items()):
            conns = list(conns)
            direct = [c for c in conns if not is_relayed_conn(c)]
            relayed = [c for c in conns if is_relayed_conn(c)]
            pid = peer.to_base58()
            if direct:
                self._mark_punched(pid, direct)
            if direct and relayed:
                for conn in relayed:
                    self._drain(nursery, conn, now)
                continue
            if not relayed:
                continue
            state = self._peers.setdefault(pid, _PeerState(next_try=now + FIRST_TRY_S))
            # the larger id initiates, so two sessions never cross
            if self.node.peer_id > pid and not state.busy and now >= state.next_try:
                state.busy = True
                nursery.start_soon(self._attempt, peer, state)
            # the smaller id learns its outcome from the sessions it answers
            outcome = self.dcutr.outcomes.get(pid)
            if isinstance(outcome, str):
                state.reason = outcome

    def _forget_gone(self, connections: dict[ID, list[Any]]) -> None:
        """State of peers and connections that are gone (bounded by what is connected)."""
        connected = {p.to_base58() for p in connections}
        live = {id(c) for conns in connections.values() for c in conns}
        for pid in [p for p in self._peers if p not in connected and not self._peers[p].busy]:
            del self._peers[pid]
        for pid in [p for p in self.dcutr.outcomes if p not in connected]:
            del self.dcutr.outcomes[pid]
        for key in [k for k in self._drain_since if k not in live]:
            del self._drain_since[key]

    def _on_punched(self, pid: str) -> None:
        try:
            conns = self.host.get_network().get_connections(ID.from_base58(pid))
        except Exception:  # gone again: nothing to label
            return
        self._mark_punched(pid, [c for c in conns if not is_relayed_conn(c)])

    def _mark_punched(self, pid: str, direct: list[Any]) -> None:
        if self.dcutr.outcomes.get(pid) is True:
            for conn in direct:
                if conn not in self._punched:
                    self._punched.add(conn)
                    self.counters["punched"] += 1
                    logger.info("hole punched to %s: direct connection", pid)
            self.dcutr.outcomes.pop(pid, None)
            self._peers.pop(pid, None)

    def _drain(self, nursery: trio.Nursery, conn: Any, now: float) -> None:
        since = self._drain_since.setdefault(id(conn), now)
        if in_flight(conn) and now - since < DRAIN_S:
            return  # a stream in flight completes on the relayed connection
        self._drain_since.pop(id(conn), None)
        self.counters["relayed_closed"] += 1
        nursery.start_soon(_close, conn)

    async def _attempt(self, peer: ID, state: _PeerState) -> None:
        pid = peer.to_base58()
        self.counters["attempts"] += 1
        started = time.monotonic()
        ok = False
        try:
            # 0.8.1 caps attempts per peer for the service's life; the backoff here replaces it
            self.dcutr._hole_punch_attempts.pop(peer, None)
            with trio.move_on_after(ATTEMPT_S):
                ok = await self.dcutr.initiate_hole_punch(peer)
        except Exception as exc:  # any failure of one attempt only means: retry later
            self.dcutr.outcomes[pid] = f"attempt failed: {exc!r}"
        finally:
            state.busy = False
        if ok:
            logger.info("hole punch to %s took %.1f s", pid, time.monotonic() - started)
            return
        self.counters["failed"] += 1
        state.failures += 1
        outcome = self.dcutr.outcomes.get(pid)
        state.reason = (
            outcome if isinstance(outcome, str) else "no direct connection within the attempt"
        )
        wait = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (state.failures - 1))
        state.next_try = trio.current_time() + wait * self._rng.uniform(0.75, 1.25)
        logger.info("hole punch to %s failed (%s); retry in %.0f s", pid, state.reason, wait)


async def _close(conn: Any) -> None:
    try:
        await conn.close()
    except Exception as exc:  # already closing: nothing left to do
        logger.debug("closing a drained relayed connection: %r", exc)


@asynccontextmanager
async def open_hole_punching(
    node: OverlayNode, *, public_ips: Callable[[], Sequence[str]]
) -> AsyncIterator[HolePunching]:
    """Run hole punching on a running overlay node (module doc); stops it on exit."""
    punch = HolePunching(node, public_ips)
    node.link_kind = punch.punched
    node.why_relayed = punch.why_relayed
    try:
        async with background_trio_service(punch.dcutr), trio.open_nursery() as nursery:
            nursery.start_soon(punch.run)
            try:
                yield punch
            finally:
                nursery.cancel_scope.cancel()
    finally:
        node.link_kind = None
        node.why_relayed = None
