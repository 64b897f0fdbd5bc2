"""The swarm on a namespace testbed: join time, how pairs connect, relay vs direct cost.

For each size N (``--hosts 6,16``) it builds N hosts as network namespaces (testnet/netns/namespaces.py:
a public bootstrap, then public, NAT'd and port-randomizing-NAT'd hosts in the proportions of
``--layout``), starts ``p2pnode bootstrap`` and N-1 ``p2pnode join --invite ... --model
none`` processes (default flags otherwise, one OS process per host) and measures:
- seconds from the first join to every node seeing every other one up (full view);
- the share of peer pairs connected directly, hole-punched and relayed, once the
  reachability checks have settled and ``PUNCH_WINDOW_S`` after the full view, and how many
  pairs of two port-preserving NAT'd hosts are hole-punched then;
- the median ping RTT over direct, hole-punched and relayed connections (the nodes' tables).
Then, in one process on loopback (a relay R, a reserved node B, a client A), the round trip
of 1 KiB frames and the echo throughput of 1 MiB frames, A->B through the circuit vs A->R
direct, as ratios measured in the same run.
Needs root (namespaces) and iptables. Prints a table and writes bench/results/netns_swarm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

from p2pnode.identity import NodeKey
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.net.relay import open_relay
from p2pnode.overlay.wire import read_frame, write_frame
from p2pnode.testnet.netns.namespaces import Testbed, require_netns
from p2pnode.testnet.netns.swarm import NetnsSwarm

RESULTS = Path(__file__).parent / "results" / "netns_swarm.json"
BENCH = "/p2pnode/bench/1"
LIMIT = 16 << 20
SETTLE_LIMIT_S = 60.0
PUNCH_WINDOW_S = 60.0  # pairs are classified this long after the full view


def layout(n: int, nat_share: float, random_share: float) -> dict[str, str]:
    """A public bootstrap, then hosts of each kind spread evenly."""
    hosts = {"boot": "public"}
    n_random = round((n - 1) * random_share)
    n_nat = round((n - 1) * nat_share)
    n_public = n - 1 - n_nat - n_random
    kinds = ["public"] * n_public + ["nat"] * n_nat + ["nat-random"] * n_random
    for i, kind in enumerate(kinds, start=1):
        hosts[f"h{i:02d}"] = kind
    return hosts


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def run_size(n: int, args: argparse.Namespace) -> dict:
    hosts = layout(n, args.nat_share, args.random_share)
    with tempfile.TemporaryDirectory(prefix="p2pnode-netns-") as work, Testbed(hosts) as bed:
        swarm = NetnsSwarm(bed, Path(work))
        swarm.start_bootstrap("boot")
        t0 = time.monotonic()
        for host in hosts:
            if host != "boot":
                swarm.start_join(host)

        def progress(elapsed: float, full: int, total: int) -> None:
            print(f"  N={n}: {elapsed:5.1f} s, {full}/{total} nodes see everyone", flush=True)

        try:
            full_view_s: float | None = swarm.wait_full_view(
                args.limit, poll_s=2.0, progress=progress
            )
        except TimeoutError as exc:
            print(f"  N={n}: {exc}", flush=True)
            full_view_s = None
        joined_s = time.monotonic() - t0 if full_view_s is not None else None
        if args.keep_logs:
            keep = RESULTS.parent / f"netns_logs_{n}"
            keep.mkdir(parents=True, exist_ok=True)
            for host in hosts:
                (keep / f"{host}.log").write_text(swarm.log(host, 10**7))
        ids = swarm.peer_ids()
        nat_hosts = [h for h, k in hosts.items() if k != "public"]
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while time.monotonic() < deadline:
            statuses = {h: swarm.status(h) for h in hosts}
            settled = all(s["reachability"]["verdict"] != "unknown" for s in statuses.values())
            relayed = all(statuses[h]["relay"]["circuit_addrs"] for h in nat_hosts)
            if settled and relayed:
                break
            time.sleep(2.0)
        # Hole punching gets its minute: pairs are read PUNCH_WINDOW_S after the full view.
        if full_view_s is not None:
            time.sleep(max(0.0, t0 + joined_s + PUNCH_WINDOW_S - time.monotonic()))
        pairs: dict[frozenset, str] = {}
        rtts: dict[str, list[float]] = {"direct": [], "hole-punched": [], "relayed": []}
        for host in hosts:
            for peer in swarm.peers(host):
                kind = peer.get("connection")
                if peer["state"] != "up" or kind is None:
                    continue
                pairs.setdefault(frozenset((ids[host], peer["peer_id"])), kind)
                if peer.get("rtt_ms") is not None:
                    rtts[kind].append(peer["rtt_ms"])
        counts = {k: sum(1 for v in pairs.values() if v == k) for k in rtts}
        kind_of = {ids[h]: hosts[h] for h in hosts if h in ids}
        nat_pairs = [p for p in pairs if all(kind_of.get(x) == "nat" for x in p)]
        punched = sum(1 for p in nat_pairs if pairs[p] == "hole-punched")
        total_pairs = n * (n - 1) // 2
        verdicts = {h: statuses[h]["reachability"]["verdict"] for h in hosts}
    return {
        "hosts": n,
        "layout": {k: sum(1 for v in hosts.values() if v == k) for k in set(hosts.values())},
        "full_view_s": None if full_view_s is None else round(full_view_s, 1),
        "full_view_limit_s": args.limit,
        "first_join_to_full_view_s": None if joined_s is None else round(joined_s, 1),
        "pairs": total_pairs,
        "pairs_connected": len(pairs),
        "share": {k: round(c / total_pairs, 3) for k, c in counts.items()},
        "port_preserving_nat_pairs": len(nat_pairs),
        "port_preserving_nat_pairs_hole_punched": punched,
        "rtt_ms_median": {k: _median(v) for k, v in rtts.items()},
        "verdicts_wrong": [
            h for h, v in verdicts.items() if v != ("public" if hosts[h] == "public" else "private")
        ],
    }


async def relay_vs_direct(rounds: int) -> dict:
    keys = [NodeKey.generate() for _ in range(3)]

    async def echo(stream) -> None:
        while (frame := await read_frame(stream, limit=LIMIT)) is not None:
            await write_frame(stream, frame, limit=LIMIT)

    async def measure(node, peer_id: str) -> dict:
        stream = await node.open_stream(peer_id, BENCH, timeout=20)
        small, big = b"x" * 1024, b"y" * (1 << 20)
        samples = []
        for _ in range(100):
            t = time.perf_counter()
            await write_frame(stream, small, limit=LIMIT)
            await read_frame(stream, limit=LIMIT)
            samples.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(rounds):
            await write_frame(stream, big, limit=LIMIT)
            await read_frame(stream, limit=LIMIT)
        elapsed = time.perf_counter() - t
        await stream.close()
        return {
            "rtt_1kib_ms": round(1000 * statistics.median(samples), 3),
            "echo_mib_s": round(2 * rounds / elapsed, 1),
        }

    async with (
        open_overlay_node(OverlayConfig(key=keys[0])) as r,
        open_relay(r, hop=True),
        open_overlay_node(OverlayConfig(key=keys[1], bootstrap=r.addrs)) as b,
        open_relay(b, relays=r.addrs) as b_relay,
        # A never runs discovery (it would find B's loopback address and dial it directly):
        # it reaches B only through the circuit and R only by a direct dial.
        open_overlay_node(
            OverlayConfig(key=keys[2], discovery_interval=1e5, discovery_max_interval=1e5)
        ) as a,
        open_relay(a) as a_relay,
    ):
        with trio.fail_after(30):
            await b_relay.wait_reserved()
        b.set_stream_handler(BENCH, echo)
        r.set_stream_handler(BENCH, echo)
        with trio.fail_after(30):
            await a_relay.dial(b_relay.circuit_addrs[0])
        await a.connect(r.addrs[0])
        kinds = {"b": a.connection_kind(b.peer_id), "r": a.connection_kind(r.peer_id)}
        if kinds != {"b": "relayed", "r": "direct"}:
            raise RuntimeError(f"the paths are not what they should be: {kinds}")
        relayed = await measure(a, b.peer_id)
        direct = await measure(a, r.peer_id)
    return {
        "direct": direct,
        "relayed": relayed,
        "rtt_ratio_relayed_over_direct": round(relayed["rtt_1kib_ms"] / direct["rtt_1kib_ms"], 2),
        "throughput_ratio_relayed_over_direct": round(
            relayed["echo_mib_s"] / direct["echo_mib_s"], 2
        ),
        "where": "one process on loopback (relay in the same process)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", default="6,16", help="comma-separated testbed sizes")
    parser.add_argument("--nat-share", type=float, default=0.4)
    parser.add_argument("--random-share", type=float, default=0.2)
    parser.add_argument("--limit", type=float, default=180.0, help="full-view limit (s)")
    parser.add_argument("--rounds", type=int, default=20, help="1 MiB echoes per path")
    parser.add_argument("--keep-logs", action="store_true", help="copy node logs to results")
    args = parser.parse_args()
    reason = require_netns()
    if reason is not None:
        sys.exit(f"cannot build a namespace testbed here: {reason}")
    out: dict = {"load_avg_1m_at_start": os.getloadavg()[0], "sizes": []}
    for n in (int(x) for x in args.hosts.split(",")):
        print(f"testbed of {n} hosts ...", flush=True)
        out["sizes"].append(run_size(n, args))
    print("relay vs direct on loopback ...", flush=True)
    out["relay_vs_direct"] = trio.run(relay_vs_direct, args.rounds)
    out["load_avg_1m_at_end"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(
        "| hosts | layout | full view (s) | direct | hole-punched | relayed "
        "| NAT-NAT pairs punched | RTT direct / punched / relayed (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in out["sizes"]:
        share, rtt = row["share"], row["rtt_ms_median"]
        print(
            f"| {row['hosts']} | {row['layout']} | {row['full_view_s']} | {share['direct']:.0%} | "
            f"{share['hole-punched']:.0%} | {share['relayed']:.0%} | "
            f"{row['port_preserving_nat_pairs_hole_punched']}/{row['port_preserving_nat_pairs']} | "
            f"{rtt['direct']} / {rtt['hole-punched']} / {rtt['relayed']} |"
        )
    print(json.dumps(out["relay_vs_direct"], indent=2))
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
