"""Which of our addresses a node advertises, and which of a peer's addresses it dials.

A node that listens on ``0.0.0.0`` or ``::`` must never tell anyone "dial me at 0.0.0.0": a
peer that does reaches its OWN listener and fails the handshake. So the advertised set is
built here, and it is what libp2p's identify, the signed node record, ``p2pnode id`` and
``/status`` all show.

Contract:
- ``AddressBook(listen, announce)``; ``book.advertise(candidates)`` is the host's
  ``addrs_factory``: it gets libp2p's candidates (the bound listen addresses, with their real
  ports, plus observed addresses several peers confirmed) and returns, in this order:
  1. ``announce`` addresses (a public or port-forwarded address the operator knows);
  2. addresses a dial-back confirmed (``book.confirm``);
  3. each unspecified listen address expanded to one address per interface of its family,
     same port; loopback interfaces only when the node has no other (a one-host cluster) or
     listens on loopback explicitly;
  4. observed addresses libp2p's observed-address manager confirmed, unless a dial-back
     already showed we are not reachable (``book.reachability == "private"``).
  Never an unspecified address; no duplicates; circuit addresses are the relay's business.
- ``dial_order(addrs, own)`` filters a peer's addresses before a dial: unspecified ones and
  our own advertised addresses are dropped (dialing them reaches ourselves), circuits are
  left to the relay fallback; the rest is ordered same-subnet, public, other private,
  loopback, so the likely path is tried first.
- ``classify(addr)``: "unspecified" | "loopback" | "private" | "public" | "circuit" | "other".
- ``interface_ips()``: (ip, network) of every up interface (psutil).
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import psutil
from multiaddr import Multiaddr

__all__ = [
    "AddressBook",
    "classify",
    "dial_order",
    "interface_ips",
    "ip_port",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _ip_of(addr: Multiaddr | str) -> IPAddress | None:
    maddr = addr if isinstance(addr, Multiaddr) else Multiaddr(addr)
    for proto in ("ip4", "ip6"):
        try:
            value = maddr.value_for_protocol(proto)
        except Exception:  # ProtocolLookupError: no such part
            continue
        if value:
            try:
                return ipaddress.ip_address(str(value).split("%")[0])
            except ValueError:
                return None
    return None


def ip_port(addr: Multiaddr | str) -> tuple[str, int] | None:
    """``/ip4/A/tcp/P/...`` -> (A, P); None for addresses without an IP and TCP port."""
    ip = _ip_of(addr)
    maddr = addr if isinstance(addr, Multiaddr) else Multiaddr(addr)
    try:
        port = maddr.value_for_protocol("tcp")
    except Exception:
        return None
    if ip is None or port is None:
        return None
    return str(ip), int(port)


def classify(addr: Multiaddr | str) -> str:
    """What kind of address this is (module doc); "other" for DNS names and the like."""
    if "/p2p-circuit" in str(addr):
        return "circuit"
    ip = _ip_of(addr)
    if ip is None:
        return "other"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_global:
        return "public"
    return "private"


# Interfaces change rarely (a laptop moving networks); every identify and dial asks.
_INTERFACE_TTL_S = 10.0
_interface_cache: tuple[float, list[tuple[IPAddress, IPNetwork]]] = (-1e18, [])


def interface_ips() -> list[tuple[IPAddress, IPNetwork]]:
    """(address, network) of every interface that is up, IPv4 and IPv6 (link-local v6 left
    out: it needs a zone id to be dialed). Cached for a few seconds."""
    global _interface_cache
    now = time.monotonic()
    if now - _interface_cache[0] < _INTERFACE_TTL_S:
        return _interface_cache[1]
    _interface_cache = (now, _read_interfaces())
    return _interface_cache[1]


def _read_interfaces() -> list[tuple[IPAddress, IPNetwork]]:
    stats = psutil.net_if_stats()
    out: list[tuple[IPAddress, IPNetwork]] = []
    for name, entries in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6) or not entry.netmask:
                continue
            try:
                ip = ipaddress.ip_address(entry.address.split("%")[0])
                net = ipaddress.ip_network(f"{ip}/{entry.netmask}", strict=False)
            except ValueError:
                continue
            if ip.version == 6 and ip.is_link_local:
                continue
            out.append((ip, net))
    return out


def _strip_peer(maddr: Multiaddr) -> Multiaddr:
    text = str(maddr)
    head, sep, _tail = text.partition("/p2p/")
    return Multiaddr(head) if sep and "/p2p-circuit" not in text else maddr


def _expand(listen: Multiaddr, interfaces: Sequence[tuple[IPAddress, IPNetwork]]) -> list[str]:
    """An unspecified listen address -> one per interface of its family (same port/suffix)."""
    ip = _ip_of(listen)
    if ip is None or not ip.is_unspecified:
        return [str(listen)]
    family = "ip4" if ip.version == 4 else "ip6"
    rest = str(listen).split("/", 3)[3]  # "tcp/4101" (and anything after it)
    ips = [a for a, _ in interfaces if a.version == ip.version]
    routable = [a for a in ips if not a.is_loopback]
    return [f"/{family}/{a}/{rest}" for a in (routable or ips)]


@dataclass
class AddressBook:
    """Our advertised addresses (module doc). Mutated by the reachability check."""

    announce: list[str] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)
    reachability: str = "unknown"  # "unknown" | "public" | "private"
    interfaces: list[tuple[IPAddress, IPNetwork]] | None = None  # None: read them each time

    def confirm(self, addr: str) -> None:
        if addr not in self.confirmed and classify(addr) not in ("unspecified", "circuit"):
            self.confirmed.append(addr)

    def advertise(self, candidates: list[Multiaddr]) -> list[Multiaddr]:
        interfaces = self.interfaces if self.interfaces is not None else interface_ips()
        bound = [_strip_peer(c) for c in candidates]
        observed = [c for c in bound if _is_observed(c, interfaces)]
        listen = [c for c in bound if c not in observed]
        out: list[str] = []
        for addr in self.announce:
            out.append(str(_strip_peer(Multiaddr(addr))))
        out.extend(self.confirmed)
        for addr in listen:
            out.extend(_expand(addr, interfaces))
        if self.reachability != "private":
            out.extend(str(a) for a in observed)
        seen: set[str] = set()
        result: list[Multiaddr] = []
        for addr in out:
            if addr in seen or classify(addr) in ("unspecified", "circuit"):
                continue
            seen.add(addr)
            result.append(Multiaddr(addr))
        return result


def _is_observed(addr: Multiaddr, interfaces: Sequence[tuple[IPAddress, IPNetwork]]) -> bool:
    """libp2p appends observed addresses to the bound ones: an address with an IP that none
    of our interfaces has (behind NAT: the router's public side)."""
    ip = _ip_of(addr)
    if ip is None or ip.is_unspecified:
        return False
    return all(ip != own for own, _ in interfaces)


def dial_order(addrs: Iterable[Multiaddr], own: Iterable[Multiaddr | str] = ()) -> list[Multiaddr]:
    """A peer's addresses worth dialing, likely path first (module doc)."""
    own_endpoints = {ip_port(a) for a in own} - {None}
    interfaces = interface_ips()

    def rank(addr: Multiaddr) -> int:
        ip = _ip_of(addr)
        if ip is None:
            return 2
        if ip.is_loopback:
            return 4
        if any(ip in net for _, net in interfaces if not net.network_address.is_loopback):
            return 0
        return 1 if ip.is_global else 3

    keep: list[Multiaddr] = []
    seen: set[str] = set()
    for addr in addrs:
        kind = classify(addr)
        if kind in ("unspecified", "circuit") or str(addr) in seen:
            continue
        if ip_port(addr) in own_endpoints:
            continue  # one of our own addresses: the dial would reach ourselves
        seen.add(str(addr))
        keep.append(addr)
    return sorted(keep, key=rank)
