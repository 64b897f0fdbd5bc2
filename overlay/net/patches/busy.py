"""Admission under a join storm: a node takes on only the inbound work it can finish, and
keeps taking it on for as long as it runs.

The bounds and how they were measured (details below): at most 24 inbound connections in
their handshake at once (a bootstrap among 65 processes on 2 cores admitted ~7 joiners a
second, so 24 is a backlog of ~3.5 s, inside a dialer's 15 s) and at most 128 inbound streams
in protocol negotiation (the 5-8 streams each joiner opens at once for ~20 joiners). Beyond
the first, a connection is closed before its handshake; beyond the second, a stream is reset
unread. From ``BUSY_SHARE`` of the second bound (the hello stream itself must still be
negotiated to be answered), and for ``BUSY_MEMORY_S`` after it last turned a stream away, the
node's hello answers "busy, retry after N s" (``AdmissionLoad.retry_after_s``): N is the
time its negotiations in flight take to drain at the rate it finished the last
``RATE_SAMPLES`` of them, within ``RETRY_AFTER_S``. The hello is answered after the handshake, so the busy answer saves the
joiner's follow-up streams (identify, Kademlia, gossipsub, ping, dial-back, records), not
the handshake: a handshake bound that sent completed handshakes away would throw the most
expensive step away, so a full handshake stage alone does not make the hello busy.

Why: py-libp2p 0.8.1 accepts every inbound connection and starts its Noise handshake, and
negotiates every inbound stream, however many are already waiting for the CPU. On a
bootstrap that many joiners reach at once (64 node processes started together on 2 cores,
the bootstrap at 44-61 connections and a load of 34-38), the work queued up until the
joiners' limits ran out (their stream opens give up after 15 s); about a quarter of the
bootstrap's time then went to negotiating streams whose openers had already reset them, and
~40 late joiners never got one answered: formation stopped instead of slowing down. A
public swarm's bootstrap meets this whenever a network starts or recovers.

So, per host, as go-libp2p's resource manager bounds work in progress rather than work done:
- at most ``BusyLimits.handshakes`` inbound connections in their security and muxer upgrade
  at once; one more gets multistream's greeting and is closed before its handshake
  (``counters["busy_conns"]``), which costs an accept, a write and a close; the dialer learns
  it at once instead of after its timeout (and retries with jittered backoff: ``dialing.py``),
  and a dial-back probe still sees a listener (``reachability.py``);
- at most ``BusyLimits.negotiations`` inbound streams in protocol negotiation at once; one
  more is reset before anything is read from it (``counters["busy_streams"]``), which every
  libp2p caller already handles as a refused stream;
- a stream its opener reset while it waited for the CPU is dropped before its handler runs
  (``counters["abandoned_streams"]``), not answered into a closed pipe;
- libp2p's own inbound cap (``Swarm._inbound_limiter``, ``max_connections`` tokens) is
  lifted: each inbound connection held a token until the swarm stopped, not until it closed,
  so a node refused every inbound connection after ``max_connections`` (128 here) in its
  lifetime, before the handshake and without a word. A bootstrap whose 64 joiners each
  redeem an invite and then join makes exactly 128: this, not the CPU, is what left late
  joiners alone (measured: a 128-joiner storm's bootstrap idle at 13 connections with 56
  connections unaccepted in its listen queue; 17 of 128 joiners admitted). The lingering
  handler tasks (one small task per lifetime inbound connection) remain.
Bounds: a bootstrap among 65 processes on 2 cores admitted 64 joiners (128 handshakes with
their invite redemptions) in 17 s, ~7 a second, so 24 under way is a backlog of a few
seconds, well inside a dialer's limit (15 s for background dials); 128
negotiations is the 5-8 streams each joiner opens at once (identify, hello, Kademlia,
gossipsub, ping, dial-back, records) for ~20 joiners. Tighter bounds (8 and 32) turned away
work the bootstrap had the CPU for: 32 joiners took 62 s to be admitted instead of 6-8 s.
``tests/overlay/test_busy.py`` pins the bounds with a real host and no clock.

On a libp2p upgrade, recheck: ``Swarm.upgrade_inbound_raw_conn(raw_conn, maddr)`` is still
the one path of every inbound TCP or WebSocket connection (looked up on the instance, so our
attribute wins); ``BasicHost.multiselect.negotiate(communicator, timeout)`` is still the first
thing ``_swarm_stream_handler`` does with an inbound stream (``gate.py`` wraps the same call;
install this one after it so the bound counts gated negotiations too);
``YamuxStream.reset_received`` still says the opener reset the stream; and whether
``Swarm._handle_inbound_connection`` still holds ``_inbound_limiter`` past the connection's
close (``_do_handle_inbound_connection`` awaiting ``self.manager.wait_finished()``): once it
releases on close, drop the lift.

Contract: ``install_busy_limits(host, counters, limits=BusyLimits()) -> AdmissionLoad`` once,
before the host serves. ``BusyLimits`` is a frozen dataclass of the two bounds (each at least
1). ``AdmissionLoad.retry_after_s()`` is None while the node admits, else seconds (the hello's
``retry_after_s``, ``admission.py``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.exceptions import SwarmException
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

from p2pnode.overlay._errors import OverlayError

__all__ = ["BUSY_PROTOCOL", "AdmissionLoad", "Busy", "BusyLimits", "install_busy_limits"]

logger = logging.getLogger(__name__)

RESET_TIMEOUT_S = 2.0
# What a stream refused for want of capacity is labelled with (libp2p records the protocol a
# stream negotiated; this one negotiated none, and is reset at once).
BUSY_PROTOCOL = TProtocol("/p2pnode/busy")
# multistream-select's header, as a listener sends it first (varint length, then the text).
BUSY_GREETING = b"\x13/multistream/1.0.0\n"
# Hellos answer busy from this share of the negotiation bound on.
BUSY_SHARE = 0.75
# After turning a stream away, hellos answer busy for this long (the backlog that made it
# turn work away is still there; a moment later the node judges again).
BUSY_MEMORY_S = 1.0
# Negotiations whose end times give the drain rate (a few joiners' worth).
RATE_SAMPLES = 32
# A busy answer's retry-after: at least (two tries a second per joiner would be a storm of
# their own), at most (a joiner must not wait minutes on a node that drains in seconds), and
# before any negotiation finished.
RETRY_AFTER_S = (2.0, 30.0)
RETRY_AFTER_DEFAULT_S = 4.0


class Busy(OverlayError, SwarmException):
    """This node has as much inbound work in progress as it takes; the peer may retry later."""

    reason = "busy"


@dataclass(frozen=True)
class BusyLimits:
    handshakes: int = 24
    negotiations: int = 128

    def __post_init__(self) -> None:
        if self.handshakes < 1 or self.negotiations < 1:
            raise ValueError(f"busy limits must be at least 1, got {self}")


class AdmissionLoad:
    """One host's inbound work in flight, and whether its hello should answer busy."""

    def __init__(self, limits: BusyLimits) -> None:
        self.limits = limits
        self.handshakes = 0
        self.negotiations = 0
        self._finished: deque[float] = deque(maxlen=RATE_SAMPLES)  # trio times
        self._turned_away_at = -math.inf
        self.busy_at = max(1, int(limits.negotiations * BUSY_SHARE))

    def turned_away(self) -> None:
        self._turned_away_at = trio.current_time()

    def finished(self) -> None:
        self._finished.append(trio.current_time())

    def retry_after_s(self) -> float | None:
        """None while the node admits; else when to come back (module doc)."""
        now = trio.current_time()
        full = self.negotiations >= self.busy_at
        if not full and now - self._turned_away_at > BUSY_MEMORY_S:
            return None
        lo, hi = RETRY_AFTER_S
        done = self._finished
        span = done[-1] - done[0] if len(done) >= 2 else 0.0
        if span <= 0:
            return RETRY_AFTER_DEFAULT_S
        rate = (len(done) - 1) / span
        return round(min(hi, max(lo, self.negotiations / rate)), 1)


