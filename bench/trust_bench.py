"""Trust benchmark: recovery time after a lying peer appears on a 4-node loopback cluster.

Run: ``python bench/trust_bench.py [--trials 2] [--rate 2.0] [--before 6] [--during 16]
[--policies trust,no_trust]``. Prints the figures and writes ``bench/results/trust.json``.
About 30 s per trial.

Setup per trial: 4 real overlay nodes on 127.0.0.1 (libp2p, gossiped digests, forwarding),
each with an emulated engine (real radix tree and block events, compute slept from the cost
model of SmolLM2-135M fp32 on 2 CPU threads: 1/430 s per prefill token, 1/16 s per decode
token); the routers see a pinned 2 ms LAN RTT (in one process a ping measures event-loop lag).
Node B serves ``--during`` tenants' 128-token system prompts once, so it holds them. Origin A
sends requests (a tenant's prompt + a 16-token question, 2 tokens out) at ``--rate`` per second
(Poisson arrivals, concurrent):
- ``--before`` requests while everyone is honest (they go to B and hit its cache);
- then node D turns liar: it gossips a digest of the prefixes its view says B holds, signed with
  its own key, and advertises 10x its real speeds with an empty queue (see
  tests/overlay/test_trust.py);
- ``--during`` more requests, each on a different tenant (the liar never held any of them).

Figures per trial: ``lie_to_demotion_s`` (from the forged digest appearing in A's view to A's
TrustBook demoting D), requests sent and requests the liar served (concurrent requests already
routed when it is demoted still go there), ``recovery_s`` (from the lie until the first request
after the liar's last one that B served from its cache: hits are back), and per window (before
the lie, lie to demotion, after) the hit rate, latency (mean, p50), who served, and why B was
skipped when it was (on a loaded machine pings time out and a healthy B flaps to "suspect").
Policy ``no_trust`` runs the same with the router's trust hook off (``router.trust = None``):
the confidence discount alone, for comparison.
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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from p2pnode.inference.blockhash import block_hashes
from p2pnode.inference.models import ShapeOnlyModel
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.serve.forward import ForwardConfig
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.testing.localcluster import emulated_routed_services, forge_liar, loopback_overlays
from p2pnode.testing.waiting import wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "trust.json"
PREFILL_S = 1 / 430
DECODE_S = 1 / 16
LAN_RTT_S = 0.002
PREFIX_TOKENS = 128
QUESTION_TOKENS = 16
MAX_TOKENS = 2
AE_CONFIG = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
FORWARD_CONFIG = ForwardConfig(accept_slack_s=20, first_token_slack_s=30, idle_min_s=20)

logging.getLogger("libp2p").setLevel(logging.CRITICAL)
log = logging.getLogger("trust_bench")


def tenant_prompt(tenant: int, question: int) -> list[int]:
    prefix = random.Random(tenant)
    suffix = random.Random(10_000 * (tenant + 1) + question)
    return [prefix.randrange(3, 49152) for _ in range(PREFIX_TOKENS)] + [
        suffix.randrange(3, 49152) for _ in range(QUESTION_TOKENS)
    ]


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[list[RoutedService]]:
    async with loopback_overlays(4) as nodes:
        await wait_until(lambda: all(len(n.peers.up_peers()) == 3 for n in nodes), 60, "mesh")
        async with emulated_routed_services(
            nodes,
            model=ShapeOnlyModel("trust-bench-model"),
            prefill_s=PREFILL_S,
            decode_s=DECODE_S,
            cache_budget_tokens=8192,
            rtt_s=LAN_RTT_S,
            antientropy_config=AE_CONFIG,
            forward_config=FORWARD_CONFIG,
        ) as services:
            yield services
        await trio.sleep(1.0)


def holds(origin: RoutedService, peer: str, tenant: int) -> bool:
    hs = block_hashes(tenant_prompt(tenant, 0), origin.salt)
    return origin.views.cached_prefix_tokens(peer, hs, origin.model_id) >= PREFIX_TOKENS


async def send(
    a: RoutedService,
    names: dict[str, str],
    jobs: list[tuple[int, int]],
    rate: float,
    rng: random.Random,
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    b = next(p for p, n in names.items() if n == "B")

    async def one(tenant: int, question: int) -> None:
        t0 = time.perf_counter()
        res = await a.generate(tenant_prompt(tenant, question), {"max_tokens": MAX_TOKENS})
        est_b = res.decision.estimate_for(b)
        records.append(
            {
                "sent": t0,
                "latency_s": time.perf_counter() - t0,
                "served_by": "A" if res.served_locally else names.get(res.served_by, "?"),
                "cached": res.cached_tokens,
                "prompt": res.prompt_tokens,
                # Why B (which holds the prefix) was not used, when it was not.
                "b_skipped": None if est_b is None else est_b.skipped,
                "reason": res.decision.reason,
            }
        )

    with trio.fail_after(120 + 10 * len(jobs)):
        async with trio.open_nursery() as nursery:
            for tenant, question in jobs:
                nursery.start_soon(one, tenant, question)
                await trio.sleep(rng.expovariate(rate))
    return sorted(records, key=lambda r: r["sent"])


def window(records: list[dict[str, Any]]) -> dict[str, Any]:
    if not records:
        return {"requests": 0}
    lat = [r["latency_s"] for r in records]
    return {
        "requests": len(records),
        "served_by": dict(Counter(r["served_by"] for r in records)),
        "b_skipped": dict(Counter(str(r["b_skipped"]) for r in records if r["b_skipped"])),
        "hit_rate": round(sum(r["cached"] for r in records) / sum(r["prompt"] for r in records), 3),
        "latency_mean_s": round(statistics.mean(lat), 3),
        "latency_p50_s": round(statistics.median(lat), 3),
    }


async def trial(policy: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    async with cluster() as (a, b, c, d):
        names = {x.node.peer_id: n for x, n in zip((a, b, c, d), "ABCD", strict=True)}
        if policy == "no_trust":
            a.router.trust = None
        tenants = list(range(args.during))
        for t in tenants:  # B holds every tenant's system prompt
            await b.engine.generate(tenant_prompt(t, 0), {"max_tokens": 1})
        await wait_until(
            lambda: all(holds(x, b.node.peer_id, t) for x in (a, d) for t in tenants),
            90,
            "views of B",
        )
        before = await send(
            a, names, [(rng.choice(tenants), 100 + i) for i in range(args.before)], args.rate, rng
        )
        liar = d.node.peer_id
        forge_liar(d, b.node.peer_id, prefill_s=PREFILL_S, decode_s=DECODE_S)
        await wait_until(lambda: holds(a, liar, 0), 90, "forged digest at A")
        lie_at = time.perf_counter()
        demoted_at: list[float] = []

        async def watch() -> None:
            while a.trust.usable(liar):  # noqa: ASYNC110 - the book has no event
                await trio.sleep(0.02)
            demoted_at.append(time.perf_counter())

        async with trio.open_nursery() as nursery:
            if a.router.trust is not None:  # no_trust: the book still judges; nobody listens
                nursery.start_soon(watch)
            during = await send(a, names, [(t, 200) for t in tenants], args.rate, rng)
            nursery.cancel_scope.cancel()
    demoted = demoted_at[0] if demoted_at else None
    cut = demoted if demoted is not None else float("inf")
    lied = [r for r in during if r["sent"] < cut]
    after = [r for r in during if r["sent"] >= cut]
    to_liar = [i for i, r in enumerate(during) if r["served_by"] == "D"]
    last_lie = to_liar[-1] if to_liar else -1
    hit = next(
        (
            r
            for r in during[last_lie + 1 :]
            if r["cached"] >= PREFIX_TOKENS and r["served_by"] == "B"
        ),
        None,
    )
    return {
        "policy": policy,
        "lie_to_demotion_s": None if demoted is None else round(demoted - lie_at, 3),
        "requests_sent_before_demotion": len(lied),
        "requests_served_by_liar": len(to_liar),
        # The liar's last request, and the first after it served from B's cache (sent times).
        "last_liar_request_s": round(during[last_lie]["sent"] - lie_at, 3) if to_liar else None,
        "recovery_s": None if hit is None else round(hit["sent"] - lie_at, 3),
        "before": window(before),
        "lie_until_demotion": window(lied),
        "after_demotion": window(after),
    }


async def main(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {
        "setup": {
            "nodes": 4,
            "compute": "emulated (SmolLM2-135M fp32 cost model, 2 CPU threads)",
            "rate_per_s": args.rate,
            "before": args.before,
            "during": args.during,
            "prompt_tokens": PREFIX_TOKENS + QUESTION_TOKENS,
            "max_tokens": MAX_TOKENS,
            "load_avg_at_start": os.getloadavg(),
        },
        "trials": [],
    }
    for policy in args.policies.split(","):
        for i in range(args.trials):
            r = await trial(policy, args, seed=i)
            out["trials"].append(r)
            print(json.dumps(r))
    summary = {}
    for policy in args.policies.split(","):
        rs = [r for r in out["trials"] if r["policy"] == policy]
        summary[policy] = {
            key: [r[key] for r in rs]
            for key in (
                "lie_to_demotion_s",
                "requests_sent_before_demotion",
                "requests_served_by_liar",
                "recovery_s",
            )
        }
    out["summary"] = summary
    out["setup"]["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(summary, indent=1))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second from A")
    parser.add_argument("--before", type=int, default=6)
    parser.add_argument("--during", type=int, default=16)
    parser.add_argument("--policies", default="trust,no_trust")
    trio.run(main, parser.parse_args())
