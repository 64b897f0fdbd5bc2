"""Anti-entropy's settings and counters (the behaviour they set is described in
``antientropy.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from p2pnode.overlay.cache.digest import DEFAULT_MAX_AGE_S

__all__ = [
    "EXPIRE_ROUNDS",
    "MAX_PULL_TIMEOUT_S",
    "PULL_ROUND_TRIPS",
    "RECORD_WAIT_S",
    "AntiEntropyConfig",
    "GossipMetrics",
]

# How long a peer that came up may take to hand us its signed record before we give up
# pulling its view on up (gossip and the silent-view pull still repair it).
RECORD_WAIT_S = 10.0
# A pull's round trips: its stream's negotiation, its request and answer, and one spare.
PULL_ROUND_TRIPS = 3.0
MAX_PULL_TIMEOUT_S = 60.0
# Publish intervals a view may stay silent before it expires: past the silent pull
# (``silent_pull_rounds``) with room for that pull to be answered.
EXPIRE_ROUNDS = 9.0


@dataclass
class AntiEntropyConfig:
    interval_s: float = 1.0
    full_every: int = 10
    gossip_full_limit: int = 64 * 1024
    topic_budget_msgs_per_s: float = 5.0  # half of gossipsub's 10 msg/s cap: headroom
    pull_min_interval_s: float = 2.0
    pull_jitter_s: float = 0.3
    max_concurrent_pulls: int = 2
    change_poll_s: float = 0.05  # how soon a cache change (or push-back flip) is published
    publish_burst: int = 2  # messages a node may send ahead of its average rate
    quiet_rounds: int = 3  # rounds an unchanged node skips in a row (it publishes every 4th)
    # Pull a view heard nothing from for this many intervals: past a quiet origin's silence
    # (quiet_rounds + 1 of its intervals) with room for a receiver that counts fewer publishers,
    # so keeps shorter intervals, than the origin.
    silent_pull_rounds: float = 6.0
    pull_timeout_s: float = 5.0
    max_age_s: float = DEFAULT_MAX_AGE_S
    publisher_memory_s: float = 60.0

    def __post_init__(self) -> None:
        if self.interval_s < 0.05 or self.full_every < 1 or self.topic_budget_msgs_per_s <= 0:
            raise ValueError("anti-entropy needs interval_s >= 0.05, full_every >= 1, budget > 0")
        if self.max_concurrent_pulls < 1 or self.pull_jitter_s < 0:
            raise ValueError("anti-entropy needs max_concurrent_pulls >= 1 and pull_jitter_s >= 0")
        if self.silent_pull_rounds >= EXPIRE_ROUNDS:
            raise ValueError(
                f"silent_pull_rounds must stay below EXPIRE_ROUNDS ({EXPIRE_ROUNDS}): a view"
                " would expire before its silent pull"
            )
        if self.change_poll_s <= 0 or self.publish_burst < 1 or self.quiet_rounds < 0:
            raise ValueError(
                "anti-entropy needs change_poll_s > 0, publish_burst >= 1, quiet_rounds >= 0"
            )
        if self.silent_pull_rounds <= self.quiet_rounds + 1:
            raise ValueError("silent_pull_rounds must exceed a quiet origin's quiet_rounds + 1")


class GossipMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.received = Counter(
            "p2pnode_digest_received",
            "Digests received, by result",
            ["result", "source"],
            registry=registry,
        )
        self.dropped = Counter(
            "p2pnode_digest_dropped", "Digests refused, by reason", ["reason"], registry=registry
        )
        self.published = Counter(
            "p2pnode_digest_published", "Digests published, by kind", ["kind"], registry=registry
        )
        self.published_bytes = Counter(
            "p2pnode_digest_published_bytes", "Bytes of digests published", registry=registry
        )
        self.pulls = Counter(
            "p2pnode_digest_pulls", "Direct digest pulls, by result", ["result"], registry=registry
        )
