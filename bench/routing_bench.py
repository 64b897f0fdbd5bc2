"""Routing benchmark: decision time, digest sizes, digest propagation, a skewed MMLU run.

Run: ``python bench/routing_bench.py [--sections decision,digest,propagation,mmlu]
[--nodes 16] [--requests 160] [--rate 3.0] [--zipf 1.2] [--policies off,cache_only,on]``.
Prints the figures and writes ``bench/results/routing.json`` (one key per section and
setting; sections not run keep their previous figures). About 2 min per MMLU policy.
Environment: ``ROUTING_BENCH_READY_S`` bounds the propagation setup's wait for complete views
(default 90 s; it then goes on and reports the coverage), ``ROUTING_BENCH_PROFILE=<worker>``
prints a cProfile of that propagation worker after 90 s.

- decision: ``Router.decide`` with 64 peer views x 100,000 cached blocks each (32-bit
  fingerprints, 8 peers holding 4..32 blocks of the 512-token prompt), wall and thread-CPU time
  per decision (median, p90, p99), with the decision log off and on, plus the prompt hashing.
- digest: sealed (signed) digest bytes per cached block, full and delta (a round where one
  512-token prompt is stored and 32 old blocks are evicted), and an empty heartbeat delta.
- propagation: ``--nodes`` real overlay nodes on loopback in 4 worker processes, each with a
  ``RoutedService`` over an emulated engine; one node caches a new 256-token prompt; time until
  all the others' views hold it (6 trials, origins rotating).
- mmlu: 4 real overlay nodes on loopback, emulated compute (the engines sleep what the cost model
  of SmolLM2-135M on 2 CPU threads predicts: 1/430 s per prefill token, 1/16 s per decode token,
  with the real radix caches and LRU eviction); MMLU 5-shot prompts from ``datasets/mmlu.py``
  tokenized with the real tokenizer; subjects drawn from a Zipf law, Poisson arrivals at random
  origins, one generated token. Per policy: token hit rate, mean/p50/p95 latency, busiest node's
  share of the served requests (also per window of 40 requests, to see specialization cycles)
  and the share of the top subject served by one node. Policies: ``off`` is
  ``max_remote_attempts=0`` (every request served where it arrives); ``cache_only`` ignores
  queues and push-back (longest cached prefix wins, the paper's starting point); ``on`` is ours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import BlockRemoved, BlockStored, block_hashes, model_salt
from p2pnode.inference.models import ShapeOnlyModel
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.cache.digest import Digest, DigestBuilder, LoadInfo, fingerprint, seal_digest
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.routing.router import LocalState, Router, RouterConfig
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.testing.localcluster import emulated_routed_services

RESULTS = Path(__file__).resolve().parent / "results" / "routing.json"
MODEL = "bench-model"
PREFILL_S = 1 / 430  # SmolLM2-135M fp32, 2 CPU threads (shared/notes/models-and-data.md)
DECODE_S = 1 / 16
OVERHEAD_S = 0.01
LOAD = LoadInfo(0, 0.0, False, PREFILL_S, DECODE_S)

logging.getLogger("libp2p").setLevel(logging.CRITICAL)
log = logging.getLogger("routing_bench")


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms_stats(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "median_ms": round(1000 * statistics.median(samples), 4),
        "p90_ms": round(1000 * pct(samples, 0.9), 4),
        "p99_ms": round(1000 * pct(samples, 0.99), 4),
        "max_ms": round(1000 * max(samples), 4),
    }


# --------------------------------------------------------------------------- decision time


def bench_decision(peers: int, blocks: int, prompt_tokens: int, iterations: int) -> dict:
    rng = random.Random(7)
    salt = model_salt(MODEL)
    prompt = [rng.randrange(1, 49152) for _ in range(prompt_tokens)]
    hashes = block_hashes(prompt, salt)
    views = PeerViews()
    now = time.time()
    for i in range(peers):
        fps = {rng.getrandbits(32) for _ in range(blocks)}
        if i % 8 == 0:  # some peers hold part of the prompt: the scan walks real chains
            fps.update(fingerprint(h) for h in hashes[: 4 * (i // 8 + 1)])
        peer = f"peer-{i:02d}"
        views.apply(
            Digest(peer, MODEL, 1, 1, None, 32, frozenset(fps), frozenset(), False, LOAD, now)
        )
    router = Router(views, rtt_s=lambda peer: 0.02, registry=CollectorRegistry())
    local = LocalState(0, 0.0, PREFILL_S, DECODE_S, OVERHEAD_S)
    out: dict[str, Any] = {
        "peers": peers,
        "blocks_per_peer": blocks,
        "prompt_tokens": prompt_tokens,
    }

    def run(label: str) -> None:
        wall, cpu = [], []
        for _ in range(iterations):
            t0, c0 = time.perf_counter(), time.thread_time()
            router.decide(
                model_id=MODEL,
                prompt_block_hashes=hashes,
                prompt_tokens=prompt_tokens,
                max_tokens=1,
                local=local,
            )
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        out[label] = {"wall": ms_stats(wall), "thread_cpu": ms_stats(cpu)}

    run("decide")
    router_log = logging.getLogger("p2pnode.overlay.routing.router")
    router_log.setLevel(logging.INFO)
    router_log.addHandler(logging.NullHandler())  # the JSON line is built, then dropped
    router_log.propagate = False
    run("decide_with_log")
    router_log.setLevel(logging.WARNING)
    hash_s = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        block_hashes(prompt, salt)
        hash_s.append(time.perf_counter() - t0)
    out["prompt_hashing"] = ms_stats(hash_s)
    d = out["decide"]
    print(
        f"decision, {peers} peers x {blocks} blocks, {prompt_tokens}-token prompt: "
        f"median {d['wall']['median_ms']:.3f} ms, p99 {d['wall']['p99_ms']:.3f} ms wall "
        f"(thread CPU median {d['thread_cpu']['median_ms']:.3f}, p99 "
        f"{d['thread_cpu']['p99_ms']:.3f}); with the JSON log "
        f"{out['decide_with_log']['wall']['median_ms']:.3f} ms; hashing the prompt "
        f"{out['prompt_hashing']['median_ms']:.3f} ms"
    )
    return out


# --------------------------------------------------------------------------- digest sizes


def bench_digest(sizes: tuple[int, ...]) -> dict:
    rng = random.Random(11)
    key = NodeKey.generate()
    rows = []
    for n in sizes:
        b = DigestBuilder(key.peer_id, MODEL, load_fn=lambda: LOAD)
        held = [rng.getrandbits(64) for _ in range(n)]
        b.sync(held)
        full = len(seal_digest(key, b.full()))
        base = b.cut()
        heartbeat = len(seal_digest(key, b.delta_since(base)))
        b.on_event(BlockStored(tuple(rng.getrandbits(64) for _ in range(32)), None))
        b.on_event(BlockRemoved(tuple(held[:32])))
        delta = len(seal_digest(key, b.delta_since(base)))
        rows.append(
            {
                "cached_blocks": n,
                "full_bytes": full,
                "full_bytes_per_block": round(full / n, 3),
                "heartbeat_delta_bytes": heartbeat,
                "delta_bytes_32_stored_32_evicted": delta,
                "delta_bytes_per_changed_block": round((delta - heartbeat) / 64, 3),
            }
        )
        print(
            f"digest, {n} blocks: full {full} B ({full / n:.2f} B/block); delta of 64 changed "
            f"blocks {delta} B ({(delta - heartbeat) / 64:.2f} B/changed block over the "
            f"{heartbeat} B of an empty heartbeat delta)"
        )
    return {"fp_bits": 32, "sizes": rows}


# --------------------------------------------------------------------------- clusters


@dataclass
class Node:
    overlay: Any
    engine: Any
    service: RoutedService


@contextlib.asynccontextmanager
async def cluster(
    loaded: Any,
    n: int,
    *,
    router_config: RouterConfig | None = None,
    ae_config: AntiEntropyConfig | None = None,
    cache_budget_tokens: int = 20_000,
    pushback_high: int = 8,
    ping_interval: float = 1.0,
    bootstrap: str | None = None,
    expect_views: int | None = None,
    on_linked: Callable[[list[Any]], None] | None = None,
    discovery_interval: float = 0.5,
    ping_timeout: float = 5.0,
    gossip_heartbeat: float = 1.0,
    ready_timeout_s: float = 120.0,
) -> AsyncIterator[list[Node]]:
    """``n`` overlay nodes on 127.0.0.1 with emulated engines and running services, yielded
    once every node has a live view of ``expect_views`` peers (default: the ``n - 1`` others).
    With ``bootstrap`` all nodes join through it (an overlay spanning several processes)."""

    t_start = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        overlays = []
        for i in range(n):
            cfg = OverlayConfig(
                key=NodeKey.generate(),
                bootstrap=[bootstrap] if bootstrap else [overlays[0].addrs[0]] if i else [],
                ping_interval=ping_interval,
                discovery_interval=discovery_interval,
                discovery_max_interval=max(10.0, 6 * discovery_interval),
                # All nodes share one trio loop on 2 cores shared with other work: pings and
                # libp2p's health probes answer late, which one process per node would not see.
                ping_timeout=ping_timeout,
                health_ping_timeout=10.0,
                gossip_heartbeat=gossip_heartbeat,
            )
            overlays.append(await stack.enter_async_context(open_overlay_node(cfg)))
        # Gossip needs a connected overlay, not a full mesh (16 nodes in one loop take long to
        # dial each other): a few live links per node.
        with trio.fail_after(120):
            while not all(  # noqa: ASYNC110
                len(o.peers.up_peers()) >= min(n - 1, 3) for o in overlays
            ):
                await trio.sleep(0.1)
        log.info("%d nodes linked after %.1f s", n, time.perf_counter() - t_start)
        if on_linked is not None:
            on_linked(overlays)
        async with emulated_routed_services(
            overlays,
            model=loaded,
            prefill_s=PREFILL_S,
            decode_s=DECODE_S,
            cache_budget_tokens=cache_budget_tokens,
            router_config=router_config,
            antientropy_config=ae_config,
            pushback_high=pushback_high,
        ) as services:
            nodes = [
                Node(overlay, svc.engine, svc)
                for overlay, svc in zip(overlays, services, strict=True)
            ]
            want = n - 1 if expect_views is None else expect_views
            # Every node has a live view of every other; in a churning overlay (16 nodes on 2
            # busy cores) go on after ready_timeout_s with what there is, and say so.
            with trio.move_on_after(ready_timeout_s):
                last, lag = 0.0, 0.0
                while True:
                    counts = [len(x.service.views.live(x.service.model_id)) for x in nodes]
                    if min(counts) >= want:
                        break
                    if time.perf_counter() - last > 10:
                        last = time.perf_counter()
                        links = [len(x.overlay.peers.up_peers()) for x in nodes]
                        errors = Counter(
                            e["last_error"][:50]
                            for x in nodes
                            for e in x.overlay.peers.snapshot()
                            if e["state"] != "up"
                        )
                        log.info(
                            "views per node %s, live links %s, loop lag up to %.2f s; %s",
                            counts,
                            links,
                            lag,
                            dict(errors.most_common(3)),
                        )
                        lag = 0.0
                    t = time.perf_counter()
                    await trio.sleep(0.1)
                    lag = max(lag, time.perf_counter() - t - 0.1)
            counts = [len(x.service.views.live(x.service.model_id)) for x in nodes]
            log.info("views %s of %d after %.1f s", counts, want, time.perf_counter() - t_start)
            yield nodes
        await trio.sleep(1.0)  # digests in flight land before the nodes stop


# --------------------------------------------------------------------------- propagation


# 16 nodes in ONE process overloaded its trio loop (libp2p's yamux/pings, profiled at 100 % of
# the loop with no service running) and links kept dropping; so 4 worker processes of 4 nodes
# each, linked over loopback TCP like separate machines. Wall clocks are shared (one machine).
PROP_PROMPT_TOKENS = 256


def trial_prompt(seed: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(3, 49152) for _ in range(PROP_PROMPT_TOKENS)]


def propagation_worker(index: int, per_proc: int, total: int, bootstrap: str | None, conn) -> None:
    """Entry point of one worker process (spawned): runs ``per_proc`` nodes until told to stop."""
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    logging.lastResort = None
    progress = logging.StreamHandler()
    progress.setFormatter(logging.Formatter(f"  [%(asctime)s w{index}] %(message)s", "%H:%M:%S"))
    log.addHandler(progress)
    log.setLevel(logging.INFO)
    log.propagate = False
    if os.environ.get("ROUTING_BENCH_PROFILE") == str(index):  # where a worker's loop goes
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()

        async def limited() -> None:
            with trio.move_on_after(90):
                await _propagation_worker(index, per_proc, total, bootstrap, conn)

        try:
            trio.run(limited)
        finally:
            profile.disable()
            pstats.Stats(profile).sort_stats("cumtime").print_stats(40)
        return
    trio.run(_propagation_worker, index, per_proc, total, bootstrap, conn)


async def _propagation_worker(
    index: int, per_proc: int, total: int, bootstrap: str | None, conn
) -> None:
    parent = os.getppid()

    async def orphan_guard() -> None:  # the bench was killed: do not linger
        while os.getppid() == parent:  # noqa: ASYNC110
            await trio.sleep(1.0)
        raise SystemExit(f"worker {index}: the bench process is gone")

    async with trio.open_nursery() as guard:
        guard.start_soon(orphan_guard)
        await _run_worker_nodes(index, per_proc, total, bootstrap, conn)
        guard.cancel_scope.cancel()


async def _run_worker_nodes(
    index: int, per_proc: int, total: int, bootstrap: str | None, conn
) -> None:
    async with cluster(
        ShapeOnlyModel("bench-emulated-model", context_length=8192),
        per_proc,
        bootstrap=bootstrap,
        expect_views=total - 1,
        # 16 nodes x 15 links on 2 shared cores: ping less often, and slow the DHT discovery
        # (profiled: its walks took most of a worker's loop while late pings made peers flap).
        ping_interval=5.0,
        ping_timeout=10.0,
        discovery_interval=5.0,
        gossip_heartbeat=2.0,
        ready_timeout_s=float(os.environ.get("ROUTING_BENCH_READY_S", "90")),
        on_linked=lambda overlays: conn.send(("addr", overlays[0].addrs[0])),
    ) as nodes:
        coverage = [len(x.service.views.live(x.service.model_id)) for x in nodes]
        conn.send(("ready", [x.overlay.peer_id for x in nodes], coverage))
        by_peer = {x.overlay.peer_id: x for x in nodes}

        async def cache(peer_id: str, seed: int) -> None:
            await by_peer[peer_id].engine.generate(trial_prompt(seed), {"max_tokens": 1})
            conn.send(("cached", time.time()))

        async def watch(origin: str, seed: int) -> None:
            seen: dict[str, float] = {}
            watchers = [x for x in nodes if x.overlay.peer_id != origin]
            hashes = block_hashes(trial_prompt(seed), nodes[0].service.salt)
            with trio.move_on_after(60):
                while len(seen) < len(watchers):
                    for x in watchers:
                        pid = x.overlay.peer_id
                        if (
                            pid not in seen
                            and x.service.views.cached_prefix_tokens(
                                origin, hashes, x.service.model_id
                            )
                            >= PROP_PROMPT_TOKENS
                        ):
                            seen[pid] = time.time()
                    await trio.sleep(0.005)
            conn.send(("seen", seen, len(watchers)))

        async with trio.open_nursery() as tasks:
            while True:
                msg = await trio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
                if msg[0] == "stop":
                    tasks.cancel_scope.cancel()
                    break
                tasks.start_soon(cache if msg[0] == "cache" else watch, *msg[1:])


def bench_propagation(procs: int, per_proc: int, trials: int) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    total = procs * per_proc
    workers, pipes = [], []
    started = time.perf_counter()

    def spawn(i: int, bootstrap: str | None) -> None:
        here, there = ctx.Pipe()
        p = ctx.Process(
            target=propagation_worker, args=(i, per_proc, total, bootstrap, there), daemon=True
        )
        p.start()
        workers.append(p)
        pipes.append(here)

    def receive(i: int, timeout: float) -> Any:
        if not pipes[i].poll(timeout):
            raise TimeoutError(f"worker {i} said nothing for {timeout:.0f} s")
        return pipes[i].recv()

    try:
        spawn(0, None)  # its first node is everyone's bootstrap
        kind, bootstrap_addr = receive(0, 120)
        assert kind == "addr", kind
        for i in range(1, procs):
            spawn(i, bootstrap_addr)
        for i in range(1, procs):
            assert receive(i, 120)[0] == "addr"
        peer_ids: list[list[str]] = []
        coverage: list[int] = []
        for i in range(procs):
            kind, ids, views = receive(i, 300)
            assert kind == "ready", kind
            peer_ids.append(ids)
            coverage += views
        setup_s = time.perf_counter() - started
        log.info("%d nodes in %d processes ready after %.1f s", total, procs, setup_s)
        all_s, each_s, missed = [], [], 0
        for t in range(trials):
            origin_proc = t % procs
            origin = peer_ids[origin_proc][t % per_proc]
            for pipe in pipes:
                pipe.send(("watch", origin, t))
            pipes[origin_proc].send(("cache", origin, t))
            results = [receive(i, 90) for i in range(procs)]
            results += [receive(origin_proc, 90)]  # the origin worker sends two messages
            t0 = next(m[1] for m in results if m[0] == "cached")
            seen = [tt for m in results if m[0] == "seen" for tt in m[1].values()]
            missing = sum(m[2] - len(m[1]) for m in results if m[0] == "seen")
            missed += missing
            each_s += [x - t0 for x in seen]
            if not missing:
                all_s.append(max(seen) - t0)
            log.info("trial %d: %d nodes learnt it, %d not within 60 s", t, len(seen), missing)
            time.sleep(random.Random(t).uniform(0.5, 2.5))  # next change at another phase
    finally:
        for pipe in pipes:
            with contextlib.suppress(Exception):
                pipe.send(("stop",))
        for p in workers:
            p.join(15)
            if p.is_alive():
                p.terminate()
    out = {
        "nodes": total,
        "processes": procs,
        "trials": trials,
        "prompt_tokens": PROP_PROMPT_TOKENS,
        "setup_s": round(setup_s, 1),
        "views_per_node_at_start": coverage,
        "node_learnings_missed_within_60s": missed,
        "all_know_s": {
            "median": round(statistics.median(all_s), 3) if all_s else None,
            "max": round(max(all_s), 3) if all_s else None,
            "samples": [round(x, 3) for x in all_s],
            "complete_trials": len(all_s),
        },
        "per_node_s": {
            "median": round(statistics.median(each_s), 3) if each_s else None,
            "p90": round(pct(each_s, 0.9), 3) if each_s else None,
        },
    }
    print(
        f"propagation, {total} nodes ({procs} processes): all know a new prefix after median "
        f"{out['all_know_s']['median']} s, max {out['all_know_s']['max']} s over "
        f"{len(all_s)}/{trials} complete trials (per node median {out['per_node_s']['median']} s,"
        f" p90 {out['per_node_s']['p90']} s; {missed} node-learnings missed in 60 s; views at "
        f"start {coverage})"
    )
    return out


# --------------------------------------------------------------------------- skewed MMLU


@dataclass(frozen=True)
class Request:
    at_s: float
    origin: int
    subject: str
    prompt: tuple[int, ...]


def mmlu_workload(
    loaded: Any, n_requests: int, rate: float, n_nodes: int, n_subjects: int, zipf_s: float
) -> tuple[list[Request], dict[str, Any]]:
    from p2pnode.datasets.mmlu import build_prompt, load_split, subjects

    rng = random.Random(2024)
    names = [s for s in subjects() if len(load_split(s, "test")) >= 20]
    rng.shuffle(names)
    chosen = names[:n_subjects]
    weights = [1 / (k + 1) ** zipf_s for k in range(n_subjects)]
    tok = loaded.tokenizer
    prompts: dict[str, list[tuple[int, ...]]] = {}
    for s in chosen:
        rows = load_split(s, "test")[:20]
        prompts[s] = [tuple(tok.encode(build_prompt(s, r), add_special_tokens=False)) for r in rows]
    out, t = [], 0.0
    for _ in range(n_requests):
        t += rng.expovariate(rate)
        s = rng.choices(chosen, weights)[0]
        out.append(Request(t, rng.randrange(n_nodes), s, rng.choice(prompts[s])))
    total = sum(weights)
    info = {
        "subjects": chosen,
        "zipf_s": zipf_s,
        "subject_probabilities": [round(w / total, 3) for w in weights],
        "mean_prompt_tokens": round(statistics.mean(len(r.prompt) for r in out), 1),
    }
    return out, info


POLICIES: dict[str, dict[str, Any]] = {
    # Every request served where it arrives.
    "off": {"router": RouterConfig(max_remote_attempts=0)},
    # Longest estimated prefix wins, queues ignored, no push-back: the paper's starting point.
    "cache_only": {"router": RouterConfig(load_aware=False), "pushback_high": 10**6},
    # Ours: queue-aware estimates (advertised wait + our own in-flight requests), push-back at
    # 8 queued requests, confidence from real cached lengths.
    "on": {"router": RouterConfig()},
}


async def bench_mmlu_policy(
    loaded: Any, policy: str, workload: list[Request], n_nodes: int, cache_budget: int
) -> dict:
    spec = POLICIES[policy]
    records: list[dict[str, Any]] = []
    errors: list[str] = []
    async with cluster(
        loaded,
        n_nodes,
        router_config=spec["router"],
        cache_budget_tokens=cache_budget,
        pushback_high=spec.get("pushback_high", 8),
    ) as nodes:
        index = {x.overlay.peer_id: i for i, x in enumerate(nodes)}
        rtts = [
            e.rtt_ms
            for x in nodes
            for p in x.overlay.peers.up_peers()
            if (e := x.overlay.peers.get(p)) is not None and e.rtt_ms is not None
        ]

        async def one(req: Request) -> None:
            svc = nodes[req.origin].service
            t0 = time.perf_counter()
            try:
                res = await svc.generate(list(req.prompt), {"max_tokens": 1})
            except Exception as exc:  # counted and reported, never silently dropped
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            records.append(
                {
                    "done_s": time.perf_counter() - start,
                    "latency_s": time.perf_counter() - t0,
                    "subject": req.subject,
                    "origin": req.origin,
                    "served_by": req.origin if res.served_locally else index[res.served_by],
                    "prompt_tokens": res.prompt_tokens,
                    "cached_tokens": res.cached_tokens,
                    "fell_back": res.fell_back,
                    "reason": res.decision.reason,
                }
            )

        start = time.perf_counter()
        with trio.fail_after(workload[-1].at_s + 300):
            async with trio.open_nursery() as requests:
                for req in workload:
                    await trio.sleep(max(0.0, req.at_s - (time.perf_counter() - start)))
                    requests.start_soon(one, req)
        duration = time.perf_counter() - start
        evicted = [x.engine.tree.evicted_tokens for x in nodes]
    return summarize(policy, records, errors, duration, n_nodes, rtts, evicted)


def summarize(
    policy: str,
    records: list[dict[str, Any]],
    errors: list[str],
    duration: float,
    n_nodes: int,
    rtts: list[float],
    evicted: list[int],
) -> dict:
    served = Counter(r["served_by"] for r in records)
    lat = [r["latency_s"] for r in records]
    by_done = sorted(records, key=lambda r: r["done_s"])
    windows = []
    for i in range(0, len(by_done) - 39, 40):
        w = Counter(r["served_by"] for r in by_done[i : i + 40])
        windows.append(round(max(w.values()) / 40, 3))
    top_subject = Counter(r["subject"] for r in records).most_common(1)[0][0]
    top_served = Counter(r["served_by"] for r in records if r["subject"] == top_subject)
    out = {
        "policy": policy,
        "requests": len(records),
        "errors": len(errors),
        "error_samples": errors[:3],
        "duration_s": round(duration, 1),
        "token_hit_rate": round(
            sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records), 4
        ),
        "request_hit_rate": round(
            sum(r["cached_tokens"] >= r["prompt_tokens"] // 2 for r in records) / len(records), 4
        ),
        "latency_s": {
            "mean": round(statistics.mean(lat), 4),
            "p50": round(statistics.median(lat), 4),
            "p95": round(pct(lat, 0.95), 4),
        },
        "served_share": [round(served.get(i, 0) / len(records), 3) for i in range(n_nodes)],
        "busiest_share": round(max(served.values()) / len(records), 3),
        "busiest_share_per_40_requests": windows,
        "top_subject": top_subject,
        "top_subject_share_on_one_node": round(
            max(top_served.values()) / sum(top_served.values()), 3
        ),
        "forwarded_share": round(
            sum(r["served_by"] != r["origin"] for r in records) / len(records), 3
        ),
        "fell_back": sum(r["fell_back"] for r in records),
        "decision_reasons": dict(Counter(r["reason"] for r in records)),
        "evicted_tokens_per_node": evicted,
        "loopback_rtt_ms_mean": round(statistics.mean(rtts), 2) if rtts else None,
    }
    print(
        f"mmlu {policy:>6}: {out['requests']} req ({out['errors']} errors) in {out['duration_s']} s"
        f"; hit {100 * out['token_hit_rate']:.1f}% of tokens; latency mean "
        f"{out['latency_s']['mean']:.3f} s p95 {out['latency_s']['p95']:.3f} s; busiest node "
        f"{100 * out['busiest_share']:.0f}% (windows {out['busiest_share_per_40_requests']}); "
        f"forwarded {100 * out['forwarded_share']:.0f}%; served {out['served_share']}"
    )
    return out


async def bench_mmlu(loaded: Any, args: argparse.Namespace) -> dict:
    workload, info = mmlu_workload(loaded, args.requests, args.rate, 4, args.subjects, args.zipf)
    out: dict[str, Any] = {
        "nodes": 4,
        "compute": "emulated (cost model of SmolLM2-135M fp32 on 2 CPU threads)",
        "requests": args.requests,
        "arrival_rate_per_s": args.rate,
        "cache_budget_tokens_per_node": args.cache_budget,
        "max_tokens": 1,
        "workload": info,
        "policies": {},
    }
    print(
        f"mmlu workload: {args.requests} requests at {args.rate}/s over {args.subjects} subjects "
        f"(Zipf s={args.zipf}: p={info['subject_probabilities'][:4]}...), mean prompt "
        f"{info['mean_prompt_tokens']} tokens, cache budget {args.cache_budget} tokens/node"
    )
    for policy in args.policies.split(","):
        out["policies"][policy] = await bench_mmlu_policy(
            loaded, policy, workload, 4, args.cache_budget
        )
    return out


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> None:
    results: dict[str, Any] = {}
    if RESULTS.exists():
        with contextlib.suppress(ValueError):
            results = json.loads(RESULTS.read_text())
    sections = args.sections.split(",")
    if "decision" in sections:
        results["decision"] = bench_decision(64, 100_000, 512, args.iterations)
    if "digest" in sections:
        results["digest"] = bench_digest((1_000, 10_000, 100_000))
    loaded = None
    if "mmlu" in sections:
        from p2pnode.inference.models import load_model

        loaded = load_model(None)
    if "propagation" in sections:
        procs = 4
        results[f"propagation_{args.nodes}_nodes"] = await trio.to_thread.run_sync(
            bench_propagation, procs, args.nodes // procs, args.trials
        )
    if "mmlu" in sections:
        results[f"mmlu_rate{args.rate:g}_zipf{args.zipf:g}"] = await bench_mmlu(loaded, args)
    results["machine"] = {"cpu_count": os.cpu_count(), "load_avg_at_end": os.getloadavg()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="decision,digest,propagation,mmlu")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second, all nodes")
    parser.add_argument("--subjects", type=int, default=10)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--cache-budget", type=int, default=2400, help="tokens per node")
    parser.add_argument("--policies", default=",".join(POLICIES))
    progress = logging.StreamHandler()
    progress.setFormatter(logging.Formatter("  [%(asctime)s] %(message)s", "%H:%M:%S"))
    log.addHandler(progress)  # libp2p's own ERROR lines on dropped streams are not ours to show
    log.setLevel(logging.INFO)
    log.propagate = False
    logging.getLogger().addHandler(logging.NullHandler())
    logging.lastResort = None
    trio.run(main, parser.parse_args())
