"""WAN emulation in userspace: delay (and optionally shape) every raw TCP connection of libp2p.

This kernel has no netem, so the delay is injected just above the socket, below everything
libp2p runs on it (multistream, Noise, yamux, DHT, gossipsub, pings, our own protocols):

- Every raw TCP connection py-libp2p 0.8.1 makes or accepts is a
  ``libp2p.io.trio.TrioTCPStream`` (dials in ``transport/tcp/tcp.py``, accepts there and in the
  port demultiplexer of ``transport/manager.py``). ``install`` patches that class's ``write``
  and ``close``: a write is stamped ``due = departure + one-way delay`` and queued; a
  per-connection pump task sends it at ``due``. The writer is not blocked for the delay (only
  when over ``MAX_PENDING_BYTES`` are queued), order is preserved (``due`` never decreases on a
  connection), and ``close`` lets queued bytes leave first, like a kernel socket's FIN.
  Reads are untouched: the far side's writes carry that direction's delay, so a round trip
  costs ``2 * delay_ms`` when both ends run ``install`` (every node of a trial does).
- Regions by address: region ``i`` of the spec's ``network.regions`` owns ``127.(10+i).0.0/16``
  (or, for trials on namespace hosts, ``198.18.i.0/24`` of ``NETNS_NET``: each host's own
  address, so no source rewriting is needed)
  (all of 127/8 is local on Linux, no setup). ``node_ip(spec, region, k)`` gives the k-th node
  of a region its own listen IP; ``install`` also patches ``TCP._dial_resolved`` so outgoing
  connections leave from the node's own listen IP (``source_ip``; the region's gateway IP
  ``127.(10+i).0.1`` when none is given), hence a listener can tell the dialer's region from
  the peer address. Leaving from the node's own IP matters beyond that: a peer that dials a
  node back to check its reachability dials the IP the node's connections came from, and from a
  shared gateway IP most nodes looked unreachable (as behind a NAT), so in a 64-node loopback
  trial every node had called itself private by the end and reserved relay slots. The link (delay, bandwidth) is looked up from
  (this process's region, the remote IP's region); a remote outside every region's subnet
  (e.g. 127.0.0.1) gets no delay.
- Bandwidth (``bandwidth_mbps`` > 0) is a per-connection serializer: a write departs when the
  previous one has left, ``len / rate`` later; 0 means unshaped.
- Not delayed: the kernel's TCP handshake (SYN/ACK) and the HTTP API (not libp2p). A libp2p
  dial still costs ~4-5 delayed round trips (multistream, Noise XX, yamux): measured 1.9 s to
  join at 200 ms one-way.
- ``suggested_timeouts(spec_path, region)``: overlay timeouts that survive the spec's worst link
  from `region` (node defaults of 1 s ping / 3 s connect break at 200 ms one-way: a ping on a
  fresh stream needs ~3 round trips = 1.2 s, so peers are marked down and never recover).
- ``install(spec_path, region, source_ip=None)`` is idempotent per arguments and must run in the node
  process before its libp2p host is created; ``uninstall()`` restores libp2p (tests).
  ``WanError`` for an unknown region or a spec that does not load.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from p2pnode.errors import P2PNodeError
from p2pnode.testnet.spec import MAX_REGIONS, SpecError, TrialSpec, load_spec

log = logging.getLogger("p2pnode.testnet.netns.wan")

FIRST_OCTET = 10  # region i -> 127.(10+i).0.0/16; 127.0.0.0/16 (plain localhost) stays undelayed
# Trials on namespace hosts (``launch_trial(hosts="netns")``): region i -> the i-th /24 of the
# benchmarking range (RFC 2544), so hosts get real, non-loopback addresses.
NETNS_NET = ipaddress.IPv4Network("198.18.0.0/15")
NETNS_PER_REGION = 250
MAX_PENDING_BYTES = 64 << 20  # writers wait beyond this (a slow link must not eat all memory)
NODES_PER_REGION = 250 * 250


class WanError(P2PNodeError, RuntimeError):
    """WAN emulation cannot be set up as asked; the message says what to fix."""

    reason = "wan_failed"


@dataclass(frozen=True)
class LinkParams:
    delay_s: float
    bytes_per_s: float  # 0: unshaped


@dataclass
class _Installed:
    spec: TrialSpec
    spec_path: str
    region: str
    source_ip: str
    # remote region -> link parameters from this process's region
    links: dict[str, LinkParams]


_state: _Installed | None = None
_originals: dict[str, Any] = {}


# --------------------------------------------------------------------------- addressing


def _region_index(spec: TrialSpec, region: str) -> int:
    try:
        return spec.network.regions.index(region)
    except ValueError:
        raise WanError(
            f"region {region!r} is not in the spec's network.regions {list(spec.network.regions)}"
        ) from None


def region_subnet(spec: TrialSpec, region: str) -> ipaddress.IPv4Network:
    i = _region_index(spec, region)
    if i >= MAX_REGIONS:
        raise WanError(f"at most {MAX_REGIONS} regions fit in 127/8")
    return ipaddress.IPv4Network(f"127.{FIRST_OCTET + i}.0.0/16")


def gateway_ip(spec: TrialSpec, region: str) -> str:
    """Source IP of this region's outgoing connections."""
    return str(region_subnet(spec, region).network_address + 1)


