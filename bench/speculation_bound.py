"""How fast edge-cloud speculation could be at all, from this machine's measured step times and
the draft's measured agreement with the target: an upper bound to judge the pipeline against.

    python bench/speculation_bound.py [--rtts 0,50,100,200] [--new-tokens 96] [--prompts 8]
        [--reuse]   (simulate again on the last run's measurements, bench/results/)

Measured (one torch thread, the models as nodes load them): the target's forward over 1, 5 and
9 new positions after a prompt, the draft's decode step, and for each prompt the draft's
*agreement sequence*: position by position along the target's own greedy output, whether the
draft's greedy token, given the true prefix, is the target's. Along a draft chain that has been
right so far the draft sees the true prefix, so that sequence alone says which guesses of any
drafting schedule are right. The prompts are this script's own, none of the judging benches'.

Simulated from those figures, per round trip (``simulate_*``, pure functions, tested):
- ``remote``: the verifier decodes alone and streams (one target step a token);
- ``sync``: draft ``gamma``, send, verify, answer, repeat (no lead);
- ``ideal``: an idealised streaming pipeline no real protocol beats under these costs: the
  edge drafts continuously, each guess is sent the moment it exists and arrives after half the
  round trip, the edge hears each commit after half the round trip and restarts at once from a
  contradicted guess; the verifier never waits, and each step verifies every consecutive guess
  that has arrived (up to ``--max-block``) or, with none, decodes one token alone. No shared-core
  contention, no protocol cost, no first-token latency.
two trees beside the chain: ``+leaves`` (each guess carries the draft's second choice as a leaf,
verified as a position of its own) and a free top-2 tree (any tree of the draft's first two
choices at every node, drafted and verified at no cost: how far hedged drafts could go at all);
and a what-if grid at one round trip: independent agreements of a given rate, and cheaper drafts.

Prints the tables and writes ``bench/results/speculation_bound.json``. Why it exists: at 100 ms
the pipeline's measured tokens/s stayed at 0.9-0.97x target-only remote generation however it
was tuned; this says how much of that is the pipeline and how much is the draft.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "speculation_bound.json"

PROMPTS = [
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarize the plot of Romeo and Juliet.",
    "What is machine learning?",
    "How do vaccines work?",
    "Write a haiku about autumn.",
    "Explain photosynthesis to a child.",
    "What makes a good password?",
    "Tell me about the history of the printing press.",
]

StepCost = Callable[[int], float]  # ms of a target forward over k positions


def linear_cost(t1: float, t5: float) -> StepCost:
    """A target step's ms for k positions, through the measured 1- and 5-position points."""
    slope = (t5 - t1) / 4
    return lambda k: t1 + slope * (k - 1)


def _agrees(agree: Sequence[int], base: int, upto: int) -> bool:
    """Guesses of a chain that knew the true tokens up to ``base`` are right through ``upto``."""
    return all(agree[base:upto])


def simulate_remote(n: int, cost: StepCost) -> float:
    """ms to stream ``n`` tokens from a verifier decoding alone."""
    return n * cost(1)


def simulate_sync(
    agree: Sequence[int], rtt_ms: float, cost: StepCost, draft_ms: float, gamma: int
) -> float:
    """ms for the synchronous loop: draft ``gamma``, a round trip, one verify of gamma + 1."""
    n, c, t = len(agree), 0, 0.0
    while c < n:
        g = min(gamma, n - c)
        acc = 0
        while acc < g and agree[c + acc]:
            acc += 1
        t += g * draft_ms + rtt_ms + cost(g + 1)
        c = min(n, c + acc + 1)
    return t


