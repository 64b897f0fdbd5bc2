"""Error types of the overlay (libp2p side). `wire.WireError` covers framing errors."""

from __future__ import annotations

from p2pnode.errors import P2PNodeError

__all__ = ["BadMultiaddr", "BootstrapFailed", "OverlayError", "PeerBusy", "PeerUnreachable"]


class OverlayError(P2PNodeError):
    """Base class of overlay errors."""

    reason = "overlay_error"


class BadMultiaddr(OverlayError, ValueError):
    """A multiaddr string could not be parsed or lacks a required part (e.g. `/p2p/<id>`)."""

    reason = "bad_multiaddr"


class BootstrapFailed(OverlayError):
    """No bootstrap peer could be reached within the retry budget."""

    reason = "bootstrap_failed"


class PeerUnreachable(OverlayError):
    """A peer could not be dialed or a stream to it could not be opened."""

    reason = "unreachable"


class PeerBusy(PeerUnreachable):
    """The peer answered "busy, retry after N s" (its hello) and that time has not passed."""

    reason = "peer_busy"
