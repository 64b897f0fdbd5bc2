"""What the console shows, as plain data (the shapes are documented in docs/console.md).

``ConsoleFeed(status, service=..., engine=..., metrics=...)`` reads the parts a node already
has; it adds no task of its own:
- ``swarm()``: this node and every peer of its peer table, joined with the router's view of
  the peer (queue, cached blocks, push-back), its trust score and the connection kind (direct,
  relayed, none), plus the links this node measures (RTT per peer) for the overlay picture.
- ``sample()`` appends a point to this node's history (at most one per ``min_interval_s``,
  ``history`` points kept): cache size, evicted tokens, queue, push-back, generated tokens/s and
  the prefix-cache hit rate (cached / prompt tokens the engine admitted since the last point).
  The console's event stream samples every second, so history grows while someone watches.
- ``record_outcome(job, outcome)`` (the API calls it after each completed request) keeps the
  routing decision (every candidate's estimated network, queue, prefill, prefill saved and total
  time, the choice, a sentence saying why, the attempts and what really happened) in a ring of
  ``decisions`` entries and hands it to every subscriber (``subscribe()``, the SSE stream).
- ``speculation()``: verifier sessions (``watch_verifier``) and edge results (``record_edge``).
- What it reads of the parts it is given is written down as Protocols: ``FeedService`` (the
  node's ``RoutedService``), ``FeedEngine`` (either engine) and ``FeedVerifier``
  (``BatchedVerifier``), each what the metrics read (``bootstrap/metrics.py``) and more.
  Routing decisions, attempts and edge results are the overlay's and speculation's own types.
  Reads through ``getattr`` are of parts a node may lack: the radix ``tree`` and ``totals``
  (the CPU engine has them, vLLM not), the service's overlay ``node`` and its
  ``connection_kind`` (a stand-in in tests), a request's ``endpoint``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import trio

from p2pnode.bootstrap.metrics import EngineGauges, ServiceGauges, VerifierStats
from p2pnode.inference.blockhash import BLOCK_SIZE

if TYPE_CHECKING:
    from libp2p.abc import INetConn

    from p2pnode.bootstrap.metrics import NodeMetrics
    from p2pnode.overlay.cache.views import PeerViews
    from p2pnode.overlay.routing.router import CandidateEstimate, RoutingDecision
    from p2pnode.overlay.serve.forward import ForwardServer
    from p2pnode.overlay.serve.service import Attempt, RoutedResult
    from p2pnode.overlay.trust.audit import Auditor
    from p2pnode.overlay.trust.book import TrustBook
    from p2pnode.speculation.client import EdgeResult

SUBSCRIBER_BUFFER = 64  # decisions a slow event-stream reader may lag; older ones are dropped


class _Outcome(Protocol):  # the API's per-request outcome (bootstrap/api/_bodies.py)
    routed: RoutedResult | None
    tokens: list[int]
    total_s: float


class FeedService(ServiceGauges, Protocol):
    """The node's routed service, as the console reads it: what the metrics read, and more."""

    model_id: str

    @property
    def views(self) -> PeerViews: ...

    @property
    def trust(self) -> TrustBook: ...

    @property
    def server(self) -> ForwardServer | None: ...  # None until the service serves peers

    @property
    def auditor(self) -> Auditor | None: ...  # None: this node audits no one


class FeedEngine(EngineGauges, Protocol):
    """An engine, as the console reads it (see the module contract for ``tree``, ``totals``)."""

    @property
    def model_id(self) -> str: ...


class FeedSession(Protocol):
    """One verification session (``speculation/verify.py``); ``counts`` where it keeps them."""

    @property
    def committed_len(self) -> int: ...

    lead: int
    lead_left: int
    options: object  # SamplingOptions: its temperature is shown


class FeedVerifier(VerifierStats, Protocol):
    """The speculative verifier, as the console reads it."""

    model_id: str
    max_sessions: int

    @property
    def sessions(self) -> Mapping[str, FeedSession]: ...


