"""The simulator behind ``p2pnode simulate``: the real routing code on a simulated clock and
network (simpy).

What is real (imported and driven, not re-implemented): each node's exact radix prefix cache
(``inference/radix.py``, token structure, LRU eviction, block events), its ``DigestBuilder``
(``overlay/cache/digest.py``) turning those events into versioned digests, digests sealed with a real
node key and opened with ``open_digest`` (signature check, size limits: the bytes counted are
real), ``PeerViews.apply`` (``overlay/cache/views.py``: full/delta/gap semantics; a GAP is repaired
by a pull of a full digest, as anti-entropy does), ``PushBack`` and ``Router.decide``
(``overlay/routing/router.py``) with the router's in-flight and confidence feedback, ``ScopePolicy`` /
``ScopedViews`` / ``prefix_key`` (``overlay/cache/scope.py``). The workload is MMLU 5-shot prompts
(``datasets/mmlu.py``), tokenized by the model's tokenizer, Zipf popularity, Poisson arrivals
at uniformly random nodes.

What is simulated (stated so figures are read right):
- Network: nodes placed around 4 region centres; one-way delay = great-circle distance at fiber
  speed (200,000 km/s) + an access delay per end + exponential jitter per message. A forward
  costs what the entry router's network-cost model says (``overlay/routing/netcost.py``: its prior
  of 3 RTTs plus the request's bytes at 10 Mbit/s, as nothing is measured in the simulation).
- Compute: one request at a time per node (no batching), taking the cost model's time (the
  first token comes with the prefill, as in the engine; later ones take a decode step each);
  the advertised load is the exact backlog. Digests travel as gossip reaching every subscriber
  after the mean one-way delay (no per-receiver ordering; a receiver's own view of a peer
  is the shared one, so the simulation holds one copy of each view).
- Scoped views: a node applies only digests of its scope; digest traffic into a node is the
  sealed bytes of the publishers it keeps in view (as with per-scope topics or direct pushes),
  plus its share of the digests pulled after lookups. A prompt of at least ``key_blocks``
  blocks that no in-scope view holds beyond its first key block triggers prefix lookups when
  ``ScopePolicy.lookup_worth`` (simulated DHTs: ``ceil(log2 n) / 2`` hops, in the region's DHT
  at the node's mean RTT within its region, in the world's at its mean RTT to anyone; both
  start at once). The lookup runs beside the request, which has started on its first path; the
  holders found are pulled (their digest as of now) and admitted for the decision, and the
  request moves to the best of them if the router expects it to finish before what is left of
  the first path (``redirects``; the work done there is lost).
- Hot-prefix summary (``testnet/sim/hotprefix.py``, scoped views, ``SimConfig.hot``): each node
  counts the requests it served under each key; once per gossip interval every up node's table
  is merged (as an aggregation tree over the DHT would merge it) and the result reaches every
  node after ``2 * ceil(log2 n)`` one-way delays. A request with no in-scope holder of its key
  whose key the summary names pulls the ``hot_pull`` nearest holders' digests (one round trip)
  before it starts, when ``lookup_worth`` holds with that round trip as the lookup; otherwise
  the DHT lookup above. Each node is counted as receiving ``fanout + 1`` summaries per interval
  (real peer-id lengths) in the digest bytes, and one copy of it in the view memory.
- Churn: ``churn_per_min`` of the nodes leave per minute (cache lost) and come back at once
  with an empty cache; others see them down after ``detect_s``.

Figures per run (``SimResult``): digest bytes received per node per second, view memory per
node (fingerprints and view objects, bytes), routing decision time (wall clock of
``Router.decide``), token hit rate and its ceiling (one unbounded cache that saw every earlier
prompt), busiest node's share of requests, mean latency, and the same workload's mean latency
without routing (every request served where it arrives).

Map of the package (the face re-exports what other code uses; ``testnet/simulate.py`` is only
the ``python -m`` entry point):
- ``_config.py``: ``SimConfig`` (every knob), ``SimResult`` (one run's figures), ``MODEL_ID``.
- ``_world.py``: ``Network``, the simulated WAN (positions, great-circle RTTs, access delay,
  jitter, each node's scope and cell).
- ``_workload.py``: ``mmlu_prompts`` and the seeded Poisson arrivals.
- ``_node.py``: ``SimNode``, a node's real cache, digest builder, load and gossip.
- ``_lookup.py``: the simulated DHTs, the hot-prefix summary's aggregation and scoped views'
  prefix lookups and pulls (mixed into the run).
- ``_run.py``: ``Simulation`` (the event loop: requests, serving, churn) and ``simulate``.
- ``_metrics.py``: a finished run's figures.
- ``_report.py``: ``run_grid``, ``markdown_table``, ``plot``; ``_cli.py``: what
  ``p2pnode simulate`` runs (its flags: ``testnet/commands.py``).
"""

from __future__ import annotations

from p2pnode.testnet.sim._config import MODEL_ID, SimConfig, SimResult
from p2pnode.testnet.sim._node import SimNode
from p2pnode.testnet.sim._report import COLUMNS, as_row, markdown_table, plot, run_grid
from p2pnode.testnet.sim._run import Simulation, simulate
from p2pnode.testnet.sim._workload import mmlu_prompts
from p2pnode.testnet.sim._world import (
    EARTH_KM,
    FIBER_KM_PER_S,
    REGION_SHARE,
    REGIONS,
    Network,
)

__all__ = [
    "COLUMNS",
    "EARTH_KM",
    "FIBER_KM_PER_S",
    "MODEL_ID",
    "REGIONS",
    "REGION_SHARE",
    "Network",
    "SimConfig",
    "SimNode",
    "SimResult",
    "Simulation",
    "as_row",
    "markdown_table",
    "mmlu_prompts",
    "plot",
    "run_grid",
    "simulate",
]
