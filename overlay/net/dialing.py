"""How a node dials: one peer within a time limit, its bootstrap peers with backoff, and only
addresses worth dialing.

Contract:
- `parse_peer_addr(addr)`: `/ip4/.../tcp/.../p2p/<id>` -> PeerInfo; `BadMultiaddr` when
  malformed or without a peer id.
- `Dialer(host, dht, config, admission)`, owned by the node: `dial(info, background=)`
  connects within `background` x `connect_timeout` (`PeerUnreachable` otherwise, also for a
  refused peer; `PeerBusy`, without dialing, for a peer whose hello answered "busy, retry
  after N s" until that time has passed: `admission.py`) and notes the time in `last_dial`
  (discovery spaces redials by it);
  `bootstrap()` dials every one of `bootstrap_infos` at once, each with exponential backoff
  bounded by `bootstrap_attempts`, its waits jittered (`jittered`), each dial's limit growing
  with the failures so far (across calls) up to `BOOTSTRAP_TIMEOUT_FACTOR`; unreachable
  ones are logged in one line each (with `require_bootstrap` `BootstrapFailed` is raised
  instead), then raises `NetworkMismatch` when every bootstrap peer reached is of another
  network or version. A bootstrap peer that answered busy is not retried there: it is
  reachable, so not a failure; `bootstrap_busy_s()` says how long until one may be dialed
  again, and discovery dials it then and the peers it named meanwhile.
- `filtered_connect(host)` and `filter_peerstore(host)` wrap the host once at assembly so
  that no dial (ours, the DHT's, the swarm's) tries an unspecified or our own address
  (``overlay/net/addrs.py``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from p2pnode.overlay._errors import BadMultiaddr, BootstrapFailed, PeerBusy, PeerUnreachable
from p2pnode.overlay.net.addrs import dial_order
from p2pnode.overlay.net.admission import REFUSED_US, Admission
from p2pnode.overlay.net.config import BOOTSTRAP_TIMEOUT_FACTOR, OverlayConfig
from p2pnode.overlay.net.dht import OverlayDHT
from p2pnode.overlay.net.hello import NetworkMismatch, NotAMember
from p2pnode.overlay.net.host import parse_multiaddr

__all__ = ["Dialer", "filter_peerstore", "filtered_connect", "jittered", "parse_peer_addr"]

logger = logging.getLogger(__name__)


def parse_peer_addr(addr: str) -> PeerInfo:
    """`/ip4/.../tcp/.../p2p/<id>` -> PeerInfo; `BadMultiaddr` when malformed or without id."""
    maddr = parse_multiaddr(addr)
    try:
        return info_from_p2p_addr(maddr)
    except Exception as exc:
        raise BadMultiaddr(f"peer address {addr!r} must end in /p2p/<peer id> ({exc})") from None


class Dialer:
    """The dialing side of one node (see the module contract)."""

    def __init__(
        self,
        host: IHost,
        dht: OverlayDHT,
        config: OverlayConfig,
        admission: Admission,
        counters: Counter[str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._host = host
        self._counters: Counter[str] = counters if counters is not None else Counter()
        # Jitter of the bootstrap retries: joiners that a busy bootstrap turned away together
        # must not come back together.
        self._rng = rng or random.Random()
        self._dht = dht
        self._config = config
        self._admission = admission
        self.bootstrap_infos: list[PeerInfo] = []
        self.last_dial: dict[str, float] = {}  # peer id -> trio time of our last dial
        self._bootstrap_failures: dict[str, int] = {}  # bootstrap peer id -> failed dials

    def bootstrap_ids(self) -> set[str]:
        """The bootstrap peers' ids (the connection manager never trims them)."""
        return {i.peer_id.to_base58() for i in self.bootstrap_infos}

    async def dial(self, info: PeerInfo, *, background: float = 1.0) -> None:
        """Connect to `info` within `background` x `connect_timeout`. Discovery dials take
        `BACKGROUND_TIMEOUT_FACTOR`, bootstrap retries grow towards `BOOTSTRAP_TIMEOUT_FACTOR`:
        64 nodes joining on 2 cores took more than `connect_timeout` per handshake, and cutting
        them short threw the work of both sides away and made every retry slower still (measured: ~900 handshakes
        torn down, a median of 15 of 63 peers connected after 200 s)."""
        pid = info.peer_id.to_base58()
        self.last_dial[pid] = trio.current_time()
        if pid in self._admission.refused:
            raise PeerUnreachable(f"peer {pid} was refused: {self._admission.refused[pid]}")
        busy = self._admission.busy_left(pid)
        if busy > 0:
            raise PeerBusy(f"peer {pid} answered busy; it may be dialed again in {busy:.1f} s")
        limit = self._config.connect_timeout * background
        try:
            with trio.fail_after(limit):
                await self._host.connect(info)
        except trio.TooSlowError:
            raise PeerUnreachable(
                f"dialing {info.peer_id} at {[str(a) for a in info.addrs]} timed out "
                f"after {limit:.1f}s"
            ) from None
        except Exception as exc:
            raise PeerUnreachable(
                f"dialing {info.peer_id} at {[str(a) for a in info.addrs]} failed: {exc}"
            ) from None
        # DHT tables take server-mode peers only; ours all are, and identify may lag.
        await self._dht.kad.routing_table.add_peer(info)

    async def _connect_bootstrap(self, info: PeerInfo) -> bool:
        delay = self._config.bootstrap_backoff
        last = ""
        pid = info.peer_id.to_base58()
        for attempt in range(1, self._config.bootstrap_attempts + 1):
            # Like TCP's SYN retries: a busy bootstrap gets longer, an absent one fails soon.
            # The count goes on across rounds (discovery retries an isolated node's bootstrap
            # every few seconds): restarting at one `connect_timeout` each round, a starved
            # bootstrap's handshakes (slower than that) were abandoned round after round, and
            # 17 of 64 joiners never got in (measured: 64 processes on 2 cores).
            tried = self._bootstrap_failures.get(pid, 0)
            factor = min(2.0**tried, BOOTSTRAP_TIMEOUT_FACTOR)
            # libp2p refuses for 60 s to dial a peer whose addresses all failed once (its
            # "negative cache"): a bootstrap too busy to finish one handshake in time then
            # got no second try, and a starved joiner stayed alone for minutes (measured:
            # 64 processes on 2 cores). These retries have their own backoff.
            unblock = getattr(self._host.get_network(), "unblock_peer", None)
            if unblock is not None:
                unblock(info.peer_id)
            try:
                await self.dial(info, background=factor)
                self._bootstrap_failures.pop(pid, None)
                return True
            except PeerBusy:
                # It said when to come back: discovery dials it then, and meanwhile the
                # peers it named (no backoff of ours on top of its own estimate).
                return False
            except PeerUnreachable as exc:
                self._bootstrap_failures[pid] = tried + 1
                last = str(exc)
                logger.debug("bootstrap attempt %d failed: %s", attempt, exc)
            if attempt < self._config.bootstrap_attempts:
                self._counters["bootstrap_retries"] += 1
                await trio.sleep(jittered(delay, self._rng))
                delay *= 2
        logger.warning(
            "bootstrap peer unreachable after %d attempts: %s",
            self._config.bootstrap_attempts,
            last,
        )
        return False

    async def bootstrap(self) -> None:
        """Dial every bootstrap peer at once, each with backoff (see the module contract)."""
        reached: list[bool] = []

        async def one(info: PeerInfo) -> None:
            reached.append(await self._connect_bootstrap(info))

        async with trio.open_nursery() as nursery:
            for info in self.bootstrap_infos:
                nursery.start_soon(one, info)
        if any(reached):
            await self._require_same_network()
        if self.bootstrap_infos and not any(reached) and self.bootstrap_busy_s() > 0:
            logger.info(
                "the bootstrap peers are busy; dialing them again in %.1f s, and meanwhile "
                "the peers they named",
                self.bootstrap_busy_s(),
            )
        elif self.bootstrap_infos and not any(reached):
            message = (
                f"none of the {len(self.bootstrap_infos)} bootstrap peers answered; "
                "check the addresses and that those nodes are running"
            )
            if self._config.require_bootstrap:
                raise BootstrapFailed(message)
            logger.warning("%s (will keep retrying)", message)

    def bootstrap_busy_s(self) -> float:
        """0 when a bootstrap peer may be dialed now; else seconds until the first of them,
        all of which answered busy, may be."""
        left = [self._admission.busy_left(i.peer_id.to_base58()) for i in self.bootstrap_infos]
        return min(left, default=0.0)

    async def _require_same_network(self) -> None:
        """Wait for the hello of each bootstrap peer we reached; when all of them are of
        another network or version, this node is joining the wrong overlay: say so."""
        with trio.move_on_after(2 * self._config.connect_timeout):
            await self._admission.wait_hellos(i.peer_id.to_base58() for i in self.bootstrap_infos)
        reached = [i.peer_id.to_base58() for i in self.bootstrap_infos]
        refused = [pid for pid in reached if pid in self._admission.refused]
        connected = {p.to_base58() for p in self._host.get_connected_peers()}
        if refused and not any(pid in connected for pid in reached if pid not in refused):
            pid = refused[0]
            why = self._admission.refused[pid]
            if why.startswith(REFUSED_US):
                raise NotAMember(
                    f"bootstrap peer {pid} refused this node: {why[len(REFUSED_US) :]}; "
                    "join with an invite of that network (`p2pnode invite` on its bootstrap)"
                )
            raise NetworkMismatch(
                f"bootstrap peer {pid} refused: {self._admission.refused[pid]}; use an invite or "
                "--bootstrap of this node's network, or set --network to match"
            )


