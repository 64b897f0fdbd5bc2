"""What a running node reports about itself in ``GET /status``: its routers' views of each
peer, its routing and probation state, and what the process costs (memory, heavy modules).

Contract: pure readers of the objects ``bootstrap/node.py`` assembles; nothing here changes
them. ``process_status()`` reads ``/proc/self`` at each call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from p2pnode.overlay.cache.views import PeerViews
    from p2pnode.overlay.serve.probation import ProbationChallenges
    from p2pnode.overlay.serve.service import RoutedService
    from p2pnode.overlay.serve.swarm import SwarmModels
    from p2pnode.overlay.trust.audit import Auditor
    from p2pnode.overlay.trust.book import TrustBook

__all__ = ["HEAVY_MODULES", "process_status", "routing_status", "views_status"]


class _AuditedService(Protocol):
    """The routed service, as the probation status reads it."""

    @property
    def auditor(self) -> Auditor | None: ...  # None: this node audits no one

    @property
    def probation(self) -> ProbationChallenges | None: ...  # None: no challenges

    @property
    def views(self) -> PeerViews: ...

    @property
    def trust(self) -> TrustBook: ...


def views_status(views: PeerViews) -> dict[str, Any]:
    """What this node's routers know of each peer's cache and queue (its last digest)."""
    return {
        view.peer_id: {
            "model": view.model_id,
            "version": view.version,
            "blocks": len(view.fingerprints),
            "queue_depth": view.load.queue_depth,
            "est_wait_s": round(view.load.est_wait_s, 3),
            "push_back": view.load.push_back,
            "age_s": round(views.info_age_s(view.peer_id, view.model_id) or 0.0, 3),
        }
        for view in views.views()
    }


def routing_status(service: RoutedService | None, swarm: SwarmModels | None) -> dict[str, Any]:
    if service is None:  # a light node: its routers' views (they share one), nothing local
        return {"views": views_status(swarm.views)} if swarm is not None else {}
    local = service.local_load() if service.engine is not None else None
    return {
        "enabled": service.router.config.max_remote_attempts > 0,
        "views": views_status(service.views),
        "queue_depth": local.queue_depth if local else None,
        "push_back": local.push_back if local else None,
        "cached_tokens": service.engine.tree.num_tokens if service.engine is not None else None,
        # What the router learned online: the network cost of forwards and each peer's
        # cache-claim confidence; and the completion lengths its estimates expect.
        "learned": {
            **service.router.learned(),
            "lengths": service.lengths.as_dict(),
            "sessions": service.sessions.as_dict(),
        },
        "probation": probation_status(service),
        "gossip": service.antientropy.status(),
    }


def probation_status(service: _AuditedService) -> dict[str, Any] | None:
    """Which peers still have their answers held for audit, and the known-answer challenges
    sent to get them out (overlay/trust/challenge.py)."""
    auditor, probation = service.auditor, service.probation
    if auditor is None:
        return None
    peers = sorted({v.peer_id for v in service.views.views()} | auditor.by_peer.keys())
    none = {"passed": 0, "failed": 0, "skipped": 0}
    return {
        "answers_needed": auditor.config.probation_answers,
        "on_probation": [p for p in peers if auditor.on_probation(p)],
        "challenges": dict(probation.counts) if probation is not None else None,
        "audits": dict(auditor.counts),
        # Per peer: member / probation (with passed audits so far) / trusted / demoted, and
        # this node's audits of its answers.
        "peers": {
            p: {
                "state": auditor.state(p),
                "passed_for_probation": service.trust.audited_ok(p),
                "audits": dict(auditor.by_peer.get(p, none)),
            }
            for p in peers
        },
    }


# Modules whose presence says what a node costs: an emulated node must load neither.
HEAVY_MODULES = ("torch", "transformers", "vllm")


def process_status() -> dict[str, Any]:
    """This process's resident memory and which heavy libraries it has imported (read from
    the process itself at each call, so trials and tests can check what a node really costs)."""
    import resource
    import sys

    rss_kb = None
    try:
        with open("/proc/self/status") as f:
            rss_kb = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
    except OSError:
        pass
    return {
        "rss_bytes": rss_kb * 1024 if rss_kb is not None else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "heavy_modules": [m for m in HEAVY_MODULES if m in sys.modules],
    }
