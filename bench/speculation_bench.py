"""Speculative decoding bench: W4A16 draft quality/speed, edge tokens/s under WAN delay, verifier
throughput with several tenants batched vs unbatched. Prints a summary and writes
bench/results/speculation.json.

Everything runs in ONE process on this machine: the draft (edge) and the target (verifier) share
the same CPU cores, so speculative figures here include that contention; on separate machines
the draft's time would overlap the verifier's for real.

    python bench/speculation_bench.py [--new-tokens 24] [--rtts 0,50,100,200] [--gamma 4]
        [--tenants 1,4,16] [--draft FOLDER]

RTT r is injected as r/2 one-way delay on each direction of the edge-verifier link. Target-only
remote generation = the verifier generating alone and streaming tokens (one RTT added once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import trio
from transformers import DynamicCache

from p2pnode.inference._cpu import fastpath as _fastpath
from p2pnode.inference._cpu import gemm as _gemm
from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference.models import load_model
from p2pnode.speculation import (
    BatchedVerifier,
    Block,
    SamplingOptions,
    load_draft,
    speculative_generate,
    target_generate,
)
from p2pnode.speculation.draft import draft_stats
from p2pnode.speculation.testing import inprocess_transport

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer with details.",
    "List three uses of Python.",
]


def chat_ids(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    return list(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


@torch.inference_mode()
def decode_ms(model, prompt: list[int], steps: int = 24) -> float:
    cache, x, times = DynamicCache(), torch.tensor([prompt]), []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
        times.append(time.perf_counter() - t0)
        x = torch.tensor([[int(logits.argmax())]])
    return statistics.median(times[1:]) * 1000


@torch.inference_mode()
def agreement(target, draft, seqs: list[tuple[int, list[int]]]) -> tuple[float, int]:
    hit = total = 0
    for n, s in seqs:
        ids = torch.tensor([s])
        a = target.model(input_ids=ids).logits[0, n - 1 : -1].argmax(-1)
        b = draft.model(input_ids=ids).logits[0, n - 1 : -1].argmax(-1)
        hit, total = hit + int((a == b).sum()), total + len(a)
    return hit / total, total


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters + buffers, each storage once (tied embeddings count once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def expected_accepted(alpha: float, gamma: int) -> float:
    """E[A] = (1 - a^(g+1)) / (1 - a): expected tokens per block (accepted + the target's) when
    each draft token is accepted with probability ``alpha`` (per position, not per drafted)."""
    return gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


async def edge_runs(target, draft, prompts, rtts, gamma, new_tokens) -> list[dict]:
    eos = target.eos_token_ids
    rows = []
    verifier = BatchedVerifier(target)
    local_t0, local_n = time.perf_counter(), 0
    for p in prompts:  # the target's own decoding speed, measured once
        local_n += len(target_generate(target, p, new_tokens, eos_token_ids=eos))
    local_s = time.perf_counter() - local_t0
    async with trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        for rtt_ms in rtts:
            d = rtt_ms / 2000
            secs = local_s + 2 * d * len(prompts)  # prompt up, tokens streamed down: one RTT
            rows.append(
                {
                    "rtt_ms": rtt_ms,
                    "mode": "target_alone",
                    "tokens_per_s": local_n / secs,
                    "inter_token_ms": 1000 * local_s / local_n,
                }
            )
            for mode, depth in (("sync", 1), ("async", 2)):
                n, secs, acc, drafted, stale, rej, blocks = 0, 0.0, 0, 0, 0, 0, 0
                for p in prompts:
                    async with inprocess_transport(verifier, one_way_delay_s=d) as tr:
                        r = await speculative_generate(
                            draft, tr, p, new_tokens, gamma=gamma, depth=depth, eos_token_ids=eos
                        )
                    n, secs = n + len(r.tokens), secs + r.stats.seconds
                    acc, drafted = acc + r.stats.accepted, drafted + r.stats.drafted
                    stale += r.stats.blocks_stale
                    rej, blocks = rej + r.stats.rejections, blocks + r.stats.blocks_verified
                # Per-token acceptance probability: each verified position ends accepted or
                # rejected (one rejection at most per block), so alpha = acc / (acc + rej).
                alpha = acc / max(acc + rej, 1)
                rows.append(
                    {
                        "rtt_ms": rtt_ms,
                        "mode": mode,
                        "gamma": gamma,
                        "tokens_per_s": n / secs,
                        "inter_token_ms": 1000 * secs / max(n, 1),
                        "acceptance": acc / max(drafted, 1),
                        "alpha": alpha,
                        "tokens_per_block": (acc + blocks) / max(blocks, 1),
                        "expected_tokens_per_block": expected_accepted(alpha, gamma),
                        "stale_blocks": stale,
                    }
                )
            for r in rows[-3:]:
                print(
                    f"  RTT {rtt_ms:>4} ms {r['mode']:>12}: {r['tokens_per_s']:6.2f} tok/s, "
                    f"inter-token {r['inter_token_ms']:6.0f} ms"
                    + (
                        f", accepted/drafted {r['acceptance']:.2f}, alpha {r['alpha']:.2f}, "
                        "tokens/block "
                        f"{r['tokens_per_block']:.2f} (E[A] {r['expected_tokens_per_block']:.2f})"
                        if "acceptance" in r
                        else ""
                    )
                )
        nursery.cancel_scope.cancel()
    return rows


def flops_per_position(model, context: int) -> float:
    """FLOPs of one position through the target: 2 per weight of every linear map (the tied
    LM head included: a verify takes logits at every position) plus attention's 4 per key
    and channel of each layer at ``context`` cached tokens."""
    cfg = model.config
    attention = 4 * cfg.num_hidden_layers * cfg.hidden_size * context
    return linear_flops(model) + attention


def best_s(fn, reps: int = 3) -> float:
    fn()  # warm: packed copies, page faults
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.inference_mode()
def forward_rates(target, prompt: list[int], tenants_list: list[int], gamma: int) -> list[dict]:
    """The batched verify pass itself: ``tenants`` sessions of ``gamma + 1`` rows each through
    ONE call of the C stack (``fastpath.extend_many``, what the verifier runs), against the
    prefill's panel GEMM alone over the same linears (every decoder linear, then the lm_head
    by its own packed form) at the same rows and threads: the rate the pass could reach."""
    model, out = target.model, []
    plan = _fastpath.plan(model)
    if plan is None:
        print("  no C stack for the target here: no fused pass to time")
        return out
    rows_per = gamma + 1
    caches = []
    for i in range(max(tenants_list)):
        cache = DynamicCache()
        model(input_ids=torch.tensor([[i, *prompt]]), past_key_values=cache, use_cache=True)
        caches.append(cache)
    slabs = [_fastpath.slab_of(c, model) for c in caches]
    per_position = flops_per_position(model, len(prompt) + 1)
    for tenants in tenants_list:
        rows = tenants * rows_per
        inputs = [list(range(100 + i, 100 + i + rows_per)) for i in range(tenants)]

        def fused(slabs=slabs[:tenants], inputs=inputs) -> None:
            _fastpath.extend_many(model, slabs, inputs)
            for s in slabs:
                s.crop(rows_per)

        secs = best_s(fused)
        gemm_s = gemm_seconds(model, plan, rows)
        row = {
            "tenants": tenants,
            "rows": rows,
            "fused_pass_ms": secs * 1e3,
            "fused_gflop_per_s": rows * per_position / secs / 1e9,
            "panel_gemm_gflop_per_s": None
            if gemm_s is None
            else rows * linear_flops(model) / gemm_s / 1e9,
        }
        out.append(row)
        share = (
            f", {row['fused_gflop_per_s'] / row['panel_gemm_gflop_per_s']:.0%} of the panel "
            f"GEMM's {row['panel_gemm_gflop_per_s']:.1f}"
            if row["panel_gemm_gflop_per_s"]
            else " (no panel GEMM here: the decode kernels ran it)"
        )
        print(
            f"  fused pass, {tenants} tenants x {rows_per} rows = {rows} rows: "
            f"{row['fused_pass_ms']:.1f} ms, {row['fused_gflop_per_s']:.1f} GFLOP/s{share}"
        )
    return out


def linear_flops(model) -> float:
    """FLOPs of one position through every linear map (the tied LM head included)."""
    linears = (torch.nn.Linear, _kernels.StreamLinear)  # the kernels' swap keeps the weight
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, linears))


def gemm_seconds(model, plan, rows: int) -> float | None:
    """Best seconds of the panel GEMM alone over every decoder linear and the lm_head at
    ``rows`` rows (the fused pass's threads), or None where this build has no panels."""
    lins = _fastpath._batch_lins(plan)
    head = getattr(model.lm_head, "_packed", lambda: None)()
    if not isinstance(head, _gemm.PanelWeight):
        head = _gemm.panels_for(model.lm_head.weight.data)
    if lins is None or head is None:
        return None
    threads = torch.get_num_threads()
    xs = {k: torch.randn(rows, k) for k in {lin.K for lin in lins}}
    ys = {n: torch.empty(rows, n) for n in {lin.N for lin in lins}}
    x_head = torch.randn(rows, head.k)

    def all_linears() -> None:
        for lin in lins:
            plan.lib.gemm_panels(
                lin.p, xs[lin.K].data_ptr(), ys[lin.N].data_ptr(), rows, lin.N, lin.K, threads
            )
        head(x_head)

    return best_s(all_linears)


async def tenant_runs(target, prompt, tenants_list, gamma, blocks_per_tenant) -> list[dict]:
    """Tenants replaying fixed draft blocks (no draft model: isolate the verifier's cost).
    The GFLOP/s printed is the whole run's: every verified position's FLOPs over its wall
    time, so it includes the batching's overhead (stacking caches) as well as the GEMMs."""
    rows = []
    per_position = flops_per_position(target.model, len(prompt) + 1)
    for batched in (False, True):
        for tenants in tenants_list:
            v = BatchedVerifier(
                target, max_batch=max(tenants_list) if batched else 1, max_wait_ms=2.0
            )
            done = 0

            async def tenant(sid: str, start: int, v: BatchedVerifier = v) -> None:
                nonlocal done
                length, last = start, prompt[-1]
                for b in range(blocks_per_tenant):
                    r = await v.verify(sid, Block(b, length, last, tuple(range(100, 100 + gamma))))
                    length, last, done = r.committed_len, r.next_token, done + 1

            async with trio.open_nursery() as nursery:
                await nursery.start(v.run)
                # prefill outside the timed part; distinct prompts so no tenant shares a cache
                sids = [
                    await v.open_session([i, *prompt], SamplingOptions()) for i in range(tenants)
                ]
                t0 = time.perf_counter()
                async with trio.open_nursery() as runs:
                    for sid in sids:
                        runs.start_soon(tenant, sid, len(prompt) + 1)
                secs = time.perf_counter() - t0
                nursery.cancel_scope.cancel()
            row = {
                "tenants": tenants,
                "batched": batched,
                "blocks_per_s": done / secs,
                "positions_per_s": done * (gamma + 1) / secs,
                "forwards": v.stats["batches"],
                "gflop_per_s": done * (gamma + 1) * per_position / secs / 1e9,
            }
            rows.append(row)
            print(
                f"  {tenants} tenants {'batched  ' if batched else 'unbatched'}: "
                f"{row['blocks_per_s']:6.2f} blocks/s, {row['positions_per_s']:6.1f} positions/s, "
                f"{row['forwards']} forwards, {row['gflop_per_s']:.1f} GFLOP/s"
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rtts", default="0,50,100,200")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--tenants", default="1,4,16")
    ap.add_argument("--blocks-per-tenant", type=int, default=4)
    ap.add_argument("--draft", default=None, help="draft folder (default: the default draft)")
    ap.add_argument("--skip-edge", action="store_true")
    ap.add_argument("--skip-verifier", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    target, draft = load_model(None), load_draft(args.draft)
    print(f"load average at start: {os.getloadavg()}")
    prompts = [chat_ids(target.tokenizer, p) for p in PROMPTS]
    print(f"torch threads: {torch.get_num_threads()} (draft and target share them)")

    seqs = [(len(p), p + target_generate(target, p, 64)) for p in prompts]
    agree, positions = agreement(target, draft, seqs)
    stats = draft_stats(draft.path)
    target_bytes, draft_bytes = resident_bytes(target.model), resident_bytes(draft.model)
    print(
        f"memory: target fp32 {target_bytes / 1e6:.0f} MB, draft W4A16 {draft_bytes / 1e6:.0f} MB"
    )
    draft_info = {
        "path": str(draft.path),
        "method": stats.get("method", "rtn"),
        "target_bytes": target_bytes,
        "draft_bytes_resident": draft_bytes,
        "group_size": draft.group_size,
        "act_dtype": str(draft.act_dtype),
        "decoder_linear_bytes_fp32": stats["decoder_linear_bytes_fp32"],
        "decoder_linear_bytes_int4": stats["decoder_linear_bytes_int4"],
        "greedy_agreement": agree,
        "agreement_positions": positions,
        "decode_ms_per_token_draft": decode_ms(draft.model, prompts[0]),
        "decode_ms_per_token_target": decode_ms(target.model, prompts[0]),
    }
    print(
        f"draft W4A16 g{draft.group_size}: decoder linears {stats['decoder_linear_bytes_fp32'] / 1e6:.0f} MB fp32 -> "
        f"{stats['decoder_linear_bytes_int4'] / 1e6:.0f} MB int4; greedy agreement {agree:.3f} over "
        f"{positions} positions; decode {draft_info['decode_ms_per_token_draft']:.1f} ms/token vs "
        f"target {draft_info['decode_ms_per_token_target']:.1f}"
    )
    rtts = [int(x) for x in args.rtts.split(",")]
    edge: list[dict] = []
    if not args.skip_edge:
        print(f"edge, {args.prompts} prompts x {args.new_tokens} tokens, gamma {args.gamma}:")
        edge = trio.run(
            edge_runs, target, draft, prompts[: args.prompts], rtts, args.gamma, args.new_tokens
        )
    tput: list[dict] = []
    rates: list[dict] = []
    if not args.skip_verifier:
        print(f"verifier, gamma {args.gamma}, {args.blocks_per_tenant} blocks per tenant:")
        tenants = [int(x) for x in args.tenants.split(",")]
        tput = trio.run(
            tenant_runs, target, prompts[0], tenants, args.gamma, args.blocks_per_tenant
        )
        for n in tenants:
            one, many = (
                next(r["blocks_per_s"] for r in tput if r["tenants"] == n and r["batched"] is b)
                for b in (False, True)
            )
            print(f"  {n} tenants: batched / one at a time {many / one:.2f}x")
        print(f"the batched pass alone ({torch.get_num_threads()} threads for its GEMMs):")
        rates = forward_rates(target, prompts[0], tenants, args.gamma)
        # What batching can buy here: one tenant's verify already runs at some rate; a batch
        # at most reaches the GEMM's, so their ratio bounds batched / one at a time.
        big = max(rates, key=lambda r: r["rows"], default=None)
        one = [r["gflop_per_s"] for r in tput if not r["batched"]]
        if big and big["panel_gemm_gflop_per_s"] and one:
            print(
                f"  bound on batched / one at a time here: the GEMM's "
                f"{big['panel_gemm_gflop_per_s']:.1f} GFLOP/s over one tenant's "
                f"{statistics.mean(one):.1f} = {big['panel_gemm_gflop_per_s'] / statistics.mean(one):.2f}x"
            )
    out = Path(__file__).parent / "results" / "speculation.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "threads": torch.get_num_threads(),
        "draft": draft_info,
        "load_average_end": os.getloadavg(),
        "edge": edge,
        "verifier": tput,
        "fused_pass": rates,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
