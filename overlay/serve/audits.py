"""Audits on a third peer: a trusted peer that holds the prompt's prefix re-scores an answer.

Why: checking an answer needs the target's logits over prompt + answer. The origin's own pass
costs a prefill of the whole thing, about what serving it locally costs; a peer that holds the
prompt's prefix in its KV cache (the serving peer does, and so may others) scores it with one
prefill of the uncached part plus the answer (``Engine.score``), a small share of serving.

Protocol ``/p2pnode/audit/1`` (one request per stream; the remote is the Noise-authenticated
peer): the origin sends ``audit-request`` {model id, prompt ids, answer ids, temperature,
top-p, nonce}; the auditor answers ``audit-reply`` with its verdict sealed in an envelope of
kind ``audit-verdict`` (signed with its node key: the verdict can be shown to others) holding
{nonce, model id, SHA-256 of prompt + answer, passed, checked, first bad token, statistic,
detail}, or with an error code (``busy``: no free batch slot, an audit never makes a
client's request wait; ``no_model``; ``bad_request``).

Contract:
- ``AuditServer(engine, key, config, idle)``: ``handle(stream)`` serves one request when
  ``idle()`` (a free batch slot) and checks the answer as ``overlay/trust/audit.py`` does.
- ``request_audit(node, peer, request, timeout_s) -> AuditVerdict``; ``RemoteAuditFailed`` on
  any failure (error code, bad or foreign signature, another nonce or request digest).
- ``ThirdPeerAudits(node, views, model_id, salt, trusted, local_cost_s, rtt_s)`` is the
  ``SecondAuditor`` the origin's ``Auditor`` uses: ``audit(prompt, answer, params,
  not_by=...)`` picks, among peers that ``trusted`` allows (members, or peers past probation)
  and not in ``not_by`` (the server; for a tie-breaker, the first auditor too), the one whose
  estimated cost (a round trip plus its prefill of what its digest does not hold, plus the
  answer) is lowest, and only when that beats the origin's own pass (``own_cost_s(prompt,
  answer_len)`` when given: the origin's pass on its own cached prefix); returns ``(verdict,
  auditor)`` or None (nobody cheaper, or the call failed: the origin then audits itself).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from p2pnode.errors import P2PNodeError
from p2pnode.identity import IdentityError, NodeKey, open_envelope, register_kind, seal
from p2pnode.inference.blockhash import block_hashes
from p2pnode.inference.sampling import SamplingParams
from p2pnode.overlay import wire
from p2pnode.overlay.cache.digest import MAX_MODEL_ID_LEN
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.limits import remote_peer
from p2pnode.overlay.trust.audit import AuditConfig, AuditVerdict, check_answer

if TYPE_CHECKING:
    from libp2p.abc import INetStream

    from p2pnode.inference._backend_protocol import Rows
    from p2pnode.overlay.seams import OverlayHost

log = logging.getLogger("p2pnode.overlay.serve.audits")

AUDIT_PROTOCOL = "/p2pnode/audit/1"
VERDICT_KIND = "audit-verdict"
MAX_AUDIT_TOKENS = 1 << 15
register_kind(VERDICT_KIND)


class RemoteAuditFailed(P2PNodeError):
    """A third-peer audit gave no usable verdict (the origin audits itself instead)."""

    reason = "remote_audit_failed"


@wire.message("audit-request")
@dataclass(frozen=True)
class AuditRequest:
    model_id: str = field(metadata=wire.bounded(min_len=1, max_len=MAX_MODEL_ID_LEN))
    prompt: list[int] = field(
        metadata=wire.bounded(min_len=1, max_len=MAX_AUDIT_TOKENS, item_ge=0, item_le=2**31)
    )
    answer: list[int] = field(
        metadata=wire.bounded(min_len=1, max_len=MAX_AUDIT_TOKENS, item_ge=0, item_le=2**31)
    )
    temperature: float = field(default=0.0, metadata=wire.bounded(ge=0, le=100))
    top_p: float = field(default=1.0, metadata=wire.bounded(ge=0, le=1))
    nonce: bytes = field(default=b"", metadata=wire.bounded(max_len=32))

    def digest(self) -> bytes:
        return _digest(self.prompt, self.answer)


@wire.message("audit-reply")
@dataclass(frozen=True)
class AuditReply:
    verdict: bytes | None = field(default=None, metadata=wire.bounded(max_len=4096))
    error: str | None = field(default=None, metadata=wire.bounded(max_len=32))


def _digest(prompt: Sequence[int], answer: Sequence[int]) -> bytes:
    data = b"".join(int(t).to_bytes(4, "big") for t in prompt)
    data += b"|" + b"".join(int(t).to_bytes(4, "big") for t in answer)
    return hashlib.sha256(data).digest()


class ScoringEngine(Protocol):
    """What an auditor needs of its engine (``inference.engine.Engine``)."""

    model_id: str
    vocab_size: int

    async def score(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> Rows: ...


class AuditServer:
    """Answers audit requests with this node's engine (see the module contract)."""

    def __init__(
        self, engine: ScoringEngine, key: NodeKey, config: AuditConfig, idle: Callable[[], bool]
    ) -> None:
        self.engine, self.key, self.config, self.idle = engine, key, config, idle
        self.served = 0

    async def handle(self, stream: INetStream) -> None:
        limit = wire.limit_for(AUDIT_PROTOCOL)
        try:
            with trio.fail_after(30):
                obj = await wire.read_frame(stream, limit=limit)
            req = wire.from_wire(obj, AuditRequest)
            reply = await self._answer(req)
            with trio.fail_after(30):
                await wire.write_frame(stream, wire.to_wire(reply), limit=limit)
        except (wire.WireError, trio.TooSlowError) as exc:
            log.info("audit request from %s refused: %s", remote_peer(stream), exc)
        finally:
            with trio.move_on_after(1):
                await stream.close()

    async def _answer(self, req: AuditRequest) -> AuditReply:
        if req.model_id != self.engine.model_id:
            return AuditReply(error="no_model")
        if not self.idle():
            return AuditReply(error="busy")
        vocab = self.engine.vocab_size
        params = SamplingParams(
            max_tokens=len(req.answer), temperature=req.temperature, top_p=req.top_p
        )
        if any(t >= vocab for t in req.prompt):
            return AuditReply(error="bad_request")
        if any(t >= vocab for t in req.answer):  # no model answers a token it does not have
            verdict = AuditVerdict(False, len(req.answer), 0, float("inf"), "not a token")
        else:
            try:
                rows = await self.engine.score(req.prompt, req.answer)
            except ValueError:  # the engine's own input errors (too long for its context)
                return AuditReply(error="bad_request")
            verdict = check_answer(rows, req.answer, params, self.config)
        self.served += 1
        payload = {
            "nonce": req.nonce,
            "model": req.model_id,
            "digest": req.digest(),
            "passed": verdict.passed,
            "checked": verdict.checked,
            "first_bad": -1 if verdict.first_bad is None else verdict.first_bad,
            "statistic": min(verdict.statistic, 1e9),
            "detail": verdict.detail[:200],
        }
        return AuditReply(verdict=seal(self.key, VERDICT_KIND, payload))


