"""Verifiers in the digests: what their prefix caches hold and how busy they are.

Contract:
- A verifier's digest travels on the same anti-entropy as an engine's, under its own model key
  ``verify_digest_model(model_id)`` (``"<model id>#verify"``), so routers never mistake a
  verifier's session cache for an engine's prefix cache and edges subscribe to verifiers only.
- ``VerifierAdvert(peer_id, verifier, min_uses)``: a ``DigestBuilder`` fed by the verifier's
  prefix cache (``speculation/_prefix.py``) through an ``AdvertiseGate`` (a block is advertised
  once ``min_uses`` sessions used it: one user's prompt is never broadcast), with the load
  figures ``load()``: open sessions as the queue depth, the wait a new session's block would see
  (blocks in flight, in batches of ``max_batch``, at the measured batch time) and the measured
  prefill speed.
- ``rank_verifiers(peers, prompt, model_id, views, rtt_s)``: the candidates ordered by estimated
  time to the first verified block: ``rtt + wait + prefill_s_per_token * (prompt - cached)``,
  with the cached prefix read from the peer's view (0 and our own figures when it has none).
  Unmeasured RTTs sort last; equal estimates keep RTT order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo
from p2pnode.overlay.cache.privacy import AdvertiseGate
from p2pnode.overlay.cache.views import PeerViews, prefix_tokens
from p2pnode.speculation.verify import BatchedVerifier

VERIFY_SUFFIX = "#verify"


def verify_digest_model(model_id: str) -> str:
    return model_id + VERIFY_SUFFIX


class VerifierAdvert:
    def __init__(self, peer_id: str, verifier: BatchedVerifier, min_uses: int = 2) -> None:
        self.verifier = verifier
        self.model = verify_digest_model(verifier.model_id)
        self.builder = DigestBuilder(peer_id, self.model, load_fn=self.load)
        self.gate = AdvertiseGate(self.builder, min_uses)
        self._salt = model_salt(verifier.model_id)
        verifier.prefix.add_listener(self.gate.on_event)
        verifier.on_open = self._on_open

    def _on_open(self, prompt: Sequence[int]) -> None:
        self.gate.note_request(block_hashes(list(prompt), self._salt))

    def load(self) -> LoadInfo:
        v = self.verifier
        in_flight = sum(1 for s in v.sessions.values() if s.busy)
        batches = math.ceil(in_flight / max(1, v.max_batch))
        return LoadInfo(
            queue_depth=len(v.sessions),
            est_wait_s=batches * v.timing["batch_s"],
            push_back=len(v.sessions) >= v.max_sessions,
            prefill_s_per_token=v.timing["prefill_s_per_token"],
            decode_s_per_token=v.timing["batch_s"],
        )


def rank_verifiers(
    peers: Sequence[str],
    prompt: Sequence[int],
    model_id: str,
    views: PeerViews,
    rtt_s: Callable[[str], float | None],
) -> list[str]:
    key = verify_digest_model(model_id)
    hashes = block_hashes(list(prompt), model_salt(model_id))
    known = [v for v in (views.get(p, key) for p in peers) if v is not None]
    default_rate = max((v.load.prefill_s_per_token for v in known), default=0.0)

    def estimate(peer: str) -> tuple[float, float]:
        rtt = rtt_s(peer)
        if rtt is None:
            return (math.inf, math.inf)
        view = views.get(peer, key)
        if view is None:
            return (rtt + default_rate * len(prompt), rtt)
        fps = [h >> (64 - view.fp_bits) for h in hashes]
        cached = min(prefix_tokens(view, fps), max(0, len(prompt) - 1))
        rate = view.load.prefill_s_per_token or default_rate
        return (rtt + view.load.est_wait_s + rate * (len(prompt) - cached), rtt)

    return sorted(peers, key=estimate)
