"""Trust policy benchmark: a liar that turns after earning trust, and how soon a new honest peer
gets its first real forward.

Run: ``python bench/trust_policy_bench.py [--runs 20] [--honest-first 4]
[--parts turning,first_forward]``. Prints the figures and writes
``bench/results/trust_policy.json``. A few minutes on 2 cores.

Both parts use emulated compute (the real radix tree and block events, compute slept from the
cost model of SmolLM2-135M fp32 on 2 CPU threads) on real libp2p nodes on 127.0.0.1; the
routers see a pinned 2 ms LAN RTT.

- ``turning``: origin A (a slow engine: it forwards), an honest peer H and a liar L that
  advertises the fastest engine, so A tries it first. L is trusted from its first answer (a
  member of a closed network, ``is_member``) or has passed probation (open network, rate
  ``--probation``): it serves ``--honest-first`` honest answers, then replaces every token it
  serves. A sends requests one at a time until it demotes L (at most 80). Per run: the wrong
  answers the client kept. Released answers of a trusted peer are audited at rate p
  (``AuditConfig.trusted_rate``) and at least every ``max_gap``-th: the lies delivered before the
  first audited one number min(K, max_gap - 1) with K geometric of mean (1 - p) / p; the audited
  lie itself was delivered too (its audit runs after release), so the expectation printed is
  that plus one.
- ``first_forward``: A and a new honest peer B that holds the 512-token prefix of A's steady
  workload (one request every 0.5 s). B appears (accepts forwards) at t = 0. Figure: seconds from
  then to A's first request that B served, in a closed network (B a member) and in an open one
  (B a stranger: on probation; known-answer challenges and held audits bring it out).
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
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import trio

from p2pnode.inference.blockhash import block_hashes
from p2pnode.inference.models import ShapeOnlyModel
from p2pnode.inference.scoring import emulated_answer
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.serve.forward import ForwardConfig
from p2pnode.overlay.trust.audit import AuditConfig
from p2pnode.testing.localcluster import emulated_routed_services, loopback_overlays
from p2pnode.testing.waiting import wait_until
from p2pnode.testnet.adversary.trial import make_adversary

RESULTS = Path(__file__).resolve().parent / "results" / "trust_policy.json"
PREFILL_S, DECODE_S = 1 / 430, 1 / 16
MODEL = ShapeOnlyModel("trust-policy-bench-model")
AE_CONFIG = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
FORWARD_CONFIG = ForwardConfig(accept_slack_s=20, first_token_slack_s=30, idle_min_s=20)

logging.getLogger("libp2p").setLevel(logging.CRITICAL)


@contextlib.asynccontextmanager
async def cluster(n: int, **service_kw: Any) -> AsyncIterator[list[Any]]:
    async with loopback_overlays(n) as nodes:
        await wait_until(lambda: all(len(x.peers.up_peers()) == n - 1 for x in nodes), 60, "mesh")
        async with emulated_routed_services(
            nodes,
            model=MODEL,
            prefill_s=PREFILL_S,
            decode_s=DECODE_S,
            cache_budget_tokens=8192,
            rtt_s=0.002,
            antientropy_config=AE_CONFIG,
            forward_config=FORWARD_CONFIG,
            **service_kw,
        ) as services:
            ids = [s.node.peer_id for s in services]
            await wait_until(
                lambda: all(services[0].views.get(p, MODEL.model_id) for p in ids[1:]), 30, "views"
            )
            yield services


def honest(prompt: list[int], n: int) -> list[int]:
    return emulated_answer(prompt, n, MODEL.vocab_size, MODEL.eos_token_ids)


# --------------------------------------------------------------------------- turning liar


async def turning_run(seed: int, honest_first: int, closed: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    members: set[str] = set()
    kw: dict[str, Any] = {"audit_config": AuditConfig(probation_answers=0 if closed else 3)}
    if closed:
        kw["is_member"] = members.__contains__
    async with cluster(3, **kw) as (origin, good, liar):
        members.update(s.node.peer_id for s in (origin, good, liar))
        origin.auditor._rng = random.Random(seed)  # the sampled audits, reproducible per run
        origin.engine.cost.decode_s_per_token = 1.0  # the origin forwards
        liar.engine.cost.decode_s_per_token = DECODE_S / 4  # the fastest: tried first
        pid = liar.node.peer_id
        served = wrong = lies = 0
        turned = False
        for _ in range(80):  # bounded
            if not origin.trust.usable(pid):
                break
            prompt = [rng.randrange(3, MODEL.vocab_size) for _ in range(48)]
            res = await origin.generate(prompt, {"max_tokens": 16})
            bad = res.tokens != honest(prompt, len(res.tokens))
            wrong += bad
            if res.served_by == pid:
                served += 1
                lies += turned
                if not turned and served >= honest_first:
                    make_adversary(liar, "wrong-output", rate=1.0)
                    turned = True
        # A background audit queued for the last answer may still be running: let it land.
        with trio.move_on_after(10):
            while origin.trust.usable(pid):  # noqa: ASYNC110
                await trio.sleep(0.05)
        return {
            "seed": seed,
            "served_by_liar": served,
            "lies_served": lies,
            "wrong_kept": wrong,
            "demoted": not origin.trust.usable(pid),
            "audits_of_liar": dict(origin.auditor.by_peer.get(pid, {})),
        }


async def part_turning(runs: int, honest_first: int) -> dict[str, Any]:
    cfg = AuditConfig()
    p, gap = cfg.trusted_rate, cfg.max_gap
    before = (
        sum(min(k, gap - 1) * (1 - p) ** k * p for k in range(gap)) + (gap - 1) * (1 - p) ** gap
    )
    out: dict[str, Any] = {"trusted_rate": p, "max_gap": gap, "honest_first": honest_first}
    out["expected_wrong_before_audited_lie"] = round(before, 3)
    out["expected_wrong_kept"] = round(before + 1, 3)
    for label, closed in (("closed", True), ("open_trusted", False)):
        rows = []
        for seed in range(runs):
            row = await turning_run(seed, honest_first, closed)
            rows.append(row)
            print(f"turning {label} run {seed}: {row}", flush=True)
        kept = [r["wrong_kept"] for r in rows]
        out[label] = {
            "runs": rows,
            "demoted": sum(r["demoted"] for r in rows),
            "wrong_kept_mean": round(statistics.mean(kept), 3),
            "wrong_kept_max": max(kept),
        }
        print(
            f"turning {label}: demoted {out[label]['demoted']}/{runs}, wrong answers kept "
            f"mean {out[label]['wrong_kept_mean']} (expected {out['expected_wrong_kept']}), "
            f"max {out[label]['wrong_kept_max']}",
            flush=True,
        )
    return out


# --------------------------------------------------------------------------- first forward


def tenant_prompt(question: int) -> list[int]:
    prefix = random.Random(7)
    suffix = random.Random(1000 + question)
    return [prefix.randrange(3, MODEL.vocab_size) for _ in range(512)] + [
        suffix.randrange(3, MODEL.vocab_size) for _ in range(16)
    ]


async def first_forward(closed: bool, limit_s: float) -> dict[str, Any]:
    members: set[str] = set()
    kw: dict[str, Any] = {"is_member": members.__contains__} if closed else {}
    async with cluster(2, **kw) as (origin, newcomer):
        members.update(s.node.peer_id for s in (origin, newcomer))
        pid = newcomer.node.peer_id
        await newcomer.generate(tenant_prompt(0), {"max_tokens": 2})  # it holds the prefix
        hashes = block_hashes(tenant_prompt(0), origin.salt)
        await wait_until(
            lambda: origin.views.cached_prefix_tokens(pid, hashes, MODEL.model_id) >= 512,
            30,
            "the origin's view of the newcomer's prefix",
        )
        t0 = time.perf_counter()
        first: list[float] = []
        counts = {"sent": 0, "local": 0}

        async def one(q: int) -> None:
            res = await origin.generate(tenant_prompt(q), {"max_tokens": 2})
            counts["local" if res.served_locally else "sent"] += 1
            if res.served_by == pid and not first:
                first.append(time.perf_counter() - t0)

        with trio.move_on_after(limit_s):
            async with trio.open_nursery() as nursery:
                for q in range(1, 10_000):  # bounded by limit_s
                    if first:
                        break
                    nursery.start_soon(one, q)
                    await trio.sleep(0.5)
                nursery.cancel_scope.cancel()
        audits = dict(origin.auditor.counts) if origin.auditor else None
        challenges = dict(origin.probation.counts) if origin.probation else None
        return {
            "seconds": round(first[0], 2) if first else None,
            "limit_s": limit_s,
            "requests": counts,
            "audits": audits,
            "challenges": challenges,
        }


async def part_first_forward(limit_s: float) -> dict[str, Any]:
    out = {}
    for label, closed in (("closed", True), ("open", False)):
        out[label] = await first_forward(closed, limit_s)
        print(f"first forward to a new honest peer, {label} network: {out[label]}", flush=True)
    return out


async def main(args: argparse.Namespace) -> None:
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {"args": vars(args), "date": time.strftime("%Y-%m-%d")}
    if "turning" in parts:
        results["turning"] = await part_turning(args.runs, args.honest_first)
    if "first_forward" in parts:
        results["first_forward"] = await part_first_forward(args.limit)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--honest-first", type=int, default=4)
    parser.add_argument("--limit", type=float, default=120.0, help="first_forward: give up (s)")
    parser.add_argument("--parts", default="turning,first_forward")
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "WARNING"))
    trio.run(main, parser.parse_args())