def jittered(delay: float, rng: random.Random) -> float:
    """``delay`` spread over [0.5, 1.5) of itself (full jitter would retry at once half the
    time; none makes a storm's joiners retry in step)."""
    return delay * (0.5 + rng.random())


def filtered_connect(host: IHost) -> Callable[[PeerInfo], Awaitable[None]]:
    """``host.connect`` that never dials an unspecified or own address (overlay/net/addrs.py)
    and tries a peer's likely path first; circuits are left to the relay fallback."""
    connect = host.connect

    async def filtered(info: PeerInfo) -> None:
        if info.peer_id in host.get_connected_peers():
            return
        addrs = list(info.addrs)
        with suppress(Exception):  # PeerStoreError: no stored address
            addrs += list(host.get_peerstore().addrs(info.peer_id))
        own = [str(a) for a in host.get_transport_addrs()] + [str(a) for a in host.get_addrs()]
        usable = dial_order(addrs, own)
        if not usable:
            raise PeerUnreachable(
                f"no dialable address for {info.peer_id} among {[str(a) for a in addrs]}"
            )
        # The peerstore holds what identify said; a bad entry must not be retried as-is.
        await connect(PeerInfo(info.peer_id, usable))

    return filtered


def filter_peerstore(host: IHost) -> None:
    """The swarm dials the peerstore's addresses directly when a stream is opened to a peer
    not connected yet (DHT queries do), so unusable addresses never enter it: unspecified
    ones, and our own (a NAT'd node's twin behind another router has the same private
    address; dialing it reaches ourselves). Filtered on write, with string tests only: the
    DHT writes addresses for every peer of every answer (a full parse per address there
    doubled the join time of 8 nodes on 2 busy cores)."""
    store = host.get_peerstore()
    add_addrs = store.add_addrs
    own: dict[str, Any] = {"at": -math.inf, "set": frozenset()}

    def own_endpoints() -> frozenset[str]:
        now = time.monotonic()
        if now - own["at"] > OWN_ADDRS_REFRESH_S:
            bound = [str(a) for a in host.get_transport_addrs()]
            bound += [str(a) for a in host.get_addrs()]
            own["set"] = frozenset(a.split("/p2p/")[0] for a in bound)
            own["at"] = now
        return own["set"]

    def filtered(peer_id: ID, addrs: Sequence[Multiaddr], ttl: int = 0) -> None:
        if peer_id != host.get_id():
            mine = own_endpoints()
            keep = []
            for addr in addrs:
                text = str(addr)
                if text.startswith(_UNSPECIFIED) or text.split("/p2p/")[0] in mine:
                    continue
                keep.append(addr)
            addrs = keep
        add_addrs(peer_id, addrs, ttl)

    store.add_addrs = filtered  # type: ignore[method-assign]


_UNSPECIFIED = ("/ip4/0.0.0.0/", "/ip6/::/")
OWN_ADDRS_REFRESH_S = 5.0
