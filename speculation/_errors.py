"""Every error of ``p2pnode.speculation``, each under ``p2pnode.errors.P2PNodeError``.

Contract: each class sets ``reason``. The verifier's refusals (``VerifierError`` and the
subclasses with ``sent_by_verifier``) travel on ``/p2pnode/verify/1`` as their ``reason``
(``verify-refused`` / ``verify-error`` ``code``), and the edge turns a code back into the class
by the same attribute (``protocol.py``). Those slugs are the class names because that is what
the wire carried before there was a ``reason``; changing one breaks older peers. The edge's own
conclusions (``BadVerdict``, ``NoVerifier``) are ``VerifierError`` too, so one ``except`` covers
"this verifier could not serve us", but a verifier can never make the edge raise them.
"""

from __future__ import annotations

from typing import ClassVar

from p2pnode.errors import P2PNodeError

__all__ = [
    "BadBlock",
    "BadRequest",
    "BadVerdict",
    "DraftError",
    "NoVerifier",
    "PeerLimited",
    "QuantizeError",
    "SessionBusy",
    "SessionLimit",
    "UnknownSession",
    "VerifierError",
    "VerifierFull",
    "WrongModel",
]


class VerifierError(P2PNodeError):
    """A verification refused or failed; the message says what to change. Raised as is when a
    forward pass failed (a bug or the device: retry on another verifier)."""

    reason: ClassVar[str] = "VerifierError"
    # True: the verifier raises it and the edge may receive it by its reason (see the contract).
    sent_by_verifier: ClassVar[bool] = True


class VerifierFull(VerifierError):
    """The verifier holds its ``max_sessions``: retry later or on another verifier."""

    reason = "VerifierFull"


class SessionLimit(VerifierError):
    """The session reached its token limit (``max_tokens_per_session`` or the context)."""

    reason = "SessionLimit"


class UnknownSession(VerifierError):
    """The session is closed, or was reaped after ``idle_timeout_s``: open a new one."""

    reason = "UnknownSession"


class SessionBusy(VerifierError):
    """A block of the session is still being verified: one block at a time per session."""

    reason = "SessionBusy"


class BadBlock(VerifierError):
    """A malformed block or prompt (token ids, sizes, draft probabilities): the caller's bug."""

    reason = "BadBlock"


class BadRequest(VerifierError):
    """A malformed request (sampling options, lead, mode, prompt): the caller's bug."""

    reason = "BadRequest"


class WrongModel(VerifierError):
    """The verifier serves another model: pick a verifier of yours."""

    reason = "WrongModel"


class PeerLimited(VerifierError):
    """Over a per-peer limit (open sessions, opens or blocks per second, bytes in flight)."""

    reason = "PeerLimited"


class BadVerdict(VerifierError):
    """The verifier answered something impossible (see ``overlay.trust.verdict_problem``);
    raised by the edge, which fails over and counts it against that verifier."""

    reason = "BadVerdict"
    sent_by_verifier = False


class NoVerifier(VerifierError):
    """No verifier of the model could finish the request; the message says who failed how."""

    reason = "NoVerifier"
    sent_by_verifier = False


class DraftError(P2PNodeError, RuntimeError):
    """The draft could not be built or loaded; the message says what to fix."""

    reason = "bad_draft"


class QuantizeError(DraftError, ValueError):
    """GPTQ cannot quantize with these inputs (too little calibration text, widths that do not
    fit the group size). A ``ValueError`` as well, as it always was."""

    reason = "quantize_failed"
