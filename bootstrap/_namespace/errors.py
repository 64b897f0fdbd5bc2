"""The one root of every error p2pnode raises on purpose.

Why a root: a caller that serves strangers (the HTTP API, a stream handler, the CLI) needs one
``except P2PNodeError`` to tell "we refused or failed, and said why" from a bug, and one place to
read the machine-readable reason instead of a table per package.

Contract: each subclass sets ``reason``, a short stable slug (``"prompt_too_long"``,
``"bad_signature"``) that logs, metrics labels and wire refusals use as is. Where a refusal
already travelled on the wire before this root existed, its reason is that wire word, so peers
of older versions read it unchanged (``"limited"``; the verifier's refusals are their class
names, ``"VerifierFull"``). A subclass that adds
no reason of its own inherits its parent's. Package roots (``IdentityError``, ``OverlayError``,
``EngineError``, ...) derive from ``P2PNodeError``; this module imports nothing of ours, so every
layer may use it.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["P2PNodeError"]


class P2PNodeError(Exception):
    """Base class of p2pnode's own errors; ``reason`` names the failure for machines."""

    reason: ClassVar[str] = "error"