def simulate_ideal(
    agree: Sequence[int],
    rtt_ms: float,
    cost: StepCost,
    draft_ms: float,
    *,
    horizon: int = 16,
    max_block: int = 8,
    resync_ms: float | None = None,
    second: Sequence[int] | None = None,
) -> float:
    """ms for the idealised streaming pipeline (module docstring) to commit ``len(agree)``
    tokens. ``agree[i]``: the draft's guess at new position i + 1, given the true prefix, is
    the target's. ``horizon``: guesses the edge runs ahead of what it knows; ``resync_ms``: the
    edge's cost to feed the true tokens after a contradiction (default half a draft step).

    ``second`` (a tree of chain and leaves): each guess also carries the draft's second choice at
    its position as a leaf, free to draft (it comes from the same logits) but verified as a
    position of its own, so a step over k guesses costs ``cost(2k + 1)``. ``second[i]``: the
    target's token at new position i + 1 is the draft's second choice. Where the chain's guess
    is wrong and its leaf right, the step commits the leaf and the token after it."""
    n, half = len(agree), rtt_ms / 2
    resync = draft_ms / 2 if resync_ms is None else resync_ms
    c, t = 0, 0.0  # verifier: committed tokens, clock
    base = top = 0  # edge: true tokens it knows, last position guessed
    et = 0.0  # edge clock
    to_edge: list[tuple[float, int]] = []  # (arrival, committed)
    guesses: list[tuple[float, int, int]] = []  # (arrival, chain base, position)
    while c < n:
        while et < t:  # the edge works until the verifier's next step starts
            while to_edge and to_edge[0][0] <= et:
                arrival, committed = to_edge.pop(0)
                if committed <= base:
                    continue
                if top >= committed and _agrees(agree, base, committed):
                    base = committed  # its chain was right: keep drafting on it
                else:
                    base = top = committed
                    et = max(et, arrival) + resync
            if top - base < horizon and top < n:
                et += draft_ms
                top += 1
                guesses.append((et + half, base, top))
            elif to_edge:
                et = max(et, to_edge[0][0])
            else:
                et = t
        have = {p for arrival, b, p in guesses if arrival <= t and p > c and _agrees(agree, b, c)}
        k = 0
        while k < max_block and c + 1 + k in have:
            k += 1
        acc = 0
        while acc < k and agree[c + acc]:
            acc += 1
        leaf = second is not None and acc < k and second[c + acc]
        t += cost(k + 1 if second is None else 2 * k + 1)
        c = min(n, c + acc + 1 + int(leaf))
        to_edge.append((t + half, c))
        guesses = [g for g in guesses if g[2] > c]
    return t


