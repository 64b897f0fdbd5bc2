"""Speculative decoding across the overlay: a W4A16 draft at the edge, the target at verifiers.

Map of the package (public modules first; ``_`` modules are private, their names re-exported
here where others need them):

- ``edge.py``: the edge loop, ``speculative_generate`` (loop: ``_Edge.draft``; its state:
  ``_flight.py``); ``remote_generate`` (target only, over the same protocol);
  ``target_generate`` (the local reference); ``VerifierTransport``, the seam to a verifier;
  ``DraftRunner``, ``SpecStats``, ``SpecResult``, ``DraftHistory`` (what an edge learned
  about one verifier: drafting or letting it decode alone, which is faster).
- ``client.py``: ``open_edge``, ``EdgeClient`` (verifier choice, failover, audits), ``EdgeResult``.
- ``verify.py``: ``BatchedVerifier``, the multi-tenant verifier and its batching loop (``run``).
- ``protocol.py``: ``/p2pnode/verify/1``: ``serve_verifier`` (verifier side),
  ``P2PVerifierTransport`` (edge side), the wire messages.
- ``advert.py``: ``VerifierAdvert`` (a verifier's digest), ``rank_verifiers`` (the edge's pick).
- ``draft.py``: ``load_draft``, ``build_draft``, ``DraftModel``, ``Int4Linear``.
- ``testing.py``: ``inprocess_transport`` (a verifier in this process); tests and benches only.
- ``_blocks.py``: ``SamplingOptions``, ``Block``, ``BlockResult``, ``Lead``: what edge and
  verifier exchange.
- ``_accept.py``: the acceptance math, ``verify_greedy``, ``verify_sampling``, ``truncate_probs``.
- ``_flight.py``: the edge's blocks in flight and its checked copy of the committed tokens.
- ``_batching.py``: one batching step as data and pure functions (``plan``, ``accept``).
- ``_blocksize.py``: the verifier's block-size control: how many draft tokens it asks each
  session for (``BlockResult.want``), from its measured load and the session's acceptance.
- ``_kvstack.py``: sessions' KV caches stacked left-padded into one batch, and back.
- ``_prefix.py``: ``PrefixKV``, closed sessions' KV kept for the next session on that prefix.
- ``_errors.py``: every error here, under ``p2pnode.errors.P2PNodeError``.
- ``_audit.py``: second opinions on results (``EdgeClient.audit``). ``_gptq.py``: GPTQ for the draft.
"""

from p2pnode.speculation._accept import truncate_probs as truncate_probs
from p2pnode.speculation._accept import verify_greedy as verify_greedy
from p2pnode.speculation._accept import verify_sampling as verify_sampling
from p2pnode.speculation._audit import Audit as Audit
from p2pnode.speculation._audit import SampledAudit as SampledAudit
from p2pnode.speculation._blocks import Block as Block
from p2pnode.speculation._blocks import BlockResult as BlockResult
from p2pnode.speculation._blocks import Lead as Lead
from p2pnode.speculation._blocks import SamplingOptions as SamplingOptions
from p2pnode.speculation._errors import BadBlock as BadBlock
from p2pnode.speculation._errors import BadRequest as BadRequest
from p2pnode.speculation._errors import BadVerdict as BadVerdict
from p2pnode.speculation._errors import DraftError as DraftError
from p2pnode.speculation._errors import NoVerifier as NoVerifier
from p2pnode.speculation._errors import PeerLimited as PeerLimited
from p2pnode.speculation._errors import QuantizeError as QuantizeError
from p2pnode.speculation._errors import SessionBusy as SessionBusy
from p2pnode.speculation._errors import SessionLimit as SessionLimit
from p2pnode.speculation._errors import UnknownSession as UnknownSession
from p2pnode.speculation._errors import VerifierError as VerifierError
from p2pnode.speculation._errors import VerifierFull as VerifierFull
from p2pnode.speculation._errors import WrongModel as WrongModel
from p2pnode.speculation.advert import VerifierAdvert as VerifierAdvert
from p2pnode.speculation.advert import rank_verifiers as rank_verifiers
from p2pnode.speculation.advert import verify_digest_model as verify_digest_model
from p2pnode.speculation.client import EdgeClient as EdgeClient
from p2pnode.speculation.client import EdgeResult as EdgeResult
from p2pnode.speculation.client import open_edge as open_edge
from p2pnode.speculation.draft import DraftModel as DraftModel
from p2pnode.speculation.draft import Int4Linear as Int4Linear
from p2pnode.speculation.draft import build_draft as build_draft
from p2pnode.speculation.draft import load_draft as load_draft
from p2pnode.speculation.edge import DraftHistory as DraftHistory
from p2pnode.speculation.edge import DraftRunner as DraftRunner
from p2pnode.speculation.edge import SpecResult as SpecResult
from p2pnode.speculation.edge import SpecStats as SpecStats
from p2pnode.speculation.edge import VerifierTransport as VerifierTransport
from p2pnode.speculation.edge import remote_generate as remote_generate
from p2pnode.speculation.edge import speculative_generate as speculative_generate
from p2pnode.speculation.edge import target_generate as target_generate
from p2pnode.speculation.protocol import VERIFY_PROTOCOL as VERIFY_PROTOCOL
from p2pnode.speculation.protocol import P2PVerifierTransport as P2PVerifierTransport
from p2pnode.speculation.protocol import serve_verifier as serve_verifier
from p2pnode.speculation.verify import BatchedVerifier as BatchedVerifier

__all__ = [
    "VERIFY_PROTOCOL",
    "Audit",
    "BadBlock",
    "BadRequest",
    "BadVerdict",
    "BatchedVerifier",
    "Block",
    "BlockResult",
    "DraftError",
    "DraftHistory",
    "DraftModel",
    "DraftRunner",
    "EdgeClient",
    "EdgeResult",
    "Int4Linear",
    "Lead",
    "NoVerifier",
    "P2PVerifierTransport",
    "PeerLimited",
    "QuantizeError",
    "SampledAudit",
    "SamplingOptions",
    "SessionBusy",
    "SessionLimit",
    "SpecResult",
    "SpecStats",
    "UnknownSession",
    "VerifierAdvert",
    "VerifierError",
    "VerifierFull",
    "VerifierTransport",
    "WrongModel",
    "build_draft",
    "load_draft",
    "open_edge",
    "rank_verifiers",
    "remote_generate",
    "serve_verifier",
    "speculative_generate",
    "target_generate",
    "truncate_probs",
    "verify_digest_model",
    "verify_greedy",
    "verify_sampling",
]
