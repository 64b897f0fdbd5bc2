"""Can peers dial this node? Dial-backs by connected peers decide (AutoNAT's idea).

A node cannot see its own NAT. So it asks a few connected peers to dial it back: a peer that
opens a fresh TCP connection to one of our addresses and is greeted by a libp2p listener has
shown that address reachable. py-libp2p's own AutoNAT server answers with ``host.connect``,
which reuses the connection the request came on and so reports every node as public; this
module dials with a raw socket instead.

Contract:
- Protocol ``DIALBACK_PROTOCOL``: ``DialbackRequest(addrs)`` -> ``DialbackReply(reachable,
  observed_ip)``. The server dials only addresses on the requester's observed IP (never a
  third party: no amplification), adds that IP with each requested port (a NAT'd node's
  public side, or a port forward), refuses over relayed connections, at most
  ``MAX_DIALS`` addresses per request, each within ``DIAL_TIMEOUT_S``, rate limited per
  peer (``PeerLimiter`` scope ``dialback``).
- ``ReachabilityService(node)``: ``run()`` asks up to ``SERVERS_PER_ROUND`` connected peers
  (different IPs first) once the node has peers, again every ``RECHECK_S`` or when asked
  (``recheck()``). Verdict: "public" as soon as one address is confirmed (the addresses go to
  ``node.address_book.confirm``); "private" when at least ``min(2, peers asked)`` peers
  answered and none reached us; otherwise "unknown". On a change the node republishes its
  record and ``on_change`` callbacks run (the relay service reserves slots when private).
- ``status()``: verdict, confirmed addresses, observed IPs, counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2pnode.overlay.limits import PeerLimiter, remote_peer
from p2pnode.overlay.net.addrs import classify, ip_port
from p2pnode.overlay.wire import bounded_field, from_wire, message, read_frame, to_wire, write_frame

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from p2pnode.overlay.net.node import OverlayNode

__all__ = [
    "DIALBACK_PROTOCOL",
    "DialbackReply",
    "DialbackRequest",
    "ReachabilityService",
    "probe_listener",
]

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "/p2pnode/dialback/1"
DIALBACK_LIMIT = 8 * 1024
MAX_DIALS = 8
DIAL_TIMEOUT_S = 3.0
GREETING_FACTOR = 4.0  # see probe_listener
REQUEST_TIMEOUT_S = MAX_DIALS * (1 + GREETING_FACTOR) * DIAL_TIMEOUT_S
SERVERS_PER_ROUND = 3
RECHECK_S = 300.0
MULTISTREAM_GREETING = b"/multistream/1.0.0\n"


@message("dialback-request")
class DialbackRequest:
    addrs: tuple[str, ...] = bounded_field(max_len=16, item_max_len=256)


@message("dialback-reply")
class DialbackReply:
    reachable: tuple[str, ...] = bounded_field(max_len=16, item_max_len=256)
    observed_ip: str = bounded_field(max_len=64)


async def probe_listener(ip: str, port: int, limit_s: float = DIAL_TIMEOUT_S) -> bool:
    """Does a libp2p listener answer at ip:port? (it greets with the multistream header)

    The TCP connect gets ``limit_s``; once the port accepted, the greeting gets
    ``GREETING_FACTOR`` times longer. A connection that stays open and silent all that time
    counts as reached: the kernel completes the TCP handshake for a listening socket however
    starved its process is (64 nodes on 2 cores greeted after the window), while a NAT without
    a mapping never lets the handshake complete, and another service on the port greets with
    something else or closes. Counting such a connection as unreachable made public nodes on
    a starved machine call themselves private and relay through their bootstrap."""
    stream = None
    with trio.move_on_after(limit_s):
        try:
            stream = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
    if stream is None:
        return False  # no TCP connection within limit_s
    try:
        data = b""
        with trio.move_on_after(limit_s * GREETING_FACTOR):
            while len(data) < 1 + len(MULTISTREAM_GREETING):
                chunk = await stream.receive_some(64)
                if not chunk:
                    return False  # closed without a greeting
                data += chunk
            return MULTISTREAM_GREETING in data
        return MULTISTREAM_GREETING.startswith(data[1:]) if data else True
    except (OSError, trio.BrokenResourceError):
        return False
    finally:
        await stream.aclose()


def _observed_ip(stream: INetStream) -> str | None:
    try:
        # libp2p's NetStream has it; the INetStream abc does not declare it.
        remote = stream.get_remote_address()  # type: ignore[attr-defined]
    except Exception:
        return None
    return str(remote[0]) if remote else None


def _dial_targets(addrs: tuple[str, ...], observed: str) -> list[tuple[str, str, int]]:
    """(multiaddr, ip, port) worth dialing back: the requester's observed IP only."""
    targets: dict[tuple[str, int], str] = {}
    ports: list[int] = []
    for addr in addrs:
        try:
            endpoint = ip_port(addr)
        except Exception:  # a malformed multiaddr from the peer
            continue
        if endpoint is None:
            continue
        ip, port = endpoint
        ports.append(port)
        if ip == observed:
            targets.setdefault((ip, port), addr)
    family = "ip6" if ":" in observed else "ip4"
    for port in ports:
        targets.setdefault((observed, port), f"/{family}/{observed}/tcp/{port}")
    return [(addr, ip, port) for (ip, port), addr in list(targets.items())[:MAX_DIALS]]


