"""Prometheus metrics of one node, all in the node's own registry (never the global one).

Contract:
- ``NodeMetrics(registry, *, node=None, engine=None, service=None)`` registers, in ``registry``:
  counters ``p2pnode_api_requests_total{endpoint,status}``, ``p2pnode_prompt_tokens_total``,
  ``p2pnode_generated_tokens_total`` and ``p2pnode_cached_prompt_tokens_total`` (by ``served``:
  ``local``, ``remote``, or ``unknown`` when a stop string cancelled the request); histograms
  ``p2pnode_time_to_first_token_seconds``, ``p2pnode_inter_token_latency_seconds`` and
  ``p2pnode_request_duration_seconds`` (measured at the HTTP API, routing and forwarding
  included); and one collector that reads live values at scrape time (see ``LiveCollector``),
  among them the verifier's counters (``p2pnode_verifier_*``: sessions, blocks, drafted and
  accepted tokens, lead tokens, prefill and prefix-cache tokens, committed tokens, whose rate is
  its tokens/s) once ``live.verifier`` is set.
- Counters owned elsewhere are NOT duplicated: the router (``p2pnode_routing_*``), forwarding
  (``p2pnode_forward_attempts``, ``p2pnode_forward_served``) and anti-entropy
  (``p2pnode_digest_*``, incl. ``p2pnode_digest_published_bytes``) register theirs in the same
  registry when it is the one given to ``RoutedService``.
- ``NodeMetrics`` can be built once per registry (prometheus refuses duplicate names).
- What it reads of the parts it is given is written down as Protocols: ``PeerSource`` (the
  overlay node), ``EngineGauges`` (either engine), ``ServiceGauges`` (``RoutedService``) and
  ``VerifierStats`` (``BatchedVerifier``). Tests may hand smaller stand-ins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, math.inf)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2, math.inf)
_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, math.inf)

if TYPE_CHECKING:
    from p2pnode.overlay.peers import PeerTable
    from p2pnode.overlay.routing.router import PushBack


class PeerSource(Protocol):
    """The overlay node, as ``p2pnode_peers`` reads it."""

    @property
    def peers(self) -> PeerTable: ...


class EngineGauges(Protocol):
    """An engine, as the engine gauges read it. One that keeps a radix prefix cache as ``tree``
    (``num_tokens``, ``evicted_tokens``; the CPU engine) adds the cache gauges; vLLM keeps its
    cache to itself."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def max_batch(self) -> int: ...


class ServiceGauges(Protocol):
    """The routed service, as the push-back and peer-view gauges read it."""

    @property
    def pushback(self) -> PushBack: ...

    @property
    def views(self) -> Sized: ...


class VerifierStats(Protocol):
    """The speculative verifier, as ``p2pnode_verifier_*`` reads it."""

    @property
    def stats(self) -> Mapping[str, int]: ...

    @property
    def sessions(self) -> Sized: ...


