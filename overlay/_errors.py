"""Error types of the overlay (libp2p side). `wire.WireError` covers framing errors."""

from __future__ import annotations

__all__ = ["BadMultiaddr", "BootstrapFailed", "OverlayError", "PeerUnreachable"]


class OverlayError(Exception):
    """Base class of overlay errors."""


class BadMultiaddr(OverlayError, ValueError):
    """A multiaddr string could not be parsed or lacks a required part (e.g. `/p2p/<id>`)."""


class BootstrapFailed(OverlayError):
    """No bootstrap peer could be reached within the retry budget."""


class PeerUnreachable(OverlayError):
    """A peer could not be dialed or a stream to it could not be opened."""
