"""Which connected peers a node keeps talking to: the hello exchange on each new connection.

Why a module: ``hello.py`` is the exchange itself (one frame each way); this is what a node
does with its verdict, and the dialer (``dialing.py``) and discovery (``discovery.py``) read
the refusals it keeps.

Contract:
- ``Admission(host, peers, hello, spawn)``; ``spawn(fn, *args) -> bool`` starts a background
  task in the node's connection nursery (False while the node is not running).
- ``admit(conn) -> bool`` on every new connection: False for a peer refused before (its
  connection is closed); on a connection we dialed, starts the dialer side of the hello.
  ``serve_hello`` is the listener side (the node serves it on ``HELLO_PROTOCOL``).
- A mismatch (another network id or version) logs once, marks the peer down and closes its
  connection; ``refused`` (peer id -> why) keeps it out for the rest of the run.
- Referrals (``hello.py``): ``use_referrals(give, take, own)``: our hello answers name
  ``referrals(asker_pid)`` as peers to dial: ``give(asker_pid)`` topped up to
  ``REFERRAL_PEERS`` with ``introduced`` dialers (admitted peers still connected and up,
  named by the listen addresses their own hello gave, kept only on the IP their connection
  came from): in a join storm no joiner's signed record has spread when the next one arrives,
  and a bootstrap that named no one left every joiner with it as its only way in. The peers
  named in an answer we got go to ``take(addrs)``; our own hellos name ``own()``.
- Busy (``patches/busy.py``): ``use_load(retry_after)``: while ``retry_after()`` gives
  seconds, our answer to a dialer that passes the checks is "busy, retry after N s" with
  referrals, not an admission (``counters["busy_answered"]``); the dialer closes the
  connection. A busy answer we get (``counters["busy_answers"]``) closes the connection and
  keeps that peer in ``busy_until`` (trio time: now + 1-1.5x the retry-after, jittered so a
  storm's joiners do not come back together); ``busy_left(pid)`` says how long is left, and the
  dialer does not dial it before (``dialing.py``), while discovery dials the peers named.
- Digests (``hello.py``): ``use_digests(give, take)``: once a peer passed the checks (and
  did not answer busy), each side sends ``give()`` (its sealed cache digests) on the hello
  stream and hands the peer's to ``take(peer_id, digests)``, after the verdict is settled.
- ``wait_hellos(peer_ids)`` waits for the hello of those peers still under way (the
  bootstrap's check that it joined the right overlay).
- Closed networks (``members.py``, ``patches/gate.py``): hellos carry our membership and
  revocations; a peer whose membership does not verify is refused like a mismatch (and told
  why in the answer's ``refused``, so a joiner refused for lack of membership says so); a
  peer refusing us is kept in ``refused`` too. A connection whose peer sent no hello within
  ``VERDICT_TIMEOUT_S``, or whose hello failed, is closed (not refused: it may come back with
  one). A revoked peer is refused and its connection closed (``Members.on_revoked``), and so
  is a member whose membership expires while connected (``refuse_expired``, each second).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import TYPE_CHECKING

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2pnode.overlay.net.hello import (
    HELLO_PROTOCOL,
    MAX_HELLO_REVOCATIONS,
    MAX_OWN_ADDRS,
    MAX_REFERRAL_LEN,
    Hello,
    answer_hello,
    exchange_digests,
    mismatch,
    say_hello,
)
from p2pnode.overlay.net.members import Members
from p2pnode.overlay.peers import PeerTable

if TYPE_CHECKING:
    from p2pnode.overlay.seams import Stream

__all__ = ["Admission", "Spawn"]

logger = logging.getLogger(__name__)

# Starts `fn(*args)` in the background; False when there is no nursery to start it in.
Spawn = Callable[..., bool]
MAX_REFUSAL_LEN = 256
# Peers named in one hello answer (discovery's record holders first, then introduced dialers).
REFERRAL_PEERS = 4
# Admitted dialers whose own addresses we keep to name to later joiners.
MAX_INTRODUCED = 1024
# How a refusal by the other side starts in ``refused`` (dialing.py words the join's error).
REFUSED_US = "it refused this node: "


class Admission:
    """The hello verdicts of one node (see the module contract)."""

    def __init__(
        self,
        host: IHost,
        peers: PeerTable,
        hello: Hello,
        spawn: Spawn,
        members: Members | None = None,
        counters: Counter[str] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._host = host
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self._peers = peers
        self.hello = hello
        self._spawn = spawn
        self.members = members if members is not None else Members(None, "")
        self.members.on_revoked.append(lambda pid: self._refuse(ID.from_base58(pid), "revoked"))
        self.refused: dict[str, str] = {}  # peer id -> why (another network or version)
        self._hello_done: dict[str, trio.Event] = {}
        self._give: Callable[[str], tuple[str, ...]] = lambda _asker: ()
        self._take: Callable[[tuple[str, ...]], None] = lambda _addrs: None
        self._own: Callable[[], Iterable[str]] = tuple
        # Admitted dialers' own listen addresses (peer id -> addrs), newest last; bounded.
        self.introduced: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._rng = rng or random.Random()
        self._retry_after: Callable[[], float | None] = lambda: None
        self.busy_until: dict[str, float] = {}  # peer id -> trio time it may be dialed again
        self._digests: Callable[[], tuple[bytes, ...]] = tuple
        self._take_digests: Callable[[str, tuple[bytes, ...]], None] = lambda _pid, _d: None

    def use_load(self, retry_after: Callable[[], float | None]) -> None:
        """Answer busy while ``retry_after()`` gives seconds (``patches/busy.py``)."""
        self._retry_after = retry_after

    def use_digests(
        self,
        give: Callable[[], tuple[bytes, ...]],
        take: Callable[[str, tuple[bytes, ...]], None],
    ) -> None:
        """Swap ``give()`` for a checked peer's digests, handed to ``take`` (module doc)."""
        self._digests = give
        self._take_digests = take

    async def _swap_digests(self, pid: str, stream: Stream) -> None:
        digests = await exchange_digests(stream, self._digests())
        if digests:
            self._take_digests(pid, digests)

    def busy_left(self, pid: str) -> float:
        """Seconds until a peer that answered busy may be dialed again (0: now)."""
        until = self.busy_until.get(pid)
        if until is None:
            return 0.0
        left = until - trio.current_time()
        if left <= 0:
            del self.busy_until[pid]
            return 0.0
        return left

    def use_referrals(
        self,
        give: Callable[[str], tuple[str, ...]],
        take: Callable[[tuple[str, ...]], None],
        own: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        """Name peers in our hello answers, pass on those named in answers we get, and name
        ``own()`` (our listen addresses) in the hellos we send."""
        self._give = give
        self._take = take
        self._own = own

    def referrals(self, asker: str) -> tuple[str, ...]:
        """``give(asker)``, topped up to ``REFERRAL_PEERS`` peers with admitted dialers we
        are still connected to, named by the addresses their hello gave (at random, so a
        storm's joiners spread over each other rather than all over the first few)."""
        named = list(self._give(asker))
        have = {a.rsplit("/p2p/", 1)[-1] for a in named}
        if len(have) >= REFERRAL_PEERS:
            return tuple(named)
        connected = {p.to_base58() for p in self._host.get_connected_peers()}
        pool = [
            pid
            for pid in self.introduced
            if pid != asker and pid not in have and pid in connected and self._peers.is_up(pid)
        ]
        for pid in self._rng.sample(pool, min(REFERRAL_PEERS - len(have), len(pool))):
            named.extend(self.introduced[pid][:2])
        return tuple(named)

    def _introduce(self, pid: str, addrs: tuple[str, ...], observed_ip: str | None) -> None:
        """Keep an admitted dialer's own addresses: only those on the IP its connection came
        from (a NAT'd dialer's private address reaches no one else) and naming its own id."""
        keep = tuple(
            a
            for a in addrs
            if observed_ip is not None
            and a.startswith((f"/ip4/{observed_ip}/", f"/ip6/{observed_ip}/"))
            and a.endswith(f"/p2p/{pid}")
            and "/p2p-circuit" not in a
        )
        if not keep:
            return
        self.introduced[pid] = keep
        self.introduced.move_to_end(pid)
        while len(self.introduced) > MAX_INTRODUCED:
            self.introduced.popitem(last=False)

    def admit(self, conn: INetConn) -> bool:
        """False for a refused peer (closed again); starts our hello on a connection we dialed."""
        peer = conn.muxed_conn.peer_id
        pid = peer.to_base58()
        if pid in self.refused:
            self._spawn(self._drop, peer)
            return False
        if _is_initiator(conn):
            if self._spawn(self._check_network, peer):
                self._hello_done[pid] = trio.Event()
        elif self.members.closed:
            self._spawn(self._expect_hello, peer)
        return True

    async def wait_hellos(self, peer_ids: Iterable[str]) -> None:
        """Wait for the hellos still under way with these peers (no limit: the caller sets one)."""
        for pid in peer_ids:
            event = self._hello_done.get(pid)
            if event is not None:
                await event.wait()

    async def serve_hello(self, stream: INetStream) -> None:
        """Listener side of the hello: judge theirs, answer, refuse the peer on a verdict."""
        peer = stream.muxed_conn.peer_id
        pid = peer.to_base58()
        verdict: list[str | None] = []
        busy: list[float] = []

        def answer(theirs: Hello) -> Hello:
            reason = self._judge(pid, theirs)
            verdict.append(reason)
            if reason is not None:
                # A refused peer learns why and nothing else: no membership, revocations or
                # referrals of ours.
                return dataclasses.replace(self.hello, refused=reason[:MAX_REFUSAL_LEN])
            retry_after = self._retry_after()
            if retry_after is not None:
                busy.append(retry_after)
                return dataclasses.replace(
                    self._ours(), peers=self.referrals(pid), retry_after_s=retry_after
                )
            return dataclasses.replace(self._ours(), peers=self.referrals(pid))

        theirs = None
        try:
            theirs = await answer_hello(stream, self._ours(), answer)
        finally:
            if verdict and verdict[0] is not None:
                self._refuse(peer, verdict[0])
            elif busy:
                self.counters["busy_answered"] += 1
            elif verdict:
                self.counters["admitted"] += 1
                if theirs is not None and theirs.addrs:
                    self._introduce(pid, theirs.addrs, _observed_ip(stream))
            self.members.settle(pid)
        if verdict == [None] and not busy:
            await self._swap_digests(pid, stream)

    def _ours(self) -> Hello:
        closed = self.members.config
        if closed is None:
            return self.hello
        return dataclasses.replace(
            self.hello,
            member=closed.membership,
            revocations=self.members.revocation_raws(MAX_HELLO_REVOCATIONS),
        )

    def _judge(self, pid: str, theirs: Hello) -> str | None:
        """Why we refuse the peer that sent ``theirs``, or None."""
        reason = mismatch(self.hello, theirs)
        if reason is not None or not self.members.closed:
            return reason
        self.members.learn_all(theirs.revocations)
        return self.members.check(pid, theirs.member)

    def refuse_expired(self) -> None:
        """Refuse (and disconnect) the members whose membership has run out."""
        for pid in self.members.expired():
            self._refuse(ID.from_base58(pid), "its membership has expired")

    async def _expect_hello(self, peer: ID) -> None:
        """Closed network, a connection we did not dial: no hello with a membership in time
        closes it."""
        pid = peer.to_base58()
        if await self.members.wait_verdict(pid) or pid in self.refused:
            return
        logger.info("closing the connection of %s: no hello with a membership in time", pid)
        await self._drop(peer)

    async def _drop(self, peer: ID) -> None:
        with trio.move_on_after(2):
            with suppress(Exception):
                await self._host.disconnect(peer)

    def _refuse(self, peer: ID, reason: str, *, quiet: bool = False) -> None:
        pid = peer.to_base58()
        self.members.deny(pid)
        if pid not in self.refused and not quiet:
            logger.warning("refusing peer %s: %s", pid, reason)
        self.refused[pid] = reason
        self._peers.mark_down(pid, f"refused: {reason}")
        self._spawn(self._drop, peer)

    def _busy(self, peer: ID, retry_after_s: float) -> None:
        """The peer answered busy: leave it for the retry-after, jittered (module contract)."""
        pid = peer.to_base58()
        # At least what it asked, up to half again: a storm's joiners told the same come back
        # spread out, not together.
        wait = retry_after_s * (1.0 + 0.5 * self._rng.random())
        self.busy_until[pid] = trio.current_time() + wait
        self.counters["busy_answers"] += 1
        logger.info("peer %s is busy: retrying it in %.1f s", pid, wait)
        self._spawn(self._drop, peer)

    async def _check_network(self, peer: ID) -> None:
        """Dialer side of the hello exchange (overlay/net/hello.py) on a new connection."""
        pid = peer.to_base58()
        done = self._hello_done.get(pid)
        if done is None:
            done = self._hello_done[pid] = trio.Event()
        try:
            own = tuple(a for a in self._own() if len(a) <= MAX_REFERRAL_LEN)
            ours = dataclasses.replace(self._ours(), addrs=own[:MAX_OWN_ADDRS])
            await say_hello(
                lambda: self._host.new_stream(peer, [TProtocol(HELLO_PROTOCOL)]),
                ours,
                functools.partial(self._on_answer, peer),
            )
        except (Exception, trio.TooSlowError) as exc:
            # An old or busy peer: the other checks (records, limits) still apply; in a closed
            # network nothing else runs without a verdict, so its connection goes.
            logger.debug("no hello from %s: %r", pid, exc)
            if self.members.closed and not self.members.admitted(pid):
                self._spawn(self._drop, peer)
        finally:
            self.members.settle(pid)
            done.set()
            self._hello_done.pop(pid, None)

    async def _on_answer(self, peer: ID, theirs: Hello, stream: Stream) -> None:
        """Dialer side: judge the answer and settle the verdict, then swap digests."""
        pid = peer.to_base58()
        admitted = False
        try:
            if theirs.refused and mismatch(self.hello, theirs) is None:
                reason = REFUSED_US + theirs.refused
                logger.error("peer %s refused this node: %s", pid, theirs.refused)
                self._refuse(peer, reason, quiet=True)
            elif (reason := self._judge(pid, theirs)) is not None:
                self._refuse(peer, reason)
            else:
                if theirs.retry_after_s is not None:
                    self._busy(peer, theirs.retry_after_s)
                else:
                    admitted = True
                if theirs.peers:
                    self._take(theirs.peers)
        finally:
            # Settled before the digests travel: a closed network's other protocols wait
            # for this verdict, not for one more round trip.
            self.members.settle(pid)
            done = self._hello_done.pop(pid, None)
            if done is not None:
                done.set()
        if admitted:
            await self._swap_digests(pid, stream)


def _observed_ip(stream: INetStream) -> str | None:
    """The IP the stream's connection came from (libp2p's NetStream has it; the abc not)."""
    try:
        remote = stream.get_remote_address()  # type: ignore[attr-defined]
    except Exception:
        return None
    return str(remote[0]) if remote else None


def _is_initiator(conn: INetConn) -> bool:
    """Did we dial this connection? (yamux keeps it; the secured session too)."""
    muxed = conn.muxed_conn
    value: object = getattr(muxed, "is_initiator_value", None)
    if value is None:
        value = getattr(getattr(muxed, "secured_conn", None), "is_initiator", False)
    return bool(value)