class LiveCollector(Collector):
    """Values owned by other parts, read when ``/metrics`` is scraped.

    Peers by state (``p2pnode_peers``), engine queue depth and batch limit, prefix-cache size
    and evicted tokens, push-back flag, peer views held, API requests in flight. Anything not
    wired (``None``) is simply left out.
    """

    def __init__(
        self,
        *,
        node: PeerSource | None = None,
        engine: EngineGauges | None = None,
        service: ServiceGauges | None = None,
        inflight: Callable[[], int] | None = None,
        verifier: VerifierStats | None = None,
    ) -> None:
        self.node = node
        self.engine = engine
        self.service = service
        self.inflight = inflight  # set by the API app
        self.verifier = verifier  # set once the node's verifier runs

    def collect(self) -> Iterator[Metric]:
        yield from self._peers()
        yield from self._engine()
        yield from self._service()
        yield from self._verifier()
        if self.inflight is not None:
            g = GaugeMetricFamily(
                "p2pnode_api_inflight_requests", "Completion requests being served by the API"
            )
            g.add_metric([], float(self.inflight()))
            yield g

    def _peers(self) -> Iterator[Metric]:
        if self.node is None:
            return
        from p2pnode.overlay.peers import PeerState

        g = GaugeMetricFamily("p2pnode_peers", "Known peers by liveness state", labels=["state"])
        for state in PeerState:
            g.add_metric([str(state)], float(len(self.node.peers.peer_ids(state))))
        yield g

    def _engine(self) -> Iterator[Metric]:
        e = self.engine
        if e is None:
            return
        depth = GaugeMetricFamily(
            "p2pnode_engine_queue_depth", "Requests in the engine (waiting + running)"
        )
        depth.add_metric([], float(e.queue_depth))
        yield depth
        batch = GaugeMetricFamily("p2pnode_engine_max_batch", "Requests the engine runs at once")
        batch.add_metric([], float(e.max_batch))
        yield batch
        tree = getattr(e, "tree", None)
        if tree is not None:
            cached = GaugeMetricFamily(
                "p2pnode_prefix_cache_tokens", "Tokens held in the radix prefix cache"
            )
            cached.add_metric([], float(tree.num_tokens))
            yield cached
            evicted = CounterMetricFamily(
                "p2pnode_prefix_cache_evicted_tokens", "Tokens evicted from the prefix cache"
            )
            evicted.add_metric([], float(tree.evicted_tokens))
            yield evicted

    def _service(self) -> Iterator[Metric]:
        s = self.service
        if s is None:
            return
        pushback = GaugeMetricFamily(
            "p2pnode_push_back", "1 while this node advertises push-back (queue over threshold)"
        )
        pushback.add_metric([], 1.0 if s.pushback.active else 0.0)
        yield pushback
        views = GaugeMetricFamily("p2pnode_peer_views", "Peer cache views held for routing")
        views.add_metric([], float(len(s.views)))
        yield views

    # BatchedVerifier.stats key -> (metric name, help)
    _VERIFIER_COUNTERS = (
        ("sessions", "p2pnode_verifier_sessions", "Verification sessions opened"),
        ("blocks", "p2pnode_verifier_blocks", "Draft blocks verified"),
        ("drafted", "p2pnode_verifier_drafted_tokens", "Draft tokens verified"),
        ("accepted", "p2pnode_verifier_accepted_tokens", "Draft tokens accepted"),
        ("lead", "p2pnode_verifier_lead_tokens", "Tokens the verifier committed ahead (lead)"),
        ("stale", "p2pnode_verifier_stale_blocks", "Blocks built on a stale base (no compute)"),
        (
            "lookup_guessed",
            "p2pnode_verifier_lookup_guessed_tokens",
            "Prompt-lookup guesses checked in lead steps",
        ),
        (
            "lookup_accepted",
            "p2pnode_verifier_lookup_accepted_tokens",
            "Prompt-lookup guesses accepted in lead steps",
        ),
        ("batches", "p2pnode_verifier_batches", "Batched target forward passes"),
        ("prefill_tokens", "p2pnode_verifier_prefill_tokens", "Prompt tokens prefilled"),
        (
            "prefix_hit_tokens",
            "p2pnode_verifier_prefix_hit_tokens",
            "Prompt tokens taken from the verifier's prefix cache",
        ),
    )

    def _verifier(self) -> Iterator[Metric]:
        v = self.verifier
        if v is None:
            return
        stats = v.stats
        for key, name, text in self._VERIFIER_COUNTERS:
            c = CounterMetricFamily(name, text)
            c.add_metric([], float(stats.get(key, 0)))
            yield c
        # Committed tokens (accepted + one target token per block + leads): rate() of it is
        # the verifier's tokens/s.
        c = CounterMetricFamily(
            "p2pnode_verifier_committed_tokens", "Tokens committed to sessions (rate: tokens/s)"
        )
        c.add_metric([], float(stats["accepted"] + stats["blocks"] + stats["lead"]))
        yield c
        g = GaugeMetricFamily("p2pnode_verifier_active_sessions", "Open verification sessions")
        g.add_metric([], float(len(v.sessions)))
        yield g


class NodeMetrics:
    """See the module contract."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        node: PeerSource | None = None,
        engine: EngineGauges | None = None,
        service: ServiceGauges | None = None,
    ) -> None:
        self.registry = registry
        self.requests = Counter(
            "p2pnode_api_requests",
            "HTTP API requests by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "p2pnode_prompt_tokens",
            "Prompt tokens of completed API requests",
            ["served"],
            registry=registry,
        )
        self.generated_tokens = Counter(
            "p2pnode_generated_tokens",
            "Tokens generated for API requests",
            ["served"],
            registry=registry,
        )
        self.cached_prompt_tokens = Counter(
            "p2pnode_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache (cache hits) on API requests",
            ["served"],
            registry=registry,
        )
        self.ttft = Histogram(
            "p2pnode_time_to_first_token_seconds",
            "From request arrival at the API to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "p2pnode_inter_token_latency_seconds",
            "Time between consecutive generated tokens seen by the API",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "p2pnode_request_duration_seconds",
            "From request arrival at the API to the last token",
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        self.live = LiveCollector(node=node, engine=engine, service=service)
        registry.register(self.live)

    def count_request(self, endpoint: str, status: int) -> None:
        """One finished HTTP request (499: the client went away mid-stream)."""
        self.requests.labels(endpoint, str(status)).inc()

    def observe_generation(
        self, *, local: bool | None, prompt_tokens: int, generated: int, cached_tokens: int
    ) -> None:
        """``local`` None: the answer was cut by a stop string before the router reported."""
        served = "unknown" if local is None else "local" if local else "remote"
        self.prompt_tokens.labels(served).inc(prompt_tokens)
        self.generated_tokens.labels(served).inc(generated)
        self.cached_prompt_tokens.labels(served).inc(cached_tokens)
