"""The closed network's gate: no protocol but the hello (and invite redemption) runs with a
peer whose membership this node has not verified, in either direction.

On a libp2p upgrade, recheck: ``BasicHost._swarm_stream_handler`` still calls
``self.multiselect.negotiate(communicator, timeout)`` and then the handler it returns (the one
seam every inbound stream passes: identify, Kademlia, gossipsub, relay hop/stop, ping and
ours); ``MultiselectCommunicator.read_writer`` is still the net stream; and every outbound
stream of libp2p's own services (pubsub, Kademlia, identify, relay) still goes through
``host.new_stream`` (looked up on the instance, so our attribute wins). Run
``tests/overlay/test_closed.py``.

Why here and not per handler: handlers are registered by libp2p's services at their own times
(pubsub in its constructor, Kademlia and relay later), and a handler we forgot to wrap would
leak; the negotiation is the one place all of them pass. Why wait rather than reset at once:
the listener admits the dialer before it answers the hello, and its own streams can reach the
dialer before the dialer has read that answer; they wait for the verdict (bounded by
``members.VERDICT_TIMEOUT_S``) and run only if it admits the peer.

Contract: ``install_gate(host, policy, counters)`` once, before the host serves.
``policy.exempt`` lists the protocols that run ungated; ``policy.admitted(pid)`` and
``await policy.wait_verdict(pid)`` decide. Inbound streams of other protocols from a peer not
admitted are reset (``counters["gate_reset"]``); ``host.new_stream`` to such a peer raises
``GateClosed`` (a libp2p ``SwarmException``, which pubsub's retry expects) after the wait.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from contextlib import suppress
from typing import Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

from p2pnode.overlay._errors import OverlayError

__all__ = ["GateClosed", "GatePolicy", "install_gate"]

logger = logging.getLogger(__name__)

RESET_TIMEOUT_S = 2.0


class GateClosed(OverlayError, SwarmException):
    """The peer has no verified membership of this closed network."""

    reason = "gate_closed"


class GatePolicy(Protocol):
    exempt: frozenset[str]

    def admitted(self, peer_id: str) -> bool: ...

    async def wait_verdict(self, peer_id: str) -> bool: ...


def install_gate(host: IHost, policy: GatePolicy, counters: Counter[str]) -> None:
    """Gate every stream of ``host`` by ``policy`` (module contract)."""
    multiselect = host.multiselect  # type: ignore[attr-defined]
    negotiate = multiselect.negotiate

    async def gated_negotiate(communicator: MultiselectCommunicator, *args: object) -> object:
        protocol, handler = await negotiate(communicator, *args)
        if handler is None or protocol in policy.exempt:
            return protocol, handler
        stream = communicator.read_writer
        pid = stream.muxed_conn.peer_id.to_base58()  # type: ignore[attr-defined]
        if policy.admitted(pid):
            return protocol, handler

        async def held(net_stream: INetStream) -> None:
            if await policy.wait_verdict(pid):
                await handler(net_stream)
                return
            counters["gate_reset"] += 1
            logger.debug("reset a %s stream of non-member %s", protocol, pid)
            with trio.move_on_after(RESET_TIMEOUT_S), suppress(Exception):
                await net_stream.reset()

        return protocol, held

    multiselect.negotiate = gated_negotiate
    new_stream = host.new_stream

    async def gated_new_stream(peer_id: ID, protocol_ids: Sequence[TProtocol]) -> INetStream:
        if not all(p in policy.exempt for p in protocol_ids):
            pid = peer_id.to_base58()
            if not policy.admitted(pid) and not await policy.wait_verdict(pid):
                counters["gate_refused_open"] += 1
                raise GateClosed(f"peer {pid} has no verified membership of this network")
        return await new_stream(peer_id, protocol_ids)

    host.new_stream = gated_new_stream  # type: ignore[method-assign]
