"""Revocations travel to every member: a gossipsub topic of the network, fed by the admin's
``p2pnode revoke`` through its home's inbox.

Why gossip and also hellos: gossip reaches the members connected now within a heartbeat or
two; a member that was away, or a gossip message lost (gossipsub drops under load: see the
libp2p notes), learns them from the next hello or redemption (``admission.py``,
``redemption.py``). Each revocation is republished ``REPUBLISH`` times, ``REPUBLISH_EVERY_S``
apart, since one lost message must not leave a member trusting a revoked peer.

Contract: ``Revocations(members, pubsub, home)``; ``revocation_topic(network_id)``;
``run()`` subscribes (a topic validator drops anything that does not verify, so junk is not
forwarded), applies what arrives (``Members.learn``), and polls the home's inbox
(``MemberHome.take_posted``) every ``INBOX_POLL_S``: what is posted there is applied here
and published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from p2pnode.identity.memberhome import MemberHome
from p2pnode.identity.membership import MAX_CREDENTIAL_SIZE, MembershipError, parse_revocation
from p2pnode.overlay.net.members import Members
from p2pnode.overlay.seams import PubSub

__all__ = ["INBOX_POLL_S", "Revocations", "revocation_topic"]

logger = logging.getLogger(__name__)

INBOX_POLL_S = 0.5
REPUBLISH = 3
REPUBLISH_EVERY_S = 2.0


def revocation_topic(network_id: str) -> str:
    return f"/p2pnode/{network_id}/revocations/1"


class _ValidatingPubSub(PubSub, Protocol):
    """The gossipsub calls this module makes, plus the topic validator."""

    def set_topic_validator(
        self, topic: str, validator: Callable[[ID, rpc_pb2.Message], bool], is_async: bool, /
    ) -> None: ...


class Revocations:
    """Gossip of revocations for one node (module contract)."""

    def __init__(self, members: Members, pubsub: _ValidatingPubSub, home: Path | None) -> None:
        assert members.config is not None
        self._members = members
        self._pubsub = pubsub
        self._home = MemberHome(home) if home is not None else None
        self.topic = revocation_topic(members.config.network_id)

    def _valid(self, _forwarder: ID, msg: rpc_pb2.Message) -> bool:
        if len(msg.data) > MAX_CREDENTIAL_SIZE:
            return False
        try:
            parse_revocation(bytes(msg.data))
        except MembershipError:
            return False
        return True

    async def run(self) -> None:
        self._pubsub.set_topic_validator(self.topic, self._valid, False)
        sub = await self._pubsub.subscribe(self.topic)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._poll_inbox, nursery)
            while True:
                msg = await sub.get()
                self._members.learn(bytes(msg.data))

    async def _publish_repeatedly(self, raw: bytes) -> None:
        for i in range(REPUBLISH):
            try:
                await self._pubsub.publish(self.topic, raw)
            except Exception as exc:
                logger.info("publishing a revocation failed: %r", exc)
            if i + 1 < REPUBLISH:
                await trio.sleep(REPUBLISH_EVERY_S)

    async def _poll_inbox(self, nursery: trio.Nursery) -> None:
        if self._home is None:
            return
        while True:
            for raw in self._home.take_posted():
                try:
                    rev = parse_revocation(raw)
                except MembershipError as exc:
                    logger.warning("dropped a posted revocation: %s", exc)
                    continue
                if self._members.learn(raw) is None and rev.peer not in self._members.revoked:
                    logger.warning(
                        "dropped a posted revocation of %s: it does not verify", rev.peer
                    )
                    continue
                logger.info("revoking %s: applied here, gossiping it", rev.peer)
                nursery.start_soon(self._publish_repeatedly, raw)
            await trio.sleep(INBOX_POLL_S)