def simulate_hedged(
    agree: Sequence[int],
    second: Sequence[int],
    rtt_ms: float,
    cost: StepCost,
    draft_ms: float,
    *,
    depth: int = 1,
    branch: int = 4,
    branch_cost: float = 1.0,
    horizon: int = 16,
    max_block: int = 8,
    resync_ms: float | None = None,
) -> float:
    """``simulate_ideal``'s pipeline where the edge hedges after each restart: past each of the
    first ``depth`` guesses of a chain drafted from a contradiction, it also drafts a branch of
    ``branch`` tokens rooted at that position's second choice (``second[i]``: it is the
    target's token at new position i + 1), each token at ``branch_cost`` draft steps, sent as
    drafted. That is when the verifier is furthest ahead of the edge (it decoded alone while
    the contradiction travelled), so a right branch can stand in for a wrong guess without a
    round trip. The verifier verifies one chain a step, as deployed: the first choices the
    committed tokens allow, pooled as ``simulate_ideal`` pools them (a branch's among them once
    its root is committed), or else a branch rooted at its first open position. The edge
    carries on along a branch that a commit proved right. ``depth=0`` is ``simulate_ideal``."""
    n, half = len(agree), rtt_ms / 2
    resync = draft_ms / 2 if resync_ms is None else resync_ms
    c, t = 0, 0.0  # verifier: committed tokens, clock
    base = top = restart = 0  # edge: true tokens known, last guessed, where the chain restarted
    et = 0.0
    to_edge: list[tuple[float, int]] = []
    chains: list[_Chain] = []

    def allowed(ch: _Chain, c: int) -> bool:  # its guesses up to c are the committed tokens
        if ch.root is None:
            return ch.base <= c and _agrees(agree, ch.base, c)
        before = _agrees(agree, ch.base, ch.root - 1)
        if c == ch.root - 1:
            return before
        return c >= ch.root and before and bool(second[ch.root - 1]) and _agrees(agree, ch.root, c)

    while c < n:
        while et < t:
            while to_edge and to_edge[0][0] <= et:
                arrival, committed = to_edge.pop(0)
                if committed <= base:
                    continue
                on = [ch for ch in chains if ch.root and ch.end() >= committed]
                on = [ch for ch in on if allowed(ch, committed)]
                if top >= committed and _agrees(agree, base, committed):
                    base = committed
                elif on:  # a branch proved right: draft on from its end
                    base, top = committed, on[0].end()
                    et = max(et, arrival) + resync
                else:
                    base = top = restart = committed
                    et = max(et, arrival) + resync
            if top - base < horizon and top < n:
                if not chains or chains[-1].root is not None or chains[-1].base != base:
                    chains.append(_Chain(base))
                et += draft_ms
                top += 1
                chains[-1].sent[top] = et + half
                if top - restart <= depth:
                    hedge = _Chain(base, root=top)
                    for q in range(top, min(n, top + branch - 1) + 1):
                        et += draft_ms * branch_cost
                        hedge.sent[q] = et + half
                    chains.append(hedge)
            elif to_edge:
                et = max(et, to_edge[0][0])
            else:
                et = t
        ok = [ch for ch in chains if allowed(ch, c)]
        pool: dict[int, float] = {}
        for ch in ok:
            if ch.root is None or ch.root <= c:
                for q, arrival in ch.sent.items():
                    pool[q] = min(arrival, pool.get(q, math.inf))
        sent, root = pool, None
        if _run(pool, c + 1, t) == 0:
            roots = [ch.sent for ch in ok if ch.root == c + 1]
            if roots:
                sent, root = max(roots, key=lambda r: _run(r, c + 1, t)), c + 1
        k, acc = min(max_block, _run(sent, c + 1, t)), 0
        while acc < k and (second if c + 1 + acc == root else agree)[c + acc]:
            acc += 1
        t += cost(k + 1)
        c = min(n, c + acc + 1)
        to_edge.append((t + half, c))
        chains = [ch for ch in chains if ch.end() > c]
    return t


@dataclass
class _Chain:
    """Guesses drafted on ``base`` true tokens; a branch's first is ``root``'s second choice."""

    base: int
    root: int | None = None
    sent: dict[int, float] = field(default_factory=dict)  # position -> arrival at the verifier

    def end(self) -> int:
        return max(self.sent, default=self.base)


def _run(sent: dict[int, float], start: int, t: float) -> int:
    """Consecutive positions from ``start`` whose guesses have arrived by ``t``."""
    k = 0
    while sent.get(start + k, math.inf) <= t:
        k += 1
    return k


# ---------------------------------------------------------------- measurements


