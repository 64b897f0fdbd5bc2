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
- Referrals (``hello.py``): ``use_referrals(give, take)``: our hello answers name
  ``give(asker_pid)`` as peers to dial; the peers named in an answer we got go to
  ``take(addrs)``.
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
import logging
from collections.abc import Callable, Iterable
from contextlib import suppress

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from p2pnode.overlay.net.hello import (
    HELLO_PROTOCOL,
    MAX_HELLO_REVOCATIONS,
    Hello,
    answer_hello,
    mismatch,
    say_hello,
)
from p2pnode.overlay.net.members import Members
from p2pnode.overlay.peers import PeerTable

__all__ = ["Admission", "Spawn"]

logger = logging.getLogger(__name__)

# Starts `fn(*args)` in the background; False when there is no nursery to start it in.
Spawn = Callable[..., bool]
MAX_REFUSAL_LEN = 256
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
    ) -> None:
        self._host = host
        self._peers = peers
        self.hello = hello
        self._spawn = spawn
        self.members = members if members is not None else Members(None, "")
        self.members.on_revoked.append(lambda pid: self._refuse(ID.from_base58(pid), "revoked"))
        self.refused: dict[str, str] = {}  # peer id -> why (another network or version)
        self._hello_done: dict[str, trio.Event] = {}
        self._give: Callable[[str], tuple[str, ...]] = lambda _asker: ()
        self._take: Callable[[tuple[str, ...]], None] = lambda _addrs: None

    def use_referrals(
        self,
        give: Callable[[str], tuple[str, ...]],
        take: Callable[[tuple[str, ...]], None],
    ) -> None:
        """Name peers in our hello answers, and pass on those named in answers we get."""
        self._give = give
        self._take = take

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

        def answer(theirs: Hello) -> Hello:
            reason = self._judge(pid, theirs)
            verdict.append(reason)
            if reason is not None:
                # A refused peer learns why and nothing else: no membership, revocations or
                # referrals of ours.
                return dataclasses.replace(self.hello, refused=reason[:MAX_REFUSAL_LEN])
            return dataclasses.replace(self._ours(), peers=self._give(pid))

        try:
            await answer_hello(stream, self._ours(), answer)
        finally:
            if verdict and verdict[0] is not None:
                self._refuse(peer, verdict[0])
            self.members.settle(pid)

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

    async def _check_network(self, peer: ID) -> None:
        """Dialer side of the hello exchange (overlay/net/hello.py) on a new connection."""
        pid = peer.to_base58()
        done = self._hello_done.get(pid)
        if done is None:
            done = self._hello_done[pid] = trio.Event()
        try:
            theirs = await say_hello(
                lambda: self._host.new_stream(peer, [TProtocol(HELLO_PROTOCOL)]), self._ours()
            )
        except (Exception, trio.TooSlowError) as exc:
            # An old or busy peer: the other checks (records, limits) still apply; in a closed
            # network nothing else runs without a verdict, so its connection goes.
            logger.debug("no hello from %s: %r", pid, exc)
            if self.members.closed and not self.members.admitted(pid):
                self._spawn(self._drop, peer)
        else:
            if theirs.refused and mismatch(self.hello, theirs) is None:
                reason = REFUSED_US + theirs.refused
                logger.error("peer %s refused this node: %s", pid, theirs.refused)
                self._refuse(peer, reason, quiet=True)
            else:
                reason = self._judge(pid, theirs)
                if reason is not None:
                    self._refuse(peer, reason)
                elif theirs.peers:
                    self._take(theirs.peers)
        finally:
            self.members.settle(pid)
            done.set()
            self._hello_done.pop(pid, None)


def _is_initiator(conn: INetConn) -> bool:
    """Did we dial this connection? (yamux keeps it; the secured session too)."""
    muxed = conn.muxed_conn
    value: object = getattr(muxed, "is_initiator_value", None)
    if value is None:
        value = getattr(getattr(muxed, "secured_conn", None), "is_initiator", False)
    return bool(value)