def _short(peer: str) -> str:
    return peer if peer == "local" or len(peer) <= 12 else f"…{peer[-8:]}"


def link_kind(conn: INetConn) -> str:
    """One libp2p connection: ``relayed`` (a circuit through a relay) or ``direct``."""
    secured = getattr(getattr(conn, "muxed_conn", None), "secured_conn", None)
    kind = getattr(secured, "get_connection_type", None)
    if kind is not None:
        t = kind()  # libp2p's ConnectionType
        return "relayed" if str(getattr(t, "name", t)).upper() == "RELAYED" else "direct"
    relayed = any("/p2p-circuit" in str(a) for a in conn.get_transport_addresses())
    return "relayed" if relayed else "direct"


def _connection_kind(node: object, peer_id: str) -> str:
    """``direct`` (at least one direct connection), ``hole-punched`` (a direct connection a
    hole punch made), ``relayed`` (only circuits through a relay), ``none`` (not connected) or ``unknown`` (a stand-in node, a bad id): the
    overlay node's own answer (``OverlayNode.connection_kind``)."""
    from libp2p.peer.id import ID

    kind_of = getattr(node, "connection_kind", None)
    try:
        ID.from_base58(peer_id)
    except Exception:  # an id libp2p cannot parse
        return "unknown"
    if kind_of is None:
        return "unknown"
    return kind_of(peer_id) or "none"


def candidate_record(c: CandidateEstimate, prompt_tokens: int, chosen: str) -> dict[str, Any]:
    """One candidate's estimate, split the way the console explains it."""
    network = max(0.0, c.total_s - c.wait_s - c.overhead_s - c.prefill_s - c.decode_s)
    uncached = max(1, prompt_tokens - c.cached_tokens)  # the last prompt token is always run
    return {
        "peer_id": c.peer_id,
        "is_local": c.is_local,
        "chosen": c.peer_id == chosen,
        "network_s": round(network, 6),
        "queue_s": round(c.wait_s, 6),
        "prefill_s": round(c.prefill_s, 6),
        "prefill_saved_s": round(c.cached_tokens * c.prefill_s / uncached, 6),
        "decode_s": round(c.decode_s, 6),
        "overhead_s": round(c.overhead_s, 6),
        "total_s": round(c.total_s, 6),
        "cached_tokens": c.cached_tokens,
        "view_cached_tokens": c.view_cached_tokens,
        "confidence": round(c.confidence, 4),
        "rtt_s": round(c.rtt_s, 6),
        "rtt_known": c.rtt_known,
        "skipped": c.skipped,
    }


