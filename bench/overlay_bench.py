"""Overlay benchmark on loopback: join-to-full-view, DHT lookups, RPC round trip, throughput.

Run: `python bench/overlay_bench.py [--nodes 16] [--lookups 30]`; prints the figures and writes
bench/results/overlay.json. All nodes share one process (one trio loop): on a busy 2-core
machine this measures the loop's contention as much as the network code. Also reported: the
1-minute load average at start and end, the process CPU share during the join, and the
overlay's own cost counters (probes, probe stream opens, misses, DHT lookups, dials, record
fetches; summed over nodes) per second of the join.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import trio

from p2pnode.identity import NodeKey
from p2pnode.overlay import OverlayConfig, PeerState, open_overlay_node
from p2pnode.overlay.wire import PROTOCOL_LIMITS, read_frame, write_frame

BENCH = "/p2pnode/bench/1"
LIMIT = PROTOCOL_LIMITS[BENCH]
RESULTS = Path(__file__).resolve().parent / "results" / "overlay.json"


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
    }


def _sees_all(nodes) -> bool:
    for node in nodes:
        for other in nodes:
            if other is node:
                continue
            entry = node.peers.get(other.peer_id)
            if entry is None or entry.state is PeerState.DOWN or entry.record is None:
                return False
    return True


async def bench(n_nodes: int, lookups: int) -> dict:
    out: dict = {
        "nodes": n_nodes,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
    }
    cpu_started = time.process_time()
    async with contextlib.AsyncExitStack() as stack:
        started = time.perf_counter()
        nodes = []
        for i in range(n_nodes):
            cfg = OverlayConfig(
                key=NodeKey.generate(),
                bootstrap=[nodes[0].addrs[0]] if nodes else [],
                models=[f"model-{i % 4}"],
                ping_interval=2.0,
                ping_timeout=3.0,  # many nodes in one loop: see the module docstring
            )
            nodes.append(await stack.enter_async_context(open_overlay_node(cfg)))
        out["start_all_s"] = round(time.perf_counter() - started, 3)
        print("started", out["start_all_s"], flush=True)
        with trio.move_on_after(120) as scope:
            while not _sees_all(nodes):  # noqa: ASYNC110
                await trio.sleep(0.05)
        out["join_to_full_view_s"] = (
            None if scope.cancelled_caught else round(time.perf_counter() - started, 3)
        )
        print("full view", out["join_to_full_view_s"], flush=True)
        joined = time.perf_counter() - started
        out["join_cpu_share"] = round((time.process_time() - cpu_started) / joined, 2)
        totals: Counter[str] = Counter()
        for node in nodes:
            totals.update(node.counters)
        out["join_cost_per_s"] = {k: round(v / joined, 2) for k, v in sorted(totals.items())}
        out["missing_views_at_end_of_join"] = sum(
            1
            for node in nodes
            for other in nodes
            if other is not node
            and (
                (e := node.peers.get(other.peer_id)) is None
                or e.state is PeerState.DOWN
                or e.record is None
            )
        )
        with trio.move_on_after(60):
            for node in nodes:
                await node.wait_announced()

        a, b = nodes[1], nodes[-1]
        prov, rec_direct, rec_dht = [], [], []
        for i in range(lookups):
            t = time.perf_counter()
            with trio.fail_after(20):
                await nodes[i % n_nodes].find_providers(f"model-{i % 4}")
            prov.append(time.perf_counter() - t)
            target = nodes[(i + 3) % n_nodes]
            t = time.perf_counter()
            with trio.fail_after(20):
                await a.dht.get_record(target.peer_id)
            rec_direct.append(time.perf_counter() - t)
            t = time.perf_counter()
            with trio.fail_after(20):
                await a.dht.get_record(target.peer_id, direct=False)
            rec_dht.append(time.perf_counter() - t)
        out["find_providers"] = _stats(prov)
        out["get_node_record_direct"] = _stats(rec_direct)
        out["get_node_record_dht_walk"] = _stats(rec_dht)

        async def echo(stream) -> None:
            while (frame := await read_frame(stream, limit=LIMIT)) is not None:
                await write_frame(stream, frame, limit=LIMIT)

        b.set_stream_handler(BENCH, echo)
        stream = await a.open_stream(b.peer_id, BENCH)
        small = b"x" * 1024
        rtts = []
        for _ in range(200):
            t = time.perf_counter()
            await write_frame(stream, small, limit=LIMIT)
            await read_frame(stream, limit=LIMIT)
            rtts.append(time.perf_counter() - t)
        out["rpc_1kb_persistent_stream"] = _stats(rtts)
        big = b"y" * (1 << 20)
        t = time.perf_counter()
        rounds = 20
        for _ in range(rounds):
            await write_frame(stream, big, limit=LIMIT)
            await read_frame(stream, limit=LIMIT)
        elapsed = time.perf_counter() - t
        # Echo: every MiB crosses the link twice.
        out["throughput_1mb_echo_mib_s"] = round(2 * rounds / elapsed, 1)
        await stream.close()
    out["load_avg_1m_at_end"] = os.getloadavg()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--lookups", type=int, default=30)
    args = parser.parse_args()
    result = trio.run(bench, args.nodes, args.lookups)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
