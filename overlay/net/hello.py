"""Which network and protocol version a peer speaks: one frame each way per new connection.

Nodes of two overlays (another network id, say a private test swarm, or an incompatible
protocol version) can meet: a stale address, a shared relay, a DHT crawl. Without a check
they would gossip records, digests and forwards to each other. So the side that dialed a
new connection opens ``HELLO_PROTOCOL``, sends its ``Hello`` and reads the other's; both
sides compare with ``mismatch`` and, on a difference, log it once, close the connection and
never dial that peer again in this run. A join whose every bootstrap peer is of another
network fails with ``NetworkMismatch``, whose message names both networks.

Contract:
- ``Hello(network, version)``: network ids are 1-64 chars of ``[a-z0-9._-]``.
- ``mismatch(ours, theirs) -> str | None``: what differs, in words, or None.
- ``say_hello(open_stream, ours) -> Hello`` (dialer); ``answer_hello(stream, ours, answer)
  -> Hello`` (listener: reads theirs, sends ``answer(theirs)`` back; ``WireError`` on a
  malformed frame).
- Referrals: the listener's answer may carry ``peers``, up to ``MAX_REFERRALS`` addresses
  (``/.../p2p/<id>``) of peers it is connected to. A joiner's first connection is to a
  bootstrap, the busiest node of a growing swarm: the answer it waits for anyway names peers
  to dial, where a DHT lookup would be another negotiated stream to that busy node (measured:
  64 node processes on 2 cores, a quarter of the joiners never got one answered). Addresses
  are hints, not trust: the dial's secure handshake proves who answers. In a join storm no
  joiner's signed record has spread yet, so the dialer's hello names its own listen
  addresses (``addrs``); the listener may name an admitted dialer to later joiners by them
  (``admission.py`` keeps only those on the IP the connection came from, with the dialer's
  own id).
- Busy (``patches/busy.py``): a listener over its admission bound answers with
  ``retry_after_s`` (and referrals) instead of admitting the dialer; the dialer closes the
  connection, dials nobody there for that long (jittered) and meanwhile tries the peers named
  (``admission.py``, ``dialing.py``, ``discovery.py``).
- Digests: once both sides have judged each other, each sends one more frame,
  ``HelloDigests``: its sealed cache digests, up to ``MAX_HELLO_DIGESTS`` of
  ``MAX_HELLO_DIGEST_BYTES`` each (``exchange_digests``). A new link then holds the peer's
  cache view when its hello is done, where a pull is one more negotiated stream, and on busy
  cores most of those timed out (64 node processes on 2 cores: 204 of 255 pulls of a new
  peer's view). Larger digests are pulled as before. The frames follow the verdicts, so a
  peer that is refused, or answers busy, sees none of ours; a peer of an older release
  closes the stream after the answer and the exchange ends there.
- Closed networks (``members.py``): each hello also carries the sender's signed ``member``ship
  (None in an open network) and up to ``MAX_HELLO_REVOCATIONS`` of the newest revocations it
  knows, so a late joiner learns them from its first peer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from p2pnode.overlay._errors import OverlayError
from p2pnode.overlay.wire import bounded_field, from_wire, message, read_frame, to_wire, write_frame

if TYPE_CHECKING:
    from p2pnode.overlay.seams import Stream

__all__ = [
    "DEFAULT_NETWORK",
    "HELLO_PROTOCOL",
    "MAX_HELLO_DIGESTS",
    "MAX_HELLO_DIGEST_BYTES",
    "MAX_HELLO_REVOCATIONS",
    "Hello",
    "HelloDigests",
    "NetworkMismatch",
    "NotAMember",
    "answer_hello",
    "check_network_id",
    "exchange_digests",
    "mismatch",
    "say_hello",
]

logger = logging.getLogger(__name__)

HELLO_PROTOCOL = "/p2pnode/hello/1"
DEFAULT_NETWORK = "main"
MAX_CREDENTIAL = 2048
MAX_HELLO_REVOCATIONS = 16
HELLO_LIMIT = 1024 + MAX_CREDENTIAL + MAX_HELLO_REVOCATIONS * (MAX_CREDENTIAL + 8)
MAX_REFERRALS = 8
MAX_REFERRAL_LEN = 256
MAX_OWN_ADDRS = 4
# An answer with referrals: MAX_REFERRALS addresses of MAX_REFERRAL_LEN characters at most.
HELLO_ANSWER_LIMIT = HELLO_LIMIT + MAX_REFERRALS * (MAX_REFERRAL_LEN + 8)
HELLO_TIMEOUT_S = 10.0
MAX_HELLO_DIGESTS = 2
MAX_HELLO_DIGEST_BYTES = 16 * 1024
HELLO_DIGESTS_LIMIT = 256 + MAX_HELLO_DIGESTS * (MAX_HELLO_DIGEST_BYTES + 8)
# A busy answer's retry-after, at most (a longer one from a peer is refused as malformed).
MAX_RETRY_AFTER_S = 300.0
_NETWORK_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


class NetworkMismatch(OverlayError):
    """A peer belongs to another network or speaks another protocol version."""

    reason = "network_mismatch"


class NotAMember(NetworkMismatch):
    """A closed network's peer refused this node: no valid membership of it."""

    reason = "not_a_member"


