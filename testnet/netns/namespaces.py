"""Several hosts on one machine: network namespaces on a bridge, some behind NAT routers.

Each host is a network namespace with its own addresses, so a node started in it with
DEFAULT flags (listen 0.0.0.0:4101, API 127.0.0.1:8731: every namespace has its own ports
and loopback) sees what a volunteer's machine sees. The "internet" is a bridge in a hub
namespace on ``PUBLIC_NET``:

- a ``public`` host has one address on the bridge;
- a ``nat`` host sits alone on a LAN behind its own router namespace, which has a bridge
  address and masquerades the LAN (``iptables -t nat ... MASQUERADE``); the host can dial
  out, nobody can dial in. Every LAN is ``192.168.1.0/24`` with the host at ``.2``, as home
  routers do, so two NAT'd hosts share one private address;
- a ``nat-random`` host is the same behind ``MASQUERADE --random-fully`` (source ports not
  preserved: the harder NAT for hole punching);
- a ``nat-cgnat`` host sits behind two port-preserving NATs: its home router's WAN is on a
  carrier LAN (``100.64.<i>.0/24``, RFC 6598) behind a carrier router on the bridge.

Every router is also a stateful firewall, as home routers and carrier NATs are: a packet from
the outside that belongs to no connection it saw leave is DROPPED. Without that rule the
router's own stack answers a stray SYN with a RST, which resets the mapping the peer's SYN
needs: measured here, a TCP simultaneous open between two MASQUERADE hosts then failed 5 of 5
times with "connection refused"; with the drop it connected at once. Mapping behaviour per
kind (what a test states it models):

| kind | mapping | ports | hole punching (TCP simultaneous open) |
|---|---|---|---|
| ``nat`` | endpoint-independent (MASQUERADE) | preserved | works |
| ``nat-random`` | endpoint-dependent in effect | randomized (``--random-fully``) | fails |
| ``nat-cgnat`` | endpoint-independent, two levels | preserved at both | works |

Contract:
- ``Testbed(hosts, tag=...)`` (``hosts``: name -> kind); ``with testbed:`` builds it (or
  ``build()``), ``close()`` kills every process started through it and deletes every
  namespace (veths, routes and NAT rules go with them), also after a failed build.
- ``testbed.ip(name)`` the host's own address; ``testbed.public_ip(name)`` the address
  peers see (its router's for NAT'd hosts); ``cmd(name, argv)`` an argv run inside the
  host; ``popen(name, argv, log)`` starts it as a process that ``close`` kills.
- ``require_netns()`` -> None, or the reason this machine cannot build a testbed (not root,
  no ``ip``, no ``iptables`` for NAT hosts, namespaces not permitted): tests skip with it.
Namespace names carry ``tag`` (default: this process id), so parallel runs do not collide.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from p2pnode.errors import P2PNodeError

__all__ = ["HOST_KINDS", "NAT_MODELS", "PUBLIC_NET", "Testbed", "TestbedError", "require_netns"]

HOST_KINDS = ("public", "nat", "nat-random", "nat-cgnat")
# what each NAT kind models, for tests and reports to state
NAT_MODELS = {
    "nat": "endpoint-independent, port-preserving MASQUERADE",
    "nat-random": "port-randomizing MASQUERADE --random-fully",
    "nat-cgnat": "two levels: port-preserving CGNAT in front of a port-preserving home router",
}
PUBLIC_NET = "10.77.0"  # /24 on the hub bridge
LAN_NET = "192.168.1"  # behind every router
CARRIER_NET = "100.64"  # carrier LANs of nat-cgnat hosts: 100.64.<i>.0/24
STOP_GRACE_S = 10.0


class TestbedError(P2PNodeError, RuntimeError):
    """The testbed could not be built; the message names the failing command."""

    reason = "testbed_failed"


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def require_netns(nat: bool = True) -> str | None:
    """Why a testbed cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "needs the `ip` tool (Debian package iproute2)"
    if nat and shutil.which("iptables") is None:
        return "NAT routers need `iptables` (Debian package iptables; `make setup` installs it)"
    probe = f"p2pprobe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