def node_ip(spec: TrialSpec, region: str, k: int, addressing: str = "loopback") -> str:
    """Listen IP of the k-th node (0-based, counted per region) placed in `region`; with
    ``addressing="netns"`` its namespace host's address in ``NETNS_NET``."""
    if addressing == "netns":
        if not 0 <= k < NETNS_PER_REGION:
            raise WanError(f"at most {NETNS_PER_REGION} namespace hosts per region")
        i = _region_index(spec, region)
        return str(NETNS_NET.network_address + 256 * i + k + 2)
    if not 0 <= k < NODES_PER_REGION:
        raise WanError(f"node index {k} out of range for one region")
    base = region_subnet(spec, region).network_address
    return str(base + (k // 250) * 256 + (k % 250) + 2)


def region_of_ip(spec: TrialSpec, ip: str) -> str | None:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if addr.version == 4 and addr in NETNS_NET:
        i = (int(addr) - int(NETNS_NET.network_address)) // 256
        return spec.network.regions[i] if i < len(spec.network.regions) else None
    if addr.version != 4 or not addr.is_loopback:
        return None
    i = addr.packed[1] - FIRST_OCTET
    if 0 <= i < len(spec.network.regions):
        return spec.network.regions[i]
    return None


def link_params(spec: TrialSpec, a: str, b: str) -> LinkParams:
    link = spec.network.link(a, b)
    return LinkParams(link.delay_ms / 1000.0, link.bandwidth_mbps * 1e6 / 8.0)


# --------------------------------------------------------------------------- the delay queue


class _DelayLine:
    """Queue of (due time, bytes) of one connection, drained by a trio system task."""

    def __init__(self, conn: Any, params: LinkParams) -> None:
        self.conn = conn
        self.params = params
        self.send, self.recv = trio.open_memory_channel[tuple[float, bytes | None]](math.inf)
        self.busy_until = 0.0  # when the last queued byte has left (bandwidth serializer)
        self.last_due = 0.0
        self.pending = 0
        self.drained = trio.Event()
        self.done = trio.Event()
        self.error: BaseException | None = None
        self.closing = False
        self.raw_write = _originals["write"]  # kept: uninstall() must not break live pumps
        trio.lowlevel.spawn_system_task(self._pump, name="p2pnode-wan-pump")

    def _due(self, size: int) -> float:
        now = trio.current_time()
        start = max(now, self.busy_until)
        serial = size / self.params.bytes_per_s if self.params.bytes_per_s > 0 else 0.0
        self.busy_until = start + serial
        # max(): order must hold even if the clock or the parameters were odd
        self.last_due = max(self.last_due, self.busy_until + self.params.delay_s)
        return self.last_due

    async def submit(self, data: bytes) -> None:
        from libp2p.io.exceptions import ConnectionClosedError

        if self.error is not None:
            raise ConnectionClosedError(f"delayed TCP connection failed: {self.error}")
        if self.closing:
            return  # like a write on a locally closed TrioTCPStream
        while self.pending > MAX_PENDING_BYTES:
            self.drained = trio.Event()
            await self.drained.wait()
        self.pending += len(data)
        self.send.send_nowait((self._due(len(data)), data))
        await trio.lowlevel.checkpoint()

    async def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.send.send_nowait((self.last_due, None))
        # Queued bytes leave first; bounded so a stuck peer cannot hold a shutdown forever.
        with trio.move_on_after(self.params.delay_s + 5.0):
            await self.done.wait()
        if not self.done.is_set():
            await trio.aclose_forcefully(self.conn.stream)

    async def _pump(self) -> None:
        from libp2p.io.exceptions import ConnectionClosedError

        try:
            async for due, data in self.recv:
                await trio.sleep_until(due)
                if data is None:
                    break
                try:
                    await self.raw_write(self.conn, data)
                except ConnectionClosedError as exc:
                    self.error = exc
                    break
                self.pending -= len(data)
                if self.pending <= MAX_PENDING_BYTES:
                    self.drained.set()
        except Exception as exc:  # a system task must never raise: it would crash the node
            self.error = exc
            log.debug("wan pump stopped: %r", exc)
        finally:
            self.drained.set()
            self.done.set()
            if self.closing or self.error is not None:
                await trio.aclose_forcefully(self.conn.stream)


def _line_for(conn: Any) -> _DelayLine | None:
    """The connection's delay line, created on first write; None when this link has no delay."""
    line = conn.__dict__.get("_p2pnode_wan", False)
    if line is not False:
        return line
    line = None
    state = _state
    remote = conn.get_remote_address()
    if state is not None and remote is not None:
        region = region_of_ip(state.spec, remote[0])
        params = state.links.get(region) if region is not None else None
        if params is not None and (params.delay_s > 0 or params.bytes_per_s > 0):
            line = _DelayLine(conn, params)
    conn.__dict__["_p2pnode_wan"] = line
    return line


async def _delayed_write(self: Any, data: bytes) -> None:
    line = _line_for(self)
    if line is None:
        await _originals["write"](self, data)
    else:
        await line.submit(bytes(data))


async def _delayed_close(self: Any) -> None:
    line = self.__dict__.get("_p2pnode_wan")
    if line:
        await line.close()
    else:
        await _originals["close"](self)


async def _dial_from_region(self: Any, maddr: Any, source: tuple[str, int] | None = None):
    state = _state
    if source is None and state is not None:
        try:
            ip4 = maddr.value_for_protocol("ip4")
        except Exception:  # no ip4 part (dns, ip6): dial as libp2p would
            ip4 = None
        if ip4 is not None and ipaddress.ip_address(ip4).is_loopback:
            source = (state.source_ip, 0)
    return await _originals["dial"](self, maddr, source)


# --------------------------------------------------------------------------- install


def install(spec_path: str, region: str, source_ip: str | None = None) -> None:
    """Delay this process's libp2p TCP connections as the spec says for a node in `region`.

    Call before the libp2p host is created. A second call with the same arguments is a no-op;
    with other arguments it replaces the first (connections already open keep their link).
    """
    global _state
    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        raise WanError(f"cannot emulate the WAN of {spec_path}: {exc}") from None
    _region_index(spec, region)
    if source_ip is None:
        source_ip = gateway_ip(spec, region)
    elif ipaddress.ip_address(source_ip) not in region_subnet(spec, region):
        raise WanError(
            f"source IP {source_ip} is outside region {region}'s {region_subnet(spec, region)}:"
            " listen on an address of the region (testnet.wan.node_ip)"
        )
    links = {other: link_params(spec, region, other) for other in spec.network.regions}
    if _state is not None and (_state.spec_path, _state.region, _state.source_ip) == (
        str(spec_path),
        region,
        source_ip,
    ):
        return
    _patch()
    _state = _Installed(spec, str(spec_path), region, source_ip, links)
    log.info(
        "WAN emulation: region %s of %s, links %s",
        region,
        Path(spec_path).name,
        {r: f"{p.delay_s * 1000:g} ms" for r, p in links.items()},
    )


def suggested_timeouts(spec_path: str, region: str) -> dict[str, float]:
    """Timeouts (s) for a node in `region`: 1 s / 3 s floors, scaled by the worst round trip."""
    spec = load_spec(spec_path)
    _region_index(spec, region)
    rtt = 2 * max(link_params(spec, region, r).delay_s for r in spec.network.regions)
    return {
        # opening a ping stream (multistream) + the ping itself: ~3 round trips
        "ping_timeout": round(max(1.0, 3 * rtt + 1.0), 3),
        # TCP + multistream + Noise XX + yamux: ~5 round trips, measured 4.6
        "connect_timeout": round(max(3.0, 6 * rtt + 2.0), 3),
        "dial_timeout": round(max(5.0, 6 * rtt + 2.0), 3),
        # libp2p's health probe negotiates a new stream each time: ~3 round trips
        "health_ping_timeout": round(max(2.0, 3 * rtt + 1.0), 3),
    }


def installed() -> tuple[str, str] | None:
    """(spec path, region) when emulation is on in this process, else None."""
    return (_state.spec_path, _state.region) if _state is not None else None


def uninstall() -> None:
    """Restore libp2p's own TCP write/close/dial (connections made meanwhile stay delayed)."""
    global _state
    _state = None
    if not _originals:
        return
    from libp2p.io.trio import TrioTCPStream
    from libp2p.transport.tcp.tcp import TCP

    TrioTCPStream.write = _originals.pop("write")
    TrioTCPStream.close = _originals.pop("close")
    TCP._dial_resolved = _originals.pop("dial")


def _patch() -> None:
    if _originals:
        return
    from libp2p.io.trio import TrioTCPStream
    from libp2p.transport.tcp.tcp import TCP

    _originals["write"] = TrioTCPStream.write
    _originals["close"] = TrioTCPStream.close
    _originals["dial"] = TCP._dial_resolved
    TrioTCPStream.write = _delayed_write
    TrioTCPStream.close = _delayed_close
    TCP._dial_resolved = _dial_from_region