def explain(
    decision: RoutingDecision, attempts: Sequence[Attempt], served_by: str, local_id: str
) -> str:
    """A sentence: why the request went where it went (from the decision's own numbers)."""
    cands = {c.peer_id: c for c in decision.candidates}
    local = cands.get("local")
    chosen = cands.get(decision.chosen)
    eligible = [c for c in decision.candidates if not c.is_local and c.skipped is None]
    skipped = [c for c in decision.candidates if c.skipped is not None]
    reason = decision.reason
    if reason == "remote_faster" and chosen is not None and local is not None:
        parts = []
        for name, mine, theirs in (
            ("prefill", local.prefill_s, chosen.prefill_s),
            ("queue", local.wait_s, chosen.wait_s),
        ):
            if abs(mine - theirs) >= 0.0005:
                parts.append(f"{name} {theirs - mine:+.3f} s")
        network = chosen.total_s - chosen.wait_s - chosen.overhead_s
        network -= chosen.prefill_s + chosen.decode_s
        parts.append(f"network {network:+.3f} s")
        text = (
            f"{_short(decision.chosen)} was estimated at {chosen.total_s:.3f} s against "
            f"{local.total_s:.3f} s here ({chosen.cached_tokens} of {decision.prompt_tokens} "
            f"prompt tokens cached there, {local.cached_tokens} here; "
            f"{', '.join(parts)}): it saves {local.total_s - chosen.total_s:.3f} s, more than "
            f"the margin"
        )
    elif reason == "remote_saving_below_margin" and eligible and local is not None:
        best = min(eligible, key=lambda c: c.total_s)
        if best.total_s >= local.total_s:
            text = (
                f"every usable peer was estimated slower: the best, {_short(best.peer_id)}, at "
                f"{best.total_s:.3f} s against {local.total_s:.3f} s here, so it stayed local"
            )
        else:
            text = (
                f"best peer {_short(best.peer_id)} was estimated at {best.total_s:.3f} s "
                f"against {local.total_s:.3f} s here: it would save "
                f"{local.total_s - best.total_s:.3f} s, under the margin (the larger of "
                f"{decision.margin_s:.3f} s and one round trip), so it stayed local"
            )
    elif reason == "local_best":
        if skipped:
            why = ", ".join(f"{_short(c.peer_id)} {c.skipped}" for c in skipped[:4])
            text = f"no usable peer beat this node ({why})"
        elif len(decision.candidates) <= 1:
            text = "no peer advertises this model, so this node served it"
        else:
            text = "every peer was estimated slower than this node"
    elif reason == "forwarding_off":
        text = "forwarding is off on this node, so it served the request itself"
    elif reason == "no_local_engine" and chosen is not None:
        text = f"this node runs no engine; {_short(decision.chosen)} was the fastest peer"
    else:
        text = reason.replace("_", " ")
    failed = [a for a in attempts if a.outcome != "ok"]
    if failed:
        first = failed[0]
        where = "this node" if served_by == local_id else _short(served_by)
        text += f"; the attempt at {_short(first.target)} failed ({first.outcome}), {where} served"
    return text


