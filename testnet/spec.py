"""Trial specs: one TOML file describes a testnet trial (nodes, regions, links, workload, arms).

One file on purpose: the spec's dataclasses and the checks that read each table
into them sit side by side, so a key's type, bound, default and error message are read at once.

Contract:
- ``load_spec(path) -> TrialSpec`` / ``parse_spec(data, source=...) -> TrialSpec`` read a spec
  with ``tomllib`` into frozen dataclasses, validating everything; every problem raises
  ``SpecError`` naming the file and the key and saying what to write instead. Unknown keys are
  refused (a typo never silently falls back to a default).
- ``builtin_spec_path(name)`` finds a shipped spec (``specs/<name>.toml``); ``builtin_specs()``
  lists them.
- Layout of a spec (every table but ``[network]`` and ``[nodes]`` optional)::

    name = "paper-lan"          # default: the file's stem
    seed = 0
    compute = "emulated"        # "real" (the model runs) | "emulated" (calibrated delays)
    model = "default"
    arms = ["routing", "baseline"]   # routing on / off; each arm gets fresh nodes
    max_duration_s = 600        # hard bound of one arm's workload

    [network]
    regions = ["eu", "us"]
    kind = "closed"             # members by invite, trusted from their first answer; "open":
                                # every node a stranger to the others, on probation
    bandwidth_mbps = 0          # default of every link; 0 = unshaped
    [[network.links]]
    between = ["eu", "us"]      # unordered pair; same-region pairs default to 0 ms
    delay_ms = 40.0             # ONE-WAY delay; a round trip costs twice this
    bandwidth_mbps = 100        # optional, per connection

    [nodes]
    count = 4
    placement = ["eu", "us", "eu", "us"]   # or: distribution = {eu = 3, us = 1} (weights)
    bootstrap_region = "eu"                # default: the first region
    bootstraps = 1                         # >1: one bootstrap per region, the first region's first
    formation = "full"                     # or "settled": start once forming stops progressing
    formation_settle_s = 60                # ("settled") seconds without progress that end the wait

    [node]                      # settings every node gets (p2pnode join flags and defaults)
    pushback_threshold = 8
    gossip_interval = 1.0
    cache_budget_tokens = 32768
    max_batch = 4
    torch_threads = 1
    ping_interval = 1.0
    min_connections = 16        # a node above max_connections trims to this many
    max_connections = 24        # 0: every node connects to every other

    [workload]
    subjects = 8                # the first N subjects (sorted), or a list of names
    per_subject = 20            # question pool of each subject (MMLU test split, <= 100)
    popularity = "uniform"      # or "zipf" with zipf_s (> 0)
    zipf_s = 1.1
    requests = 200
    arrival = "poisson"         # "poisson" (rate_per_s) or "closed" (concurrency in flight)
    rate_per_s = 4.0
    concurrency = 8             # bound on requests in flight (both arrival modes)
    max_tokens = 1
    temperature = 0.0
    request_timeout_s = 120

    [[churn]]                   # optional: node index leaves or joins at a time
    at_s = 30.0
    action = "leave"            # "leave" (SIGTERM, clean stop) | "kill" (SIGKILL) | "join"
    node = 2                    # join: a departed node (same identity) or the next new index
    region = "eu"               # join of a NEW node only; default: the bootstrap region

    [[adversary]]               # optional: node index lies to the peers it serves
    node = 2
    kind = "wrong-output"       # "wrong-output" | "random-text" | "other-model" | "fake-cache"
    rate = 0.2                  # wrong-output only (default 0.05): share of tokens replaced
    forge_digest = true         # answer liars: also forge a tempting digest (as fake-cache)
- Adversaries (``testnet/adversary/trial.py`` says what each kind does; trial nodes wire it in
  through ``testnet/run/node.py``): one entry per node, an initial node, at least one node left
  honest; ``rate`` is refused for the kinds it means nothing to (they lie on every answer,
  or, fake-cache, on every digest). The trial report counts ``wrong_answers`` and
  ``liars_demoted`` (``testnet/adversary/liars.py``).
- Churn (testnet/workload/churn.py runs it): events apply in time order; a leave/kill needs a running
  node and must leave at least one running; a join restarts a departed node (same home, same
  peer id) or starts a new one, numbered ``count``, ``count + 1``, ... in join order.
- With ``distribution`` nodes are placed deterministically (largest remainder, then region
  order), so the same spec always yields the same placement.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from p2pnode.bootstrap.config import NodeSettings
from p2pnode.errors import P2PNodeError

COMPUTE_MODES = ("real", "emulated")
FORMATION_MODES = ("full", "settled")
ARMS = ("routing", "baseline")
POPULARITY = ("uniform", "zipf")
ARRIVALS = ("poisson", "closed")
WORKLOAD_KINDS = ("mmlu", "chat")
CHURN_ACTIONS = ("leave", "kill", "join")  # churn: "kill" = SIGKILL
ADVERSARY_KINDS = ("wrong-output", "random-text", "other-model", "fake-cache")
MAX_NODES = 256
MAX_REGIONS = 200  # each region gets its own 127.x.0.0/16 (see wan.py)


class SpecError(P2PNodeError, ValueError):
    """A trial spec is malformed; the message names the file and the key."""

    reason = "bad_spec"


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    delay_ms: float
    bandwidth_mbps: float  # 0: unshaped


@dataclass(frozen=True)
class Network:
    regions: tuple[str, ...]
    links: tuple[Link, ...]
    bandwidth_mbps: float = 0.0
    kind: str = "closed"  # "closed" | "open" (see the layout above)

    def link(self, a: str, b: str) -> Link:
        """The link between regions `a` and `b` (either order); same region: 0 ms default."""
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        if a == b and a in self.regions:
            return Link(a, a, 0.0, self.bandwidth_mbps)
        raise SpecError(f"no link between regions {a!r} and {b!r}")

    def delay_ms(self, a: str, b: str) -> float:
        return self.link(a, b).delay_ms


# A trial node's settings default to what `p2pnode join` would use (NodeSettings, which reads
# the engine's and the overlay's): one source of defaults.
_JOIN = NodeSettings()


@dataclass(frozen=True)
class NodeSettingsSpec:
    pushback_threshold: int = _JOIN.pushback_threshold
    gossip_interval: float = _JOIN.gossip_interval
    gossip_budget: float = _JOIN.gossip_budget
    gossip_degree: int = _JOIN.gossip_degree
    cache_budget_tokens: int = _JOIN.cache_budget_tokens
    max_batch: int = _JOIN.max_batch
    torch_threads: int = _JOIN.torch_threads
    ping_interval: float = _JOIN.ping_interval
    min_connections: int = _JOIN.min_connections
    max_connections: int = _JOIN.max_connections


@dataclass(frozen=True)
class Workload:
    # "mmlu": one-shot 5-shot MMLU prompts; "chat": sessions of growing histories that share a
    # few system prompts (testnet/workload/chat.py).
    kind: str = "mmlu"
    subjects: tuple[str, ...] | int = 8
    per_subject: int = 20
    popularity: str = "uniform"
    zipf_s: float = 1.1
    requests: int = 200
    arrival: str = "poisson"
    rate_per_s: float = 4.0
    concurrency: int = 8
    max_tokens: int = 1
    temperature: float = 0.0
    request_timeout_s: float = 120.0
    # chat only: sessions arrive at rate_per_s; each runs `turns` turns with exponential think
    # times of mean think_time_s, on one of `system_prompts` system prompts (by popularity).
    sessions: int = 40
    turns: int = 4
    system_prompts: int = 4
    think_time_s: float = 2.0

    @property
    def planned_requests(self) -> int:
        return self.sessions * self.turns if self.kind == "chat" else self.requests


@dataclass(frozen=True)
class ChurnEvent:
    at_s: float
    action: str
    node: int
    region: str | None = None  # churn: region of a NEW node (join past the initial count)


@dataclass(frozen=True)
class AdversarySpec:
    node: int
    kind: str
    rate: float | None = None  # wrong-output only: share of the served tokens replaced
    forge_digest: bool = False  # an answer liar that also advertises prefixes it lacks


@dataclass(frozen=True)
class TrialSpec:
    name: str
    path: Path | None
    seed: int
    compute: str
    model: str
    arms: tuple[str, ...]
    max_duration_s: float
    network: Network
    placement: tuple[str, ...]  # region of node i
    bootstrap_region: str
    node: NodeSettingsSpec
    workload: Workload
    churn: tuple[ChurnEvent, ...] = field(default=())
    adversaries: tuple[AdversarySpec, ...] = field(default=())
    bootstraps: int = 1
    # "full": the workload waits until the overlay has formed (launch.py fails the arm at its
    # start limit otherwise). "settled": it starts once every node serves and the formation
    # deficit has not fallen for formation_settle_s, recording how far the overlay got; a
    # public swarm never waits for itself to finish forming, and on a few shared cores a big
    # one may never get there.
    formation: str = "full"
    formation_settle_s: float = 60.0

    def bootstrap_regions(self) -> list[str]:
        """Region of each bootstrap node: ``bootstrap_region`` first, then the other regions
        in order, round-robin (a public network runs several, joiners use a near one)."""
        order = [self.bootstrap_region] + [
            r for r in self.network.regions if r != self.bootstrap_region
        ]
        return [order[k % len(order)] for k in range(self.bootstraps)]

    def bootstrap_of(self, region: str) -> int:
        """Index of the bootstrap a node of ``region`` joins through: the first in its region,
        else the first of all."""
        regions = self.bootstrap_regions()
        return regions.index(region) if region in regions else 0

    def adversary_of(self, node: int) -> AdversarySpec | None:
        return next((a for a in self.adversaries if a.node == node), None)

    def churn_new_nodes(self) -> list[tuple[int, str]]:
        """Churn: (index, region) of every node a join event adds past the initial count."""
        return [
            (e.node, e.region or self.bootstrap_region)
            for e in self.churn
            if e.action == "join" and e.node >= self.node_count
        ]

    @property
    def node_count(self) -> int:
        return len(self.placement)

    @property
    def backend(self) -> str:
        """The node's --backend for this spec's compute mode."""
        return "hf" if self.compute == "real" else "emulated"

    def max_delay_ms(self) -> float:
        return max((link.delay_ms for link in self.network.links), default=0.0)


# --------------------------------------------------------------------------- parsing helpers


class _Table:
    """A TOML table being consumed: typed getters that name the key on error."""

    def __init__(self, data: Any, where: str, source: str) -> None:
        if not isinstance(data, Mapping):
            raise SpecError(f"{source}: [{where}] must be a table, got {type(data).__name__}")
        self.data = dict(data)
        self.where = where
        self.source = source
        self.used: set[str] = set()

    def _key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, message: str) -> SpecError:
        return SpecError(f"{self.source}: {self._key(key)}: {message}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.data.get(key, default)

    def str_(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        value = self.raw(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(key, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def int_(self, key: str, default: int | None = None, lo: int = 0, hi: int = 2**31) -> int:
        value = self.raw(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(key, f"must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise self.fail(key, f"must be between {lo} and {hi}, got {value}")
        return value

    def float_(
        self, key: str, default: float | None = None, lo: float = 0.0, hi: float = math.inf
    ) -> float:
        value = self.raw(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(key, f"must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value) or not lo <= value <= hi:
            raise self.fail(key, f"must be between {lo:g} and {hi:g}, got {value:g}")
        return value

    def str_list(self, key: str, default: list[str] | None = None) -> tuple[str, ...]:
        value = self.raw(key, default)
        if value is None:
            raise self.fail(key, "is required")
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise self.fail(key, f"must be a list of non-empty strings, got {value!r}")
        return tuple(value)

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            known = ", ".join(sorted(self.used))
            raise SpecError(
                f"{self.source}: unknown key(s) {', '.join(self._key(k) for k in unknown)}"
                f" (known here: {known})"
            )


def _network(table: _Table) -> Network:
    regions = table.str_list("regions")
    if not 1 <= len(regions) <= MAX_REGIONS:
        raise table.fail("regions", f"give 1 to {MAX_REGIONS} regions")
    if len(set(regions)) != len(regions):
        raise table.fail("regions", f"duplicate region names in {list(regions)}")
    default_bw = table.float_("bandwidth_mbps", 0.0, 0.0, 1e6)
    kind = table.str_("kind", "closed", ("closed", "open"))
    raw_links = table.raw("links", [])
    if not isinstance(raw_links, list):
        raise table.fail("links", "must be an array of tables ([[network.links]])")
    links: list[Link] = []
    seen: set[frozenset[str]] = set()
    for i, raw in enumerate(raw_links):
        t = _Table(raw, f"network.links[{i}]", table.source)
        between = t.str_list("between")
        if len(between) != 2:
            raise t.fail("between", f"must name exactly two regions, got {list(between)}")
        for region in between:
            if region not in regions:
                raise t.fail("between", f"{region!r} is not in network.regions {list(regions)}")
        pair = frozenset(between)
        if pair in seen:
            raise t.fail("between", f"link {sorted(pair)} is given twice")
        seen.add(pair)
        delay = t.float_("delay_ms", None, 0.0, 60_000.0)
        bandwidth = t.float_("bandwidth_mbps", default_bw, 0.0, 1e6)
        t.finish()
        links.append(Link(between[0], between[1], delay, bandwidth))
    missing = [
        f"{a}-{b}"
        for i, a in enumerate(regions)
        for b in regions[i + 1 :]
        if frozenset((a, b)) not in seen
    ]
    if missing:
        raise table.fail(
            "links",
            f"no delay given between {', '.join(missing)}: add a [[network.links]] with "
            "between = [A, B] and delay_ms for every pair of different regions",
        )
    table.finish()
    return Network(regions, tuple(links), default_bw, kind)


def _placement(
    table: _Table, regions: tuple[str, ...]
) -> tuple[tuple[str, ...], str, int, str, float]:
    count = table.int_("count", None, 1, MAX_NODES)
    has_list, has_dist = table.has("placement"), table.has("distribution")
    if has_list and has_dist:
        raise table.fail("placement", "give either placement or distribution, not both")
    if has_list:
        placement = table.str_list("placement")
        if len(placement) != count:
            raise table.fail(
                "placement", f"lists {len(placement)} regions but nodes.count is {count}"
            )
    elif has_dist:
        placement = _distribute(table, count, regions)
    elif len(regions) == 1:
        placement = (regions[0],) * count
    else:
        raise table.fail(
            "placement",
            "with several regions, say where nodes go: placement = [one region per node] or "
            "distribution = {region = weight, ...}",
        )
    for region in placement:
        if region not in regions:
            raise table.fail("placement", f"{region!r} is not in network.regions {list(regions)}")
    bootstrap_region = table.str_("bootstrap_region", regions[0])
    if bootstrap_region not in regions:
        raise table.fail("bootstrap_region", f"{bootstrap_region!r} is not in network.regions")
    bootstraps = table.int_("bootstraps", 1, 1, 16)
    formation = table.str_("formation", "full", FORMATION_MODES)
    settle_s = table.float_("formation_settle_s", 60.0, 5.0, 3600.0)
    table.finish()
    return placement, bootstrap_region, bootstraps, formation, settle_s


def _distribute(table: _Table, count: int, regions: tuple[str, ...]) -> tuple[str, ...]:
    dist = table.raw("distribution")
    if not isinstance(dist, Mapping) or not dist:
        raise table.fail("distribution", "must be a table {region = weight, ...}")
    weights: dict[str, float] = {}
    for region, weight in dist.items():
        if region not in regions:
            raise table.fail("distribution", f"{region!r} is not in network.regions")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or weight < 0:
            raise table.fail("distribution", f"weight of {region!r} must be a number >= 0")
        weights[region] = float(weight)
    total = sum(weights.values())
    if total <= 0:
        raise table.fail("distribution", "weights must not all be zero")
    exact = {r: count * w / total for r, w in weights.items()}
    counts = {r: int(math.floor(x)) for r, x in exact.items()}
    order = sorted(exact, key=lambda r: (-(exact[r] - counts[r]), regions.index(r)))
    for r in order[: count - sum(counts.values())]:
        counts[r] += 1
    # Interleave regions so node i's region does not depend on which indices churn touches.
    out: list[str] = []
    while len(out) < count:
        for r in regions:
            if counts.get(r, 0) > 0:
                out.append(r)
                counts[r] -= 1
    return tuple(out)


def _node_settings(table: _Table) -> NodeSettingsSpec:
    d = NodeSettingsSpec()
    out = NodeSettingsSpec(
        pushback_threshold=table.int_("pushback_threshold", d.pushback_threshold, 1, 100_000),
        gossip_interval=table.float_("gossip_interval", d.gossip_interval, 0.05, 600.0),
        gossip_budget=table.float_("gossip_budget", d.gossip_budget, 0.1, 9.0),
        gossip_degree=table.int_("gossip_degree", d.gossip_degree, 2, 12),
        cache_budget_tokens=table.int_("cache_budget_tokens", d.cache_budget_tokens, 16, 1 << 30),
        max_batch=table.int_("max_batch", d.max_batch, 1, 1024),
        torch_threads=table.int_("torch_threads", d.torch_threads, 1, 256),
        ping_interval=table.float_("ping_interval", d.ping_interval, 0.05, 600.0),
        min_connections=table.int_("min_connections", d.min_connections, 3, 100_000),
        max_connections=table.int_("max_connections", d.max_connections, 0, 100_000),
    )
    if out.max_connections and out.min_connections > out.max_connections:
        raise SpecError(
            f"[node] min_connections ({out.min_connections}) exceeds max_connections "
            f"({out.max_connections}); 0 max_connections means unbounded"
        )
    table.finish()
    return out


def _workload(table: _Table) -> Workload:
    d = Workload()
    raw_subjects = table.raw("subjects", d.subjects)
    subjects: tuple[str, ...] | int
    if isinstance(raw_subjects, int) and not isinstance(raw_subjects, bool):
        if not 1 <= raw_subjects <= 57:
            raise table.fail("subjects", f"MMLU has 57 subjects, got {raw_subjects}")
        subjects = raw_subjects
    elif isinstance(raw_subjects, list) and raw_subjects:
        subjects = table.str_list("subjects")
        if len(set(subjects)) != len(subjects):
            raise table.fail("subjects", "lists a subject twice")
    else:
        raise table.fail("subjects", "must be a count (1-57) or a list of MMLU subject names")
    out = Workload(
        kind=table.str_("kind", d.kind, WORKLOAD_KINDS),
        sessions=table.int_("sessions", d.sessions, 1, 100_000),
        turns=table.int_("turns", d.turns, 1, 64),
        system_prompts=table.int_("system_prompts", d.system_prompts, 1, 57),
        think_time_s=table.float_("think_time_s", d.think_time_s, 0.0, 3600.0),
        subjects=subjects,
        per_subject=table.int_("per_subject", d.per_subject, 1, 100),
        popularity=table.str_("popularity", d.popularity, POPULARITY),
        zipf_s=table.float_("zipf_s", d.zipf_s, 0.0, 10.0),
        requests=table.int_("requests", d.requests, 1, 1_000_000),
        arrival=table.str_("arrival", d.arrival, ARRIVALS),
        rate_per_s=table.float_("rate_per_s", d.rate_per_s, 1e-3, 10_000.0),
        concurrency=table.int_("concurrency", d.concurrency, 1, 4096),
        max_tokens=table.int_("max_tokens", d.max_tokens, 1, 4096),
        temperature=table.float_("temperature", d.temperature, 0.0, 2.0),
        request_timeout_s=table.float_("request_timeout_s", d.request_timeout_s, 0.1, 3600.0),
    )
    if out.popularity == "zipf" and out.zipf_s <= 0:
        raise table.fail("zipf_s", "must be > 0 for popularity = 'zipf'")
    table.finish()
    return out


def _churn(
    raw: Any, source: str, count: int, regions: tuple[str, ...] = ()
) -> tuple[ChurnEvent, ...]:
    """Churn events, checked in time order against which nodes run at that moment."""
    if not isinstance(raw, list):
        raise SpecError(f"{source}: churn must be an array of tables ([[churn]])")
    parsed = []
    for i, item in enumerate(raw):
        t = _Table(item, f"churn[{i}]", source)
        event = ChurnEvent(
            at_s=t.float_("at_s", None, 0.0, 86_400.0),
            action=t.str_("action", None, CHURN_ACTIONS),
            node=t.int_("node", None, 0, count + MAX_NODES),
            region=t.str_("region") if t.has("region") else None,
        )
        t.finish()
        parsed.append((event, t))
    parsed.sort(key=lambda pair: pair[0].at_s)  # stable: equal times keep file order
    running, next_new = set(range(count)), count
    for event, t in parsed:
        if event.region is not None and not (event.action == "join" and event.node >= count):
            raise t.fail("region", "only a join of a new node (node >= nodes.count) takes region")
        if event.region is not None and regions and event.region not in regions:
            raise t.fail("region", f"{event.region!r} is not in network.regions {list(regions)}")
        if event.action in ("leave", "kill"):
            if event.node not in running:
                raise t.fail(
                    "node",
                    f"node {event.node} is not running at {event.at_s:g} s "
                    f"(running then: {sorted(running)})",
                )
            if len(running) == 1:
                raise t.fail("node", "the last running node cannot leave: requests need one")
            running.discard(event.node)
        elif event.node in running:
            raise t.fail("node", f"node {event.node} is already running at {event.at_s:g} s")
        elif event.node > next_new:
            raise t.fail(
                "node", f"a new node must take the next index, {next_new}, not {event.node}"
            )
        else:
            running.add(event.node)
            next_new += event.node == next_new
    return tuple(event for event, _ in parsed)


def _adversaries(raw: Any, source: str, count: int) -> tuple[AdversarySpec, ...]:
    if not isinstance(raw, list):
        raise SpecError(f"{source}: adversary must be an array of tables ([[adversary]])")
    out: list[AdversarySpec] = []
    for i, item in enumerate(raw):
        t = _Table(item, f"adversary[{i}]", source)
        node = t.int_("node", None, 0, count - 1)
        kind = t.str_("kind", None, ADVERSARY_KINDS)
        if t.has("rate") and kind != "wrong-output":
            raise t.fail("rate", f"only kind = 'wrong-output' takes a rate ({kind} lies always)")
        rate = t.float_("rate", 0.05, 1e-6, 1.0) if kind == "wrong-output" else None
        forge = t.raw("forge_digest", False)
        if not isinstance(forge, bool):
            raise t.fail("forge_digest", f"must be true or false, got {forge!r}")
        if forge and kind == "fake-cache":
            raise t.fail("forge_digest", "fake-cache forges its digest anyway: leave it out")
        t.finish()
        if any(a.node == node for a in out):
            raise t.fail("node", f"node {node} is already an adversary: one kind per node")
        out.append(AdversarySpec(node, kind, rate, forge))
    if out and len(out) >= count:
        raise SpecError(
            f"{source}: every node is an adversary: leave at least one honest node (its "
            "answers are the ones the report compares against)"
        )
    return tuple(out)


def parse_spec(data: Mapping[str, Any], *, source: str = "<spec>", path: Path | None = None):
    """Validate an already-parsed TOML document into a `TrialSpec` (`SpecError` when bad)."""
    top = _Table(data, "", source)
    name = top.str_("name", path.stem if path else "trial")
    seed = top.int_("seed", 0, 0, 2**63 - 1)
    compute = top.str_("compute", "emulated", COMPUTE_MODES)
    model = top.str_("model", "default")
    arms = top.str_list("arms", list(ARMS))
    if not arms or len(set(arms)) != len(arms) or any(a not in ARMS for a in arms):
        raise top.fail("arms", f"must be a non-empty subset of {list(ARMS)}, got {list(arms)}")
    max_duration_s = top.float_("max_duration_s", 600.0, 1.0, 86_400.0)
    if "network" not in data:
        raise SpecError(f"{source}: missing [network] table (regions and their links)")
    network = _network(_Table(top.raw("network"), "network", source))
    if "nodes" not in data:
        raise SpecError(f"{source}: missing [nodes] table (count = N)")
    placement, bootstrap_region, bootstraps, formation, settle_s = _placement(
        _Table(top.raw("nodes"), "nodes", source), network.regions
    )
    node = _node_settings(_Table(top.raw("node", {}), "node", source))
    workload = _workload(_Table(top.raw("workload", {}), "workload", source))
    churn = _churn(top.raw("churn", []), source, len(placement), network.regions)
    adversaries = _adversaries(top.raw("adversary", []), source, len(placement))
    top.finish()
    if bootstraps > 1 and any(e.action == "join" and e.node >= len(placement) for e in churn):
        raise SpecError(
            f"{source}: churn that adds new nodes needs nodes.bootstraps = 1 (their addresses "
            "follow the initial nodes and the one bootstrap of their region)"
        )
    if compute == "real" and len(placement) > 8:
        raise SpecError(
            f"{source}: compute = 'real' with {len(placement)} nodes will not fit on a few "
            "shared cores; use compute = 'emulated' or at most 8 nodes"
        )
    return TrialSpec(
        name=name,
        path=path,
        seed=seed,
        compute=compute,
        model=model,
        arms=arms,
        max_duration_s=max_duration_s,
        network=network,
        placement=placement,
        bootstrap_region=bootstrap_region,
        node=node,
        workload=workload,
        churn=churn,
        adversaries=adversaries,
        bootstraps=bootstraps,
        formation=formation,
        formation_settle_s=settle_s,
    )


def load_spec(path: str | Path) -> TrialSpec:
    """Read and validate a trial spec file (`SpecError` with file and key when bad)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        names = ", ".join(builtin_specs())
        raise SpecError(f"trial spec {path} does not exist (shipped specs: {names})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from None
    return parse_spec(data, source=str(path), path=path.resolve())


def _specs_dir() -> Path:
    return Path(str(resources.files("p2pnode.testnet") / "specs"))


def builtin_specs() -> list[str]:
    return sorted(p.stem for p in _specs_dir().glob("*.toml"))


def builtin_spec_path(name: str) -> Path:
    """Path of a shipped spec by name (``paper-lan``) or the given path when it is a file."""
    if Path(name).is_file():
        return Path(name)
    path = _specs_dir() / f"{Path(name).stem}.toml"
    if not path.is_file():
        raise SpecError(f"no spec {name!r}; shipped specs: {', '.join(builtin_specs())}")
    return path