class Testbed:
    """Namespaced hosts on one bridge (module doc)."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        hosts: Mapping[str, str],
        *,
        tag: str | None = None,
        addresses: Mapping[str, str] | None = None,
        root_leg: str | None = None,
    ) -> None:
        bad = {n: k for n, k in hosts.items() if k not in HOST_KINDS}
        if bad:
            raise ValueError(f"unknown host kinds {bad}; use {HOST_KINDS}")
        if len(hosts) > 200:
            raise ValueError("at most 200 hosts on one bridge")
        self.hosts = dict(hosts)
        # name -> "ip/prefix" on the bridge instead of PUBLIC_NET (public hosts only)
        self.addresses = dict(addresses or {})
        # "ip/prefix" of a veth from this (root) namespace onto the bridge, so processes here
        # (a trial's driver) reach the hosts' addresses; None keeps the testbed isolated
        self.root_leg = root_leg
        self.tag = tag or str(os.getpid())
        self.hub = f"p2phub{self.tag}"
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._public: dict[str, str] = {}
        self._own: dict[str, str] = {}
        self._root_link: str | None = None

    # -- names and addresses ------------------------------------------------------------

    def ns(self, name: str) -> str:
        return f"p2p{self.tag}-{name}"

    def _router(self, name: str) -> str:
        return f"p2p{self.tag}-{name}-gw"

    def _carrier(self, name: str) -> str:
        return f"p2p{self.tag}-{name}-cg"

    def ip(self, name: str) -> str:
        return self._own[name]

    def public_ip(self, name: str) -> str:
        return self._public[name]

    def router_ns(self, name: str) -> str:
        """The namespace of a NAT'd host's router (its site's gateway, on the bridge)."""
        return self._router(name)

    def cmd(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name), *argv]

    # -- building -----------------------------------------------------------------------

    def _add_ns(self, ns: str) -> None:
        _run(["ip", "netns", "del", ns], check=False)  # a leftover of a killed run
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _wire(self, ns: str, dev: str, addr: str, peer_ns: str, peer_dev: str) -> None:
        """veth ``dev`` in ``ns`` with ``addr``, its twin ``peer_dev`` in ``peer_ns``."""
        _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer_dev,
              "netns", peer_ns])  # fmt: skip
        _run(["ip", "-n", ns, "addr", "add", addr, "dev", dev])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])
        _run(["ip", "-n", peer_ns, "link", "set", peer_dev, "up"])

    def build(self) -> Testbed:
        try:
            self._add_ns(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            if self.root_leg is not None:
                leg = f"p2pleg{self.tag}"[:15]
                _run(["ip", "link", "del", leg], check=False)
                _run(["ip", "link", "add", leg, "type", "veth", "peer", "name", "vroot",
                      "netns", self.hub])  # fmt: skip
                self._root_link = leg
                _run(["ip", "addr", "add", self.root_leg, "dev", leg])
                _run(["ip", "link", "set", leg, "up"])
                _run(["ip", "-n", self.hub, "link", "set", "vroot", "up"])
                _run(["ip", "-n", self.hub, "link", "set", "vroot", "master", "br0"])
            for i, (name, kind) in enumerate(self.hosts.items(), start=2):
                cidr = self.addresses.get(name, f"{PUBLIC_NET}.{i}/24")
                public = cidr.split("/")[0]
                self._public[name] = public
                if kind == "public":
                    self._add_ns(self.ns(name))
                    self._wire(self.ns(name), "eth0", cidr, self.hub, f"v{i}")
                    self._own[name] = public
                elif kind == "nat-cgnat":
                    self._build_cgnat(name, i, public)
                else:
                    self._build_nat(name, i, public, random_ports=kind == "nat-random")
                _run(["ip", "-n", self.hub, "link", "set", f"v{i}", "master", "br0"])
        except BaseException:
            self.close()
            raise
        return self

    def _build_nat(self, name: str, i: int, public: str, *, random_ports: bool) -> None:
        host, router = self.ns(name), self._router(name)
        self._add_ns(router)
        self._add_ns(host)
        self._wire(router, "wan0", f"{public}/24", self.hub, f"v{i}")
        self._lan(name, host, router, random_ports=random_ports)

    def _build_cgnat(self, name: str, i: int, public: str) -> None:
        """Host -> home router -> carrier router -> bridge, both routers masquerading."""
        host, router, carrier = self.ns(name), self._router(name), self._carrier(name)
        for ns in (carrier, router, host):
            self._add_ns(ns)
        self._wire(carrier, "wan0", f"{public}/24", self.hub, f"v{i}")
        inner = f"{CARRIER_NET}.{i}"
        self._wire(carrier, "lan0", f"{inner}.1/24", router, "wan0")
        _run(["ip", "-n", router, "addr", "add", f"{inner}.2/24", "dev", "wan0"])
        _run(["ip", "-n", router, "route", "add", "default", "via", f"{inner}.1"])
        _nat_router(carrier, random_ports=False)
        self._lan(name, host, router, random_ports=False)

    def _lan(self, name: str, host: str, router: str, *, random_ports: bool) -> None:
        self._wire(router, "lan0", f"{LAN_NET}.1/24", host, "eth0")
        _run(["ip", "-n", host, "addr", "add", f"{LAN_NET}.2/24", "dev", "eth0"])
        _run(["ip", "-n", host, "route", "add", "default", "via", f"{LAN_NET}.1"])
        _nat_router(router, random_ports=random_ports)
        self._own[name] = f"{LAN_NET}.2"

    # -- processes ----------------------------------------------------------------------

    def popen(
        self,
        name: str,
        argv: Sequence[str],
        log: Path | IO[bytes],
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen:
        out = log.open("wb") if isinstance(log, Path) else log
        proc = subprocess.Popen(
            self.cmd(name, argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], timeout: float = 30.0) -> str:
        """Run ``argv`` inside host ``name`` and return its stdout (``TestbedError`` on
        failure, with its stderr)."""
        result = subprocess.run(
            self.cmd(name, argv), capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise TestbedError(
                f"{' '.join(argv)} in {name} exited {result.returncode}: "
                f"{result.stderr.strip()[-2000:]}"
            )
        return result.stdout

    # -- teardown -----------------------------------------------------------------------

    def stop_processes(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM)
        for proc in self._procs:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=5)
        self._procs.clear()

    def close(self) -> None:
        self.stop_processes()
        for ns in reversed(self._namespaces):
            # Killing leftovers inside first: a namespace with live processes lingers.
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", ns], check=False)
        self._namespaces.clear()
        if self._root_link is not None:
            _run(["ip", "link", "del", self._root_link], check=False)
            self._root_link = None

    def __enter__(self) -> Testbed:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nat_router(router: str, *, random_ports: bool) -> None:
    """Forwarding, masquerading out of ``wan0``, dropping what comes in unasked (module doc)."""
    _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    masq = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"]
    _run(["ip", "netns", "exec", router, *masq, *(["--random-fully"] if random_ports else [])])
    for chain in ("INPUT", "FORWARD"):
        drop = ["iptables", "-A", chain, "-i", "wan0", "-m", "conntrack", "--ctstate",
                "NEW,INVALID", "-j", "DROP"]  # fmt: skip
        _run(["ip", "netns", "exec", router, *drop])


def _signal(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)  # the node and anything it started