class ConsoleFeed:
    """See the module contract."""

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        *,
        service: FeedService | None = None,
        engine: FeedEngine | None = None,
        metrics: NodeMetrics | None = None,
        history: int = 600,
        decisions: int = 200,
        min_interval_s: float = 0.9,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.status = status
        self.service = service
        self.engine = engine
        self.metrics = metrics
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.history: deque[dict[str, Any]] = deque(maxlen=history)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=decisions)
        self.edge_results: deque[dict[str, Any]] = deque(maxlen=50)
        self.verifier: FeedVerifier | None = None
        self._last_totals: dict[str, int] | None = None
        self._last_t = 0.0
        self._seen_sessions: dict[str, tuple[float, int]] = {}
        self._subscribers: set[trio.MemorySendChannel[dict[str, Any]]] = set()
        self._seq = 0

    # -- this node ----------------------------------------------------------------------------

    def _totals(self) -> dict[str, int]:
        totals = getattr(self.engine, "totals", None)
        if isinstance(totals, dict):
            return dict(totals)
        return {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "requests": 0}

    def sample(self) -> dict[str, Any] | None:
        """Append a history point unless the last one is under ``min_interval_s`` old."""
        now = self.clock()
        if self.history and now - self._last_t < self.min_interval_s:
            return None
        totals = self._totals()
        last = self._last_totals
        dt = now - self._last_t if last is not None else 0.0
        tokens_per_s = None
        hit_rate = None
        if last is not None and dt > 0:
            tokens_per_s = (totals["generated_tokens"] - last["generated_tokens"]) / dt
            prompt = totals["prompt_tokens"] - last["prompt_tokens"]
            if prompt > 0:
                hit_rate = (totals["cached_tokens"] - last["cached_tokens"]) / prompt
        e, s = self.engine, self.service
        tree = getattr(e, "tree", None)
        point = {
            "t": round(now, 3),
            "cache_tokens": tree.num_tokens if tree is not None else None,
            "evicted_tokens": tree.evicted_tokens if tree is not None else None,
            "queue_depth": e.queue_depth if e is not None else None,
            "push_back": bool(s.pushback.active) if s is not None and e is not None else None,
            "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 3),
            "hit_rate": None if hit_rate is None else round(hit_rate, 4),
            "served_for_peers": s.server.served if s is not None and s.server else 0,
        }
        self._last_totals, self._last_t = totals, now
        self.history.append(point)
        return point

    def node(self) -> dict[str, Any]:
        self.sample()
        totals = self._totals()
        e = self.engine
        prompt = totals["prompt_tokens"]
        return {
            "peer_id": self.status().get("peer_id"),
            "model": getattr(e, "model_id", None),
            "max_batch": getattr(e, "max_batch", None),
            "cache_budget_tokens": getattr(getattr(e, "tree", None), "max_tokens", None),
            "totals": totals,
            "hit_rate": round(totals["cached_tokens"] / prompt, 4) if prompt else None,
            "now": self.history[-1] if self.history else None,
            "history": list(self.history),
        }

    # -- the swarm ----------------------------------------------------------------------------

    def swarm(self) -> dict[str, Any]:
        st = self.status()
        me = st.get("peer_id")
        s = self.service
        node = getattr(s, "node", None)
        views = {}
        trust: dict[str, Any] = {}
        auditor = s.auditor if s is not None else None
        if s is not None:
            views = {v.peer_id: v for v in s.views.views() if v.model_id == s.model_id}
            trust = s.trust.snapshot()
        e = self.engine
        peers = []
        links = []
        for p in st.get("peers", []):
            pid = p["peer_id"]
            view = views.get(pid)
            t = trust.get(pid, {"score": 1.0, "usable": True, "demotions": 0})
            peers.append(
                {
                    "peer_id": pid,
                    "state": p.get("state"),
                    "rtt_ms": p.get("rtt_ms"),
                    "connection": _connection_kind(node, pid) if node is not None else "unknown",
                    "relayed_because": p.get("relayed_because"),
                    "roles": p.get("roles", []),
                    "models": p.get("models", []),
                    "addrs": p.get("addrs", []),
                    "queue_depth": view.load.queue_depth if view else None,
                    "est_wait_s": round(view.load.est_wait_s, 4) if view else None,
                    "push_back": view.load.push_back if view else None,
                    "cache_blocks": len(view.fingerprints) if view else None,
                    "cache_tokens": len(view.fingerprints) * BLOCK_SIZE if view else None,
                    "view_age_s": (
                        round(s.views.info_age_s(pid, s.model_id) or 0.0, 3) if view else None
                    ),
                    "trust": {
                        **{k: t.get(k) for k in ("score", "usable", "demotions")},
                        # member / probation / trusted / demoted, and our audits of it
                        "state": auditor.state(pid) if auditor is not None else None,
                        "audits": dict(auditor.by_peer.get(pid, {})) if auditor else {},
                    },
                    "failures": p.get("failures", 0),
                    "last_error": p.get("last_error"),
                }
            )
            if p.get("state") in ("up", "suspect"):
                links.append({"a": me, "b": pid, "rtt_ms": p.get("rtt_ms")})
        return {
            "self": {
                "peer_id": me,
                "roles": st.get("roles", []),
                "models": st.get("models") or ([st["model"]] if st.get("model") else []),
                "addrs": st.get("addrs", []),
                "queue_depth": e.queue_depth if e is not None else None,
                "cache_tokens": e.tree.num_tokens if getattr(e, "tree", None) else None,
                "push_back": bool(s.pushback.active) if s is not None and e is not None else None,
                "version": st.get("version"),
                "uptime_s": st.get("uptime_s"),
            },
            "peers": peers,
            "links": links,
        }

    # -- routing decisions --------------------------------------------------------------------

    def record_outcome(self, job: object, out: _Outcome) -> None:
        result = out.routed
        if result is None:
            return
        d = result.decision
        me = self.status().get("peer_id") or ""
        self._seq += 1
        record = {
            "seq": self._seq,
            "id": d.request_id,
            "t": round(self.clock(), 3),
            "endpoint": getattr(job, "endpoint", None),
            "model": d.model_id,
            "prompt_tokens": d.prompt_tokens,
            "max_tokens": d.max_tokens,
            "chosen": d.chosen,
            "reason": d.reason,
            "why": explain(d, result.attempts, result.served_by, me),
            "margin_s": round(d.margin_s, 6),
            "local_total_s": None if d.local_total_s is None else round(d.local_total_s, 6),
            "candidates": [candidate_record(c, d.prompt_tokens, d.chosen) for c in d.candidates],
            "attempts": [a.as_dict() for a in result.attempts],
            "served_by": result.served_by,
            "served_locally": result.served_locally,
            "cached_tokens": result.cached_tokens,
            "generated_tokens": len(out.tokens),
            "total_s": round(out.total_s, 4),
        }
        self.decisions.append(record)
        for send in list(self._subscribers):
            try:
                send.send_nowait(record)
            except trio.WouldBlock:
                pass  # a slow reader loses the oldest news, never blocks a request
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.discard(send)

    def recent_decisions(self, limit: int = 50) -> list[dict[str, Any]]:
        limit = max(0, min(limit, len(self.decisions)))
        return list(self.decisions)[len(self.decisions) - limit :]

    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        send, recv = trio.open_memory_channel[dict[str, Any]](SUBSCRIBER_BUFFER)
        self._subscribers.add(send)
        return recv

    def unsubscribe(self, recv: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
        recv.close()

    # -- speculation --------------------------------------------------------------------------

    def watch_verifier(self, verifier: FeedVerifier) -> None:
        self.verifier = verifier

    def record_edge(self, result: EdgeResult) -> None:
        """An edge generation finished."""
        st = result.stats
        self.edge_results.append(
            {
                "t": round(self.clock(), 3),
                "mode": result.mode,
                "tokens": len(result.tokens),
                "acceptance": round(st.acceptance, 4),
                "alpha": round(st.alpha, 4),
                "lead_tokens": st.lead_tokens,
                "tokens_per_s": round(result.tokens_per_s, 3),
                "verifiers": list(result.verifiers),
                "failovers": result.failovers,
            }
        )

    def speculation(self) -> dict[str, Any]:
        out: dict[str, Any] = {"verifier": None, "edge": list(self.edge_results)}
        v = self.verifier
        if v is None:
            return out
        now = self.clock()
        sessions = []
        live = set()
        for sid, sess in list(v.sessions.items()):
            live.add(sid)
            t0, n0 = self._seen_sessions.setdefault(sid, (now, sess.committed_len))
            rate = (sess.committed_len - n0) / (now - t0) if now - t0 >= 0.5 else None
            counts = dict(getattr(sess, "counts", {}))
            drafted_here = counts.get("drafted", 0)
            sessions.append(
                {
                    "sid": sid,
                    "committed_tokens": sess.committed_len,
                    "blocks": counts.get("blocks"),
                    "acceptance": (
                        round(counts.get("accepted", 0) / drafted_here, 4) if drafted_here else None
                    ),
                    "lead_tokens": counts.get("lead"),
                    "lead": sess.lead,
                    "lead_left": sess.lead_left,
                    "temperature": getattr(sess.options, "temperature", None),
                    "tokens_per_s": None if rate is None else round(rate, 3),
                }
            )
        for sid in set(self._seen_sessions) - live:
            del self._seen_sessions[sid]
        stats = dict(v.stats)
        drafted = stats.get("drafted", 0)
        out["verifier"] = {
            "model": v.model_id,
            "max_sessions": v.max_sessions,
            "stats": stats,
            "acceptance": round(stats.get("accepted", 0) / drafted, 4) if drafted else None,
            "lead_tokens": stats.get("lead", 0),
            "sessions": sessions,
        }
        return out
