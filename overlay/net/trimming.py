"""Closing connections above the high watermark: the hands of ``overlay/net/connmgr.py``.

Contract:
- `Trimmer(host, peers, connmgr, counters, peer_id)`, owned by the node: `trim()` asks the
  `ConnManager` which connections to drop (none at or below its high watermark), closes
  them and marks those peers down with the reason "pruned" (they are the node's
  `trim_connections`); `run()` trims every ``TRIM_EVERY_S`` while the manager is enabled.
- A peer with a stream open other than the persistent ones (`IDLE_PROTOCOLS`: gossipsub,
  pings) is busy (a forward, a digest pull, a circuit we relay) and never closed.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import suppress

import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, PROTOCOL_ID_V12

from p2pnode.overlay.net.connmgr import TRIM_EVERY_S, ConnManager
from p2pnode.overlay.net.liveness import PING_PROTOCOL
from p2pnode.overlay.peers import PeerTable

__all__ = ["IDLE_PROTOCOLS", "Trimmer"]

logger = logging.getLogger(__name__)

# Streams every connection keeps open for good: they never make a peer busy for the trim.
IDLE_PROTOCOLS = frozenset(
    {PROTOCOL_ID_V11, PROTOCOL_ID_V12, TProtocol("/meshsub/1.0.0"), TProtocol(PING_PROTOCOL)}
)


class Trimmer:
    """The connection trim of one node (see the module contract)."""

    def __init__(
        self,
        host: IHost,
        peers: PeerTable,
        connmgr: ConnManager,
        counters: Counter[str],
        peer_id: str,
    ) -> None:
        self._host = host
        self._peers = peers
        self._connmgr = connmgr
        self._counters = counters
        self._peer_id = peer_id

    def _busy(self, pid: str) -> bool:
        """A stream other than the persistent ones (gossipsub, pings) is open to the peer: a
        forward, a digest pull, a circuit we relay. Closing it now would cut that short."""
        try:
            conns = self._host.get_network().get_connections(ID.from_base58(pid))
        except Exception:
            return False
        for conn in conns:
            for stream in conn.get_streams():
                if stream.get_protocol() not in IDLE_PROTOCOLS:
                    return True
        return False

    def _rtt_ms(self, pid: str) -> float | None:
        entry = self._peers.get(pid)
        return None if entry is None else entry.rtt_ms

    async def trim(self) -> list[str]:
        """Close the connections the connection manager drops now (none at or below its high
        watermark); returns those peers, marked down as pruned."""
        connected = [p.to_base58() for p in self._host.get_connected_peers()]
        drop = self._connmgr.plan_trim(self._peer_id, connected, self._rtt_ms, self._busy)
        for pid in drop:
            with trio.move_on_after(2), suppress(Exception):
                await self._host.disconnect(ID.from_base58(pid))
            self._peers.mark_down(pid, "pruned: connection limit")
        if drop:
            self._counters["pruned"] += len(drop)
            logger.debug("pruned %d connections (had %d)", len(drop), len(connected))
        return drop

    async def run(self) -> None:
        """Trim every ``TRIM_EVERY_S`` while the connection manager is enabled."""
        while self._connmgr.enabled:
            await trio.sleep(TRIM_EVERY_S)
            try:
                await self.trim()
            except Exception as exc:  # one bad round must not take the node down
                logger.warning("connection trim failed: %r", exc)