class ReachabilityService:
    """Dial-back server and client of one overlay node (module doc)."""

    def __init__(self, node: OverlayNode, limiter: PeerLimiter | None = None) -> None:
        self.node = node
        self.limiter = limiter or PeerLimiter()
        self.verdict = "unknown"
        self.observed_ips: dict[str, str] = {}  # server peer id -> our IP as it saw it
        self.answers: dict[str, tuple[str, ...]] = {}  # server peer id -> addrs it reached
        self.checked_at: float | None = None
        self.on_change: list[Callable[[str], Awaitable[None]]] = []
        self._wake = trio.Event()
        node.set_stream_handler(DIALBACK_PROTOCOL, self._serve)

    # -- server -------------------------------------------------------------------------

    async def _serve(self, stream: INetStream) -> None:
        peer = remote_peer(stream)
        with self.limiter.admit(peer, "dialback"):
            with trio.fail_after(REQUEST_TIMEOUT_S):
                obj = await read_frame(stream, limit=DIALBACK_LIMIT)
            if obj is None:
                return
            request = from_wire(obj, DialbackRequest)
            observed = _observed_ip(stream)
            if observed is None or self.node.connection_kind(peer) == "relayed":
                reply = DialbackReply(reachable=(), observed_ip="")
            else:
                reached = []
                for addr, ip, port in _dial_targets(request.addrs, observed):
                    if await probe_listener(ip, port):
                        reached.append(addr)
                reply = DialbackReply(reachable=tuple(reached), observed_ip=observed)
            with trio.fail_after(REQUEST_TIMEOUT_S):
                await write_frame(stream, to_wire(reply), limit=DIALBACK_LIMIT)

    # -- client -------------------------------------------------------------------------

    def recheck(self) -> None:
        self._wake.set()

    def _candidates(self) -> tuple[str, ...]:
        out = []
        for addr in self.node.addrs:
            if classify(addr) in ("public", "private", "other"):
                out.append(addr.split("/p2p/")[0])
        for addr in self.node.host.get_transport_addrs():
            out.append(str(addr))  # the bound ports, for the observed-IP guesses
        return tuple(dict.fromkeys(out))[:16]

    def _servers(self) -> list[str]:
        """Connected peers over direct connections, one per remote IP first."""
        by_ip: dict[str, str] = {}
        rest: list[str] = []
        for peer in self.node.host.get_connected_peers():
            pid = peer.to_base58()
            if pid in self.node.refused or self.node.connection_kind(pid) != "direct":
                continue
            ip = None
            for conn in self.node.host.get_network().get_connections(peer):
                for addr in conn.get_transport_addresses():
                    endpoint = ip_port(addr)
                    ip = endpoint[0] if endpoint else None
            if ip is not None and ip not in by_ip:
                by_ip[ip] = pid
            else:
                rest.append(pid)
        return (list(by_ip.values()) + rest)[:SERVERS_PER_ROUND]

    async def _ask(self, pid: str, candidates: tuple[str, ...]) -> DialbackReply | None:
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                stream = await self.node.host.new_stream(
                    ID.from_base58(pid), [TProtocol(DIALBACK_PROTOCOL)]
                )
                try:
                    request = DialbackRequest(addrs=candidates)
                    await write_frame(stream, to_wire(request), limit=DIALBACK_LIMIT)
                    obj = await read_frame(stream, limit=DIALBACK_LIMIT)
                finally:
                    with trio.move_on_after(1):
                        await stream.close()
            return None if obj is None else from_wire(obj, DialbackReply)
        except (Exception, trio.TooSlowError) as exc:
            logger.debug("dial-back by %s failed: %r", pid, exc)
            return None

    async def check_once(self) -> str:
        servers = self._servers()
        if not servers:
            return self.verdict
        candidates = self._candidates()
        replies: dict[str, DialbackReply] = {}

        async def one(pid: str) -> None:
            reply = await self._ask(pid, candidates)
            if reply is not None:
                replies[pid] = reply

        async with trio.open_nursery() as nursery:
            for pid in servers:
                nursery.start_soon(one, pid)
        for pid, reply in replies.items():
            self.answers[pid] = reply.reachable
            if reply.observed_ip:
                self.observed_ips[pid] = reply.observed_ip
            for addr in reply.reachable:
                self.node.address_book.confirm(addr)
        reached = any(reply.reachable for reply in replies.values())
        self.checked_at = time.time()
        if reached:
            verdict = "public"
        elif len(replies) >= min(2, len(servers)):
            verdict = "private"
        else:
            verdict = self.verdict
        await self._set(verdict)
        return verdict

    async def _set(self, verdict: str) -> None:
        if verdict == self.verdict:
            return
        logger.info("reachability: %s (was %s)", verdict, self.verdict)
        self.verdict = verdict
        self.node.address_book.reachability = verdict
        for callback in list(self.on_change):
            await callback(verdict)
        with trio.move_on_after(10):
            await self.node.publish_record()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        delay = 0.5
        while True:
            with trio.move_on_after(delay):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                before = self.verdict
                await self.check_once()
            except Exception as exc:  # one bad round must not stop the checks
                logger.warning("reachability check failed: %r", exc)
            # Until a verdict, retry soon (peers are still joining); then rarely.
            known = self.verdict != "unknown" and self.verdict == before
            delay = RECHECK_S if known else min(max(2 * delay, 1.0), 10.0)

    def status(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "confirmed": list(self.node.address_book.confirmed),
            "observed_ips": sorted(set(self.observed_ips.values())),
            "servers_answered": len(self.answers),
            "checked_at": self.checked_at,
        }