def check_network_id(network: str) -> str:
    """``network`` if it is a valid network id; ``ValueError`` saying what is allowed."""
    if not isinstance(network, str) or not _NETWORK_RE.fullmatch(network):
        raise ValueError(
            f"network id {network!r}: use 1-64 characters of a-z, 0-9, '.', '_' or '-' "
            "(starting with a letter or digit)"
        )
    return network


@message("hello")
class Hello:
    network: str = bounded_field(max_len=64)
    version: str = bounded_field(max_len=64)
    peers: tuple[str, ...] = bounded_field(
        default=(), max_len=MAX_REFERRALS, item_max_len=MAX_REFERRAL_LEN
    )
    member: bytes | None = bounded_field(default=None, max_len=MAX_CREDENTIAL)
    revocations: tuple[bytes, ...] = bounded_field(
        default=(), max_len=MAX_HELLO_REVOCATIONS, item_max_len=MAX_CREDENTIAL
    )
    # In an answer: why the listener refuses the dialer (a closed network's member check).
    refused: str | None = bounded_field(default=None, max_len=256)
    # In the dialer's hello: where it listens (``/.../p2p/<its id>``), so the listener can
    # name it to the next joiners before any signed record of it has spread.
    addrs: tuple[str, ...] = bounded_field(
        default=(), max_len=MAX_OWN_ADDRS, item_max_len=MAX_REFERRAL_LEN
    )
    # In an answer: the listener is over its admission bound; dial it again after this long.
    retry_after_s: float | None = bounded_field(default=None, ge=0.0, le=MAX_RETRY_AFTER_S)


@message("hello-digests")
class HelloDigests:
    digests: tuple[bytes, ...] = bounded_field(
        default=(), max_len=MAX_HELLO_DIGESTS, item_max_len=MAX_HELLO_DIGEST_BYTES
    )


# Fields older releases do not know (their reader refuses unknown fields): sent only when set,
# so an open network's hello reads the same to them.
_CLOSED_FIELDS = ("member", "revocations", "refused", "addrs", "retry_after_s")


def _to_wire(hello: Hello) -> dict[str, object]:
    obj = to_wire(hello)
    for name in _CLOSED_FIELDS:
        if not obj.get(name):
            obj.pop(name, None)
    return obj


def mismatch(ours: Hello, theirs: Hello) -> str | None:
    if theirs.network != ours.network:
        return f"it belongs to network {theirs.network!r}, this node to {ours.network!r}"
    if theirs.version != ours.version:
        return f"it speaks protocol {theirs.version!r}, this node {ours.version!r}"
    return None


async def say_hello(
    open_stream: Callable[[], Awaitable[Stream]],
    ours: Hello,
    then: Callable[[Hello, Stream], Awaitable[None]] | None = None,
) -> Hello:
    """Send ``ours``, read the answer; ``then(answer, stream)`` runs before the stream
    closes (the verdict, then ``exchange_digests``)."""
    stream = await open_stream()
    try:
        with trio.fail_after(HELLO_TIMEOUT_S):
            await write_frame(stream, _to_wire(ours), limit=HELLO_LIMIT)
            obj = await read_frame(stream, limit=HELLO_ANSWER_LIMIT)
        if obj is None:
            raise OverlayError("the peer closed the hello stream without answering")
        theirs = from_wire(obj, Hello)
        if then is not None:
            await then(theirs, stream)
        return theirs
    finally:
        with trio.move_on_after(1):
            await stream.close()


async def exchange_digests(stream: Stream, ours: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """Send our digests and read the peer's (module contract); () when it sends none in
    time, closes the stream, or sends a malformed frame: the pull of its view repairs it."""
    with trio.move_on_after(HELLO_TIMEOUT_S):
        try:
            fit = tuple(d for d in ours if len(d) <= MAX_HELLO_DIGEST_BYTES)
            frame = to_wire(HelloDigests(fit[:MAX_HELLO_DIGESTS]))
            await write_frame(stream, frame, limit=HELLO_DIGESTS_LIMIT)
            obj = await read_frame(stream, limit=HELLO_DIGESTS_LIMIT)
            if obj is not None:
                return from_wire(obj, HelloDigests).digests
        except Exception as exc:  # an older release closed the stream; a reset; garbage
            logger.debug("no hello digests: %r", exc)
    return ()


async def answer_hello(
    stream: Stream, ours: Hello, answer: Callable[[Hello], Hello] | None = None
) -> Hello:
    """Read the dialer's hello and answer with ``answer(theirs)`` (``ours`` with referrals
    and revocations filled in, once the caller has judged the dialer); returns theirs."""
    with trio.fail_after(HELLO_TIMEOUT_S):
        obj = await read_frame(stream, limit=HELLO_LIMIT)
        if obj is None:
            raise OverlayError("the peer closed the hello stream before its hello")
        theirs = from_wire(obj, Hello)
        reply = answer(theirs) if answer is not None else ours
        reply = dataclasses.replace(reply, peers=reply.peers[:MAX_REFERRALS])
        await write_frame(stream, _to_wire(reply), limit=HELLO_ANSWER_LIMIT)
    return theirs