def install_busy_limits(
    host: IHost, counters: Counter[str], limits: BusyLimits | None = None
) -> AdmissionLoad:
    """Bound ``host``'s inbound handshakes and negotiations (module contract)."""
    limits = limits or BusyLimits()
    swarm: Any = host.get_network()
    upgrade = swarm.upgrade_inbound_raw_conn
    load = AdmissionLoad(limits)

    async def bounded_upgrade(raw_conn: Any, maddr: Any) -> Any:
        if load.handshakes >= limits.handshakes:
            counters["busy_conns"] += 1
            with trio.move_on_after(RESET_TIMEOUT_S), suppress(Exception):
                # The greeting first: a dial-back probe (reachability.py) then still sees a
                # libp2p listener here; a silent close read as "not reachable", and a
                # busy public node called itself private.
                await raw_conn.write(BUSY_GREETING)
            with trio.move_on_after(RESET_TIMEOUT_S), suppress(Exception):
                await raw_conn.close()
            raise Busy(f"{limits.handshakes} inbound handshakes under way; closed before one more")
        load.handshakes += 1
        try:
            return await upgrade(raw_conn, maddr)
        finally:
            load.handshakes -= 1

    swarm.upgrade_inbound_raw_conn = bounded_upgrade
    # libp2p's own inbound cap holds a token per inbound connection until the SWARM stops
    # (its handler awaits the swarm's end, not the connection's): after `max_connections`
    # inbound connections in its lifetime a node refused every new one before the handshake.
    # Live connections stay bounded by the swarm's check of its table against
    # `max_connections`, by the handshake bound above and by the connection manager.
    swarm._inbound_limiter = trio.CapacityLimiter(math.inf)
    multiselect: Any = host.multiselect  # type: ignore[attr-defined]
    negotiate = multiselect.negotiate

    async def bounded_negotiate(communicator: MultiselectCommunicator, *args: object) -> object:
        if load.negotiations >= limits.negotiations:
            counters["busy_streams"] += 1
            load.turned_away()
            return BUSY_PROTOCOL, _reset
        load.negotiations += 1
        try:
            protocol, handler = await negotiate(communicator, *args)
            load.finished()
        finally:
            load.negotiations -= 1
        if handler is None:
            return protocol, handler
        return protocol, _unless_abandoned(handler, counters)

    multiselect.negotiate = bounded_negotiate
    return load


async def _reset(net_stream: INetStream) -> None:
    with trio.move_on_after(RESET_TIMEOUT_S), suppress(Exception):
        await net_stream.reset()


def _unless_abandoned(
    handler: Callable[[INetStream], Any], counters: Counter[str]
) -> Callable[[INetStream], Any]:
    async def run(net_stream: INetStream) -> None:
        muxed = getattr(net_stream, "muxed_stream", None)
        if getattr(muxed, "reset_received", False):
            counters["abandoned_streams"] += 1
            return
        await handler(net_stream)

    return run