async def request_audit(
    node: OverlayHost, peer: str, request: AuditRequest, timeout_s: float
) -> AuditVerdict:
    limit = wire.limit_for(AUDIT_PROTOCOL)
    try:
        with trio.fail_after(timeout_s):
            stream = await node.open_stream(peer, AUDIT_PROTOCOL, timeout=timeout_s)
            try:
                await wire.write_frame(stream, wire.to_wire(request), limit=limit)
                reply = wire.from_wire(await wire.read_frame(stream, limit=limit), AuditReply)
            finally:
                with trio.move_on_after(1):
                    await stream.close()
    except (trio.TooSlowError, wire.WireError, OSError, P2PNodeError) as exc:
        raise RemoteAuditFailed(f"{peer}: {exc!r}") from None
    except Exception as exc:  # a libp2p stream error of any type: no verdict, nothing more
        raise RemoteAuditFailed(f"{peer}: {exc!r}") from None
    if reply.verdict is None:
        raise RemoteAuditFailed(f"{peer} answered {reply.error or 'nothing'}")
    try:
        opened = open_envelope(reply.verdict, VERDICT_KIND)
    except IdentityError as exc:
        raise RemoteAuditFailed(f"{peer}: bad verdict envelope: {exc}") from None
    v = opened.payload
    if opened.peer_id != peer or not isinstance(v, dict):
        raise RemoteAuditFailed(f"{peer}: the verdict is signed by {opened.peer_id}")
    if v.get("nonce") != request.nonce or v.get("digest") != request.digest():
        raise RemoteAuditFailed(f"{peer}: the verdict is for another request")
    try:
        first_bad = int(v["first_bad"])
        return AuditVerdict(
            passed=bool(v["passed"]),
            checked=int(v["checked"]),
            first_bad=None if first_bad < 0 else first_bad,
            statistic=float(v["statistic"]),
            detail=str(v["detail"])[:200],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RemoteAuditFailed(f"{peer}: malformed verdict {exc!r}") from None


class ThirdPeerAudits:
    """Picks the cheapest trusted auditor that holds the prefix (see the module contract)."""

    def __init__(
        self,
        node: OverlayHost,
        views: PeerViews,
        *,
        model_id: str,
        salt: bytes,
        trusted: Callable[[str], bool],
        local_cost_s: Callable[[int], float],
        rtt_s: Callable[[str], float | None],
        own_cost_s: Callable[[list[int], int], float] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.node, self.views, self.model_id, self.salt = node, views, model_id, salt
        self.trusted, self.local_cost_s, self.rtt_s = trusted, local_cost_s, rtt_s
        self.own_cost_s = own_cost_s
        self.timeout_s = timeout_s
        self.counts: dict[str, int] = {"asked": 0, "failed": 0}

    def _ranked(self, exclude: set[str], prompt: list[int], answer_len: int) -> list[str]:
        hashes = block_hashes(prompt, self.salt)
        ranked = []
        for view in self.views.views():
            peer = view.peer_id
            if view.model_id != self.model_id or peer in exclude or not self.trusted(peer):
                continue
            cached = self.views.cached_prefix_tokens(peer, hashes, self.model_id)
            rate = view.load.prefill_s_per_token or self.local_cost_s(1)
            rtt = self.rtt_s(peer)
            cost = (1.0 if rtt is None else rtt) + (len(prompt) - cached + answer_len) * rate
            ranked.append((cost, peer))
        ranked.sort()
        if self.own_cost_s is not None:
            local = self.own_cost_s(prompt, answer_len)
        else:
            local = self.local_cost_s(len(prompt) + answer_len)
        return [peer for cost, peer in ranked if cost < local]

    async def audit(
        self, prompt: list[int], answer: list[int], params: SamplingParams, *, not_by: set[str]
    ) -> tuple[AuditVerdict, str] | None:
        request = AuditRequest(
            model_id=self.model_id,
            prompt=list(prompt),
            answer=list(answer),
            temperature=params.temperature,
            top_p=params.top_p,
            nonce=secrets.token_bytes(16),
        )
        for peer in self._ranked(not_by | {self.node.peer_id}, prompt, len(answer))[:2]:
            self.counts["asked"] += 1
            try:
                return await request_audit(self.node, peer, request, self.timeout_s), peer
            except RemoteAuditFailed as exc:
                self.counts["failed"] += 1
                log.info("third-peer audit failed: %s", exc)
        return None
