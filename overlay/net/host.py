"""Build the libp2p host of a p2pnode: Ed25519 identity, Noise only, yamux only.

Contract:
- `make_host(key, listen_addrs)` returns an un-started `IHost` whose peer id equals
  `key.peer_id` (checked; `OverlayError` otherwise). Start it with
  `async with host.run(parse_multiaddrs(listen_addrs)): ...`.
- Security: only `/noise` is offered and accepted; a dialer that offers only plaintext
  (py-libp2p's default list includes `/plaintext/2.0.0`) fails the handshake.
- Muxer: only yamux (mplex is 5-10x slower for large frames on these machines).
- One connection per peer (avoids py-libp2p's ~250 ms happy-eyeballs dial delay), at most
  `max_connections` in all (inbound included).
- libp2p's connection health monitor is OFF by default (`health_check_interval=0`): each of
  its checks negotiates a new stream per connection, one connection after the other, and it
  aborts the connection on ONE answer later than `health_ping_timeout`. Measured with 16
  nodes on 2 busy cores: ~100 % of its probes failed (stream opens took 1-10 s there), each
  failure dropped a healthy link and every stream on it. The node's own liveness (`liveness.py`:
  any received frame counts, adaptive probe timeouts) detects dead and hung peers and closes
  their connections. Pass `health_check_interval` > 0 to turn the monitor on anyway.
- A connection's handshake (Noise XX and yamux, with their multistream negotiations: ~5
  round trips) may take `UPGRADE_TIMEOUT_S` each way, not libp2p's 10 s: 128 node processes
  on 2 cores measured a 4.4 s round trip at the bootstrap, so handshakes were cut at 10 s
  before they could finish and the bootstrap's handshake slots (`patches/busy.py`) held
  doomed ones (it admitted 3 joiners in 280 s; with 45 s, 42 in 300 s against 29: there its
  CPU share, 5 % of a core, is the limit).
- Advertised addresses come from `addrs_factory` (`overlay/net/addrs.py`: never an unspecified
  address); without one, libp2p advertises its bound listen addresses as they are.
- `quiet_libp2p_logs()` silences libp2p's WARNING on every clean stream close.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import multiaddr
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from p2pnode.overlay._errors import BadMultiaddr, OverlayError
from p2pnode.overlay.net.patches.tuning import install as install_tuning

if TYPE_CHECKING:
    from p2pnode.identity import NodeKey

__all__ = [
    "UPGRADE_TIMEOUT_S",
    "connection_config",
    "make_host",
    "parse_multiaddr",
    "quiet_libp2p_logs",
]

UPGRADE_TIMEOUT_S = 45.0


def quiet_libp2p_logs(level: int = logging.ERROR) -> None:
    """Raise the `libp2p` logger's level: it logs a WARNING on every clean stream close."""
    logging.getLogger("libp2p").setLevel(level)
    # Every failed dial is logged at ERROR there; our own dialer reports what matters (a
    # peer that stays unreachable) once, with the addresses it tried.
    logging.getLogger("libp2p.transport.tcp.tcp").setLevel(max(level, logging.CRITICAL))
    # A refused protocol ("na": a peer still starting, or one without that service) is an
    # answer the caller handles; libp2p logs a 10-line ERROR for it.
    logging.getLogger("libp2p.host.basic_host").setLevel(max(level, logging.CRITICAL))


def connection_config(
    *,
    dial_timeout: float = 5.0,
    health_ping_timeout: float = 2.0,
    health_check_interval: float = 0.0,
    max_connections: int = 128,
) -> ConnectionConfig:
    """Connection settings used by every p2pnode host (see the module docstring).

    The timeouts must grow with the round trip: a dial is ~5 round trips (TCP, multistream,
    Noise XX, yamux) and a health probe ~3 (it negotiates a new stream each time).
    """
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    monitor = health_check_interval > 0
    return ConnectionConfig(
        max_connections_per_peer=1,
        max_connections=max_connections,
        high_watermark=max_connections,
        # No pruning or redialing by libp2p: the node's connection manager and discovery
        # decide. Watermarks of 0 alone do not stop the auto-connector (_no_auto_connect).
        min_connections=0,
        low_watermark=0,
        enable_health_monitoring=monitor,
        health_initial_delay=health_check_interval if monitor else 60.0,
        health_warmup_window=0.0,
        health_check_interval=health_check_interval if monitor else 60.0,
        ping_timeout=health_ping_timeout,
        abort_connection_on_ping_failure=monitor,
        dial_timeout=dial_timeout,
        inbound_upgrade_timeout=UPGRADE_TIMEOUT_S,
        outbound_upgrade_timeout=UPGRADE_TIMEOUT_S,
    )


def parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    """Parse a multiaddr string; `BadMultiaddr` (with the offending text) when malformed."""
    if not isinstance(addr, str) or not addr.startswith("/"):
        raise BadMultiaddr(f"not a multiaddr (must start with '/'): {addr!r}")
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as exc:  # the multiaddr package raises several unrelated types
        raise BadMultiaddr(f"malformed multiaddr {addr!r}: {exc}") from None


def make_host(
    key: NodeKey,
    listen_addrs: list[str],
    *,
    addrs_factory: Callable[[list[multiaddr.Multiaddr]], list[multiaddr.Multiaddr]] | None = None,
    dial_timeout: float = 5.0,
    health_ping_timeout: float = 2.0,
    health_check_interval: float = 0.0,
    max_connections: int = 128,
) -> IHost:
    """Create (not start) a Noise-only, yamux-only host for `key`."""
    key_pair = create_new_key_pair(key.seed)
    peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
    if peer_id != key.peer_id:
        raise OverlayError(
            f"libp2p derives peer id {peer_id} from this key but NodeKey says {key.peer_id}; "
            "identity and overlay disagree on the peer id encoding"
        )
    install_tuning()  # per-RPC costs of libp2p's pubsub and yamux (overlay/net/patches/tuning.py)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    quiet_libp2p_logs()
    host = new_host(
        key_pair=key_pair,
        sec_opt={TProtocol(NOISE_PROTOCOL_ID): noise},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        listen_addrs=[parse_multiaddr(a) for a in listen_addrs],
        addrs_factory=addrs_factory,
        connection_config=connection_config(
            dial_timeout=dial_timeout,
            health_ping_timeout=health_ping_timeout,
            health_check_interval=health_check_interval,
            max_connections=max_connections,
        ),
    )
    _no_auto_connect(host)
    return host


async def _never_connect() -> None:
    return None


def _no_auto_connect(host: IHost) -> None:
    """Turn off libp2p's auto-connector. With watermarks of 0 it still aims at the midpoint
    of 0 and ``high_watermark`` (= ``max_connections``, 128) and dials every peer in the
    peerstore until 64 are connected: with bounded connections (overlay/net/connmgr.py) 32 node
    processes held a median of 27-30 links against a high mark of 12 and trimmed ~900 in 3
    minutes, redialed as fast (355 of a minute's dials were its own). Whom to dial is the
    node's discovery's decision."""
    connector = getattr(host.get_network(), "auto_connector", None)
    if connector is not None:
        connector.maybe_connect = _never_connect