def _measure(n_prompts: int, new_tokens: int) -> dict:
    import torch
    from transformers import DynamicCache

    sys.path.insert(0, str(ROOT / "bench"))
    from speculation_processes import _one_thread, chat_ids, forward_ms

    _one_thread()
    from p2pnode.inference.models import load_model
    from p2pnode.speculation.draft import load_draft
    from p2pnode.speculation.edge import target_generate

    target, draft = load_model(None), load_draft()
    prompts = [chat_ids(target.tokenizer, p) for p in PROMPTS[:n_prompts]]
    steps = {k: forward_ms(target.model, prompts[0], k) for k in (1, 5, 9)}
    steps["draft"] = forward_ms(draft.model, prompts[0], 1)
    seqs = []
    for i, (text, p) in enumerate(zip(PROMPTS, prompts, strict=False)):
        t0 = time.perf_counter()
        ref = target_generate(target, p, new_tokens, eos_token_ids=target.eos_token_ids)
        rank, cache = [], DynamicCache()
        with torch.inference_mode():
            out = draft.model(input_ids=torch.tensor([p]), past_key_values=cache, use_cache=True)
            for tok in ref:
                logits = out.logits[0, -1]
                rank.append(int((logits > logits[tok]).sum()))
                out = draft.model(
                    input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True
                )
        agree = [int(r == 0) for r in rank]
        seqs.append({"prompt": text, "agree": agree, "rank": rank})
        rate = sum(agree) / max(len(agree), 1)
        print(
            f"  prompt {i + 1}/{len(prompts)}: {len(agree)} tokens, agreement {rate:.2f} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    return {"step_ms": steps, "sequences": seqs}


def _rates(seqs, fn) -> float:
    """tokens/s over all sequences together."""
    return 1000 * sum(len(a) for a in seqs) / sum(fn(a) for a in seqs)


def _rates_pairs(pairs, fn) -> float:
    """tokens/s over (agreement, ranks) pairs together."""
    return 1000 * sum(len(a) for a, _ in pairs) / sum(fn(a, r) for a, r in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtts", default="0,50,100,200")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=4, help="the sync loop's block")
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--max-block", type=int, default=8)
    ap.add_argument("--what-if-rtt", type=float, default=100.0)
    ap.add_argument(
        "--reuse", action="store_true", help="simulate on the last run's measurements (no model)"
    )
    args = ap.parse_args()
    rtts = [float(r) for r in args.rtts.split(",")]

    if args.reuse:
        m = json.loads(RESULTS.read_text())
        m["step_ms"] = {int(k) if k.isdigit() else k: v for k, v in m["step_ms"].items()}
        print(f"reusing the measurements in {RESULTS}")
    else:
        print(f"measuring: {args.prompts} prompts x {args.new_tokens} tokens", flush=True)
        m = _measure(min(args.prompts, len(PROMPTS)), args.new_tokens)
    st = m["step_ms"]
    cost = linear_cost(st[1], st[5])
    seqs = [s["agree"] for s in m["sequences"] if s["agree"]]
    agreement = sum(map(sum, seqs)) / sum(map(len, seqs))
    print(
        f"target step 1/5/9 positions {st[1]:.1f}/{st[5]:.1f}/{st[9]:.1f} ms, draft step "
        f"{st['draft']:.1f} ms, agreement {agreement:.3f}"
    )

    ranks = [s["rank"] for s in m["sequences"] if s["agree"]]
    top2 = sum(r < 2 for rs in ranks for r in rs) / sum(map(len, ranks))
    print(f"the target's token among the draft's first two choices: {top2:.3f}")

    def ideal(a, rtt, draft_ms=st["draft"], second=None):
        return simulate_ideal(
            a,
            rtt,
            cost,
            draft_ms,
            horizon=args.horizon,
            max_block=args.max_block,
            second=second,
        )

    rows, pairs = [], list(zip(seqs, ranks, strict=True))
    print(
        f"{'RTT ms':>7} {'remote':>8} {'sync':>8} {'ideal':>8} {'ideal/remote':>13} "
        f"{'ideal/sync':>11}  (tokens/s, first-token latency left out)"
    )
    for rtt in rtts:
        remote = _rates(seqs, lambda a: simulate_remote(len(a), cost))
        sync = _rates(seqs, lambda a, rtt=rtt: simulate_sync(a, rtt, cost, st["draft"], args.gamma))
        best = _rates(seqs, lambda a, rtt=rtt: ideal(a, rtt))
        # trees: the chain with its second choices as leaves, at their verify cost; and any tree
        # of the draft's first two choices at every node, drafted and verified for free (the
        # true path stays in it while each true token is one of its parent's two children)
        leaves = _rates_pairs(
            pairs, lambda a, r, rtt=rtt: ideal(a, rtt, second=[int(x == 1) for x in r])
        )
        free2 = 1000 * sum(map(len, seqs)) / sum(ideal([int(x < 2) for x in r], rtt) for r in ranks)
        rows.append(
            {
                "rtt_ms": rtt,
                "remote": remote,
                "sync": sync,
                "ideal": best,
                "ideal_chain_and_leaves": leaves,
                "ideal_free_top2_tree": free2,
            }
        )
        print(
            f"{rtt:7.0f} {remote:8.1f} {sync:8.1f} {best:8.1f} {best / remote:13.2f} "
            f"{best / sync:11.2f}"
        )
    print(f"{'RTT ms':>7} {'chain':>8} {'+leaves':>8} {'free top-2 tree':>16}  (ideal / remote)")
    for r in rows:
        print(
            f"{r['rtt_ms']:7.0f} {r['ideal'] / r['remote']:8.2f} "
            f"{r['ideal_chain_and_leaves'] / r['remote']:8.2f} "
            f"{r['ideal_free_top2_tree'] / r['remote']:16.2f}"
        )
    # hedged drafts (simulate_hedged): branches drafted serially on the edge's one core, at a
    # third of a step each (as if batched beside the chain), and free
    hedges = {"1x4 serial": (1, 4, 1.0), "3x4 at 0.3": (3, 4, 0.3), "8x8 free": (8, 8, 0.0)}
    print(f"{'RTT ms':>7} {'chain':>8} " + " ".join(f"{h:>12}" for h in hedges) + "  (hedged)")
    for r in rows:
        line = []
        for name, (depth, branch, f) in hedges.items():
            rate = _rates_pairs(
                pairs,
                lambda a, rk, r=r, depth=depth, branch=branch, f=f: simulate_hedged(
                    a,
                    [int(x == 1) for x in rk],
                    r["rtt_ms"],
                    cost,
                    st["draft"],
                    depth=depth,
                    branch=branch,
                    branch_cost=f,
                    horizon=args.horizon,
                    max_block=args.max_block,
                ),
            )
            r[f"hedged {name}"] = rate
            line.append(f"{rate / r['remote']:12.2f}")
        print(f"{r['rtt_ms']:7.0f} {r['ideal'] / r['remote']:8.2f} " + " ".join(line))
    by = {r["rtt_ms"]: r for r in rows}
    if 0.0 in by and 200.0 in by:
        print(
            f"ideal inter-token latency at 200 ms / at 0 ms: "
            f"{by[0.0]['ideal'] / by[200.0]['ideal']:.2f}"
        )

    rng, n = random.Random(0), max(args.new_tokens, 16)
    grid = []
    rtt = args.what_if_rtt
    print(f"what if, at {rtt:.0f} ms: ideal / remote for independent agreements and draft costs")
    factors = (1.0, 0.5, 0.25)
    print(f"{'agreement':>10} " + " ".join(f"{'draft x' + str(f):>12}" for f in factors))
    for rate in (round(agreement, 2), 0.85, 0.9, 0.95):
        iid = [[int(rng.random() < rate) for _ in range(n)] for _ in range(40)]
        remote = _rates(iid, lambda a: simulate_remote(len(a), cost))
        line = []
        for f in factors:
            r = _rates(iid, lambda a, f=f: ideal(a, rtt, st["draft"] * f)) / remote
            grid.append({"agreement": rate, "draft_factor": f, "ideal_over_remote": r})
            line.append(f"{r:12.2f}")
        print(f"{rate:10.2f} " + " ".join(line))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "step_ms": {str(k): v for k, v in st.items()},
                "agreement": agreement,
                "top2": top2,
                "agreement_median_per_prompt": statistics.median(sum(a) / len(a) for a in seqs),
                "sequences": m["sequences"],
                "rtts": rows,
                "what_if_rtt_ms": rtt,
                "what_if": grid,
                "params": vars(args),
            },
            indent=1,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
