"""Verifier capacity: how many edge tenants ONE verifier serves, and how fast, per mode and RTT.

One real verifier process (the SmolLM2 target, ``BatchedVerifier`` with the node's defaults,
served over ``/p2pnode/verify/1`` as ``p2pnode join --role verifier`` does) and N edge tenants
(each an ``EdgeClient``; two share a libp2p node, and the verifier's
per-peer limits are doubled to match, so each tenant gets what one peer gets as deployed) in a second process, the WAN round trip injected by ``testnet/netns/wan.py``
(every libp2p TCP write held for the one-way delay in userspace, in both processes: the delay
the trials use). Each tenant runs ``--requests`` chat requests one after the other (prompts of
the chat workload, ``p2pnode.datasets.chat``: one shared system prompt, a user question each),
all tenants at once, in one of the modes:

- ``remote``: target-only remote generation (the verifier streams the target's tokens; batched
  with the other tenants' steps like any row);
- ``async``: asynchronous speculation (``edge.MODES["async"]``) with the verifier's lead;
- ``auto``: ``EdgeClient``'s choice between the two, measured per tenant (first request async,
  second remote, then the faster).

Edges replay a trace (the default): on 2 cores the draft of N tenants would take the
verifier's cores, so each tenant's draft is the REAL W4A16 draft's greedy choice at each
position of the request (computed once beforehand by the real draft, teacher-forced on the
target's output, which is what every draft step sees while its block can still be accepted),
returned after the real draft's measured step time (a sleep, so no core is taken). A draft
token after a wrong one is never compared, so the replay's acceptance equals the real draft's.
``--real-edges`` runs the real draft in the edge process instead (machines with cores to
spare; sampling, ``--temperature``, needs it). Every greedy output is checked against the
target's. Before each timed run every tenant's draft holds the KV of the prompts' shared
system turn (``DraftPrefix``), as the verifier's prefix cache does: both as after an app's
first request. The verifier's process is pinned to ``--verifier-core``, the edges' to
``--edge-core``, one torch thread each.

    python bench/verifier_capacity.py [--quick] [--tenants 1,2,4,8,16] [--rtts 0,50,100]
        [--modes remote,async,auto] [--requests 3] [--new-tokens 32] [--real-edges]
        [--prompt-set judge|tune]

Reports per (mode, RTT, N): total committed tokens/s (all tenants' tokens over the wall time of
the run), each tenant's inter-token latency p50 / p95 (the wait of each token after the one
before it; tokens committed together wait 0 after the first, so a burst shows as one long
gap), time to first token, acceptance, and the verifier's forward passes (rows and positions
per pass, busy share). Writes bench/results/verifier_capacity.json and .png (capacity and p95
inter-token latency against N, one line per mode and RTT).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trio

RESULTS = Path(__file__).parent / "results"
# Tenants per edge node: one node per tenant added DHT and connection chatter to the edges'
# one core (16 nodes: TTFT ~9 s at 1 tenant), so 2 tenants share a libp2p node (and its
# connection) and the verifier's per-peer limits are scaled to match (``_tenant_limits``).
TENANTS_PER_NODE = 2
# Judged on questions 0.., tuned (the verifier's block-size rule) on questions from TUNE_AT on.
TUNE_AT = 1000


def _one_thread() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def write_spec(folder: Path, rtts: list[int]) -> Path:
    """The cloud region (the verifier) and one edge region per RTT (one-way RTT/2)."""
    regions = ["cloud", *[f"r{r}" for r in rtts]]
    lines = ['name = "verifier-capacity"', "[network]", f"regions = {json.dumps(regions)}"]
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            delay = int(b[1:]) / 2 if a == "cloud" else 0.0
            lines += ["[[network.links]]", f'between = ["{a}", "{b}"]', f"delay_ms = {delay}"]
    lines += ["[nodes]", "count = 1", 'placement = ["cloud"]']
    path = folder / "spec.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _timeouts(spec: Path, region: str) -> dict:
    from p2pnode.testnet.netns import wan

    # Generous floors: on a loaded machine a 1-3 s ping limit marks the peer down mid-run.
    return {k: max(v, 15.0) for k, v in wan.suggested_timeouts(str(spec), region).items()}


# ---------------------------------------------------------------- the trace (computed once)


def chat_prompts(tok, n: int, prompt_set: str) -> list[list[int]]:
    from p2pnode.datasets.chat import system_prompts, user_questions

    system = system_prompts(1)[0]
    start = TUNE_AT if prompt_set == "tune" else 0
    out = []
    for q in user_questions()[start : start + n]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        out.append(list(tok.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]))
    return out


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def build_trace(n: int, new_tokens: int, prompt_set: str) -> dict:
    """The target's greedy output for each prompt, the real draft's greedy choice at each
    position of prompt + output (teacher-forced), and the draft's measured step times."""
    import torch
    from transformers import DynamicCache

    from p2pnode.inference.models import load_model
    from p2pnode.speculation.draft import load_draft
    from p2pnode.speculation.edge import target_generate

    target, draft = load_model(None), load_draft()
    prompts = chat_prompts(target.tokenizer, n, prompt_set)
    shared = _common_prefix(prompts)
    eos = list(target.eos_token_ids)
    refs, preds = [], []
    with torch.inference_mode():
        base_t, base_d = DynamicCache(), DynamicCache()
        target.model(input_ids=torch.tensor([prompts[0][:shared]]), past_key_values=base_t)
        draft.model(input_ids=torch.tensor([prompts[0][:shared]]), past_key_values=base_d)
        for p in prompts:
            cache, x, out = copy.deepcopy(base_t), torch.tensor([p[shared:]]), []
            while len(out) < new_tokens and not (out and out[-1] in eos):
                logits = target.model(input_ids=x, past_key_values=cache, logits_to_keep=1)
                out.append(int(logits.logits[0, -1].argmax()))
                x = torch.tensor([[out[-1]]])
            refs.append(out)
            seq = p + out
            logits = draft.model(
                input_ids=torch.tensor([seq[shared:]]), past_key_values=copy.deepcopy(base_d)
            ).logits[0]
            preds.append([0] * shared + logits.argmax(-1).tolist())  # preds[i]: after seq[:i+1]
        assert refs[0][:4] == target_generate(target, prompts[0], 4, eos_token_ids=eos)[:4]
        step_ms, rows_ms = _draft_ms(draft.model, prompts[0])
    return {
        "prompt_set": prompt_set,
        "new_tokens": new_tokens,
        "prompts": prompts,
        "refs": refs,
        "preds": preds,
        "draft_step_ms": step_ms,
        "draft_row_ms": rows_ms,
        "model_id": target.model_id,
        "vocab_size": target.vocab_size,
        "eos": eos,
    }


def _draft_ms(model, prompt: list[int]) -> tuple[float, float]:
    """Median ms of one draft decode step, and per row of a 16-row prefill run."""
    import torch
    from transformers import DynamicCache

    steps, runs = [], []
    cache = DynamicCache()
    model(input_ids=torch.tensor([prompt[:-17]]), past_key_values=cache)
    for _ in range(9):
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([prompt[-17:-16]]), past_key_values=cache)
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model(input_ids=torch.tensor([prompt[-16:]]), past_key_values=cache)
        runs.append((time.perf_counter() - t0) / 16)
        cache.crop(-17)
    return 1000 * statistics.median(steps), 1000 * statistics.median(runs)


def load_trace(n: int, new_tokens: int, prompt_set: str) -> dict:
    path = RESULTS / f"verifier_capacity_trace_{prompt_set}_{n}x{new_tokens}.json"
    if path.is_file():
        return json.loads(path.read_text())
    t0 = time.perf_counter()
    trace = build_trace(n, new_tokens, prompt_set)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    print(f"trace of {n} requests built in {time.perf_counter() - t0:.0f} s -> {path}")
    return trace


class ReplayDraft:
    """The draft's forward, replayed: the real draft's choice at each position (``preds``),
    after its measured time (a sleep, in the caller's worker thread). Positions are counted
    in the caller's KV cache, which gets a 1-wide placeholder entry per token, so ``crop``
    works as on the real draft's cache."""

    def __init__(self, vocab: int, step_ms: float, row_ms: float) -> None:
        import torch

        self.config = type("Config", (), {"vocab_size": vocab})()
        self.vocab, self.step_s, self.row_s = vocab, step_ms / 1000, row_ms / 1000
        self.preds: list[int] = []  # set by the tenant before each request
        self._torch = torch

    def __call__(self, *, input_ids, past_key_values, **_):
        torch = self._torch
        n = int(input_ids.shape[1])
        past = past_key_values.get_seq_length()
        past_key_values.update(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), 0)
        time.sleep(self.step_s if n == 1 else n * self.row_s)
        at = past + n - 1
        token = self.preds[at] if at < len(self.preds) else 0
        logits = torch.zeros(1, 1, self.vocab)
        logits[0, 0, token] = 1.0
        return type("Out", (), {"logits": logits})()


# ---------------------------------------------------------------- verifier process


def _tenant_limits():
    """The per-peer limits of ``overlay/limits.py`` for each TENANT sharing a node: the
    verify budgets and the session cap times ``TENANTS_PER_NODE`` (at 1x, 2 tenants opening
    a session and a spare stream per request ran out of the 8-open burst and were refused)."""
    from p2pnode.overlay.limits import Budget, LimitsConfig

    base, k = LimitsConfig(), TENANTS_PER_NODE

    def scaled(b: Budget) -> Budget:
        many = None if b.max_concurrent is None else b.max_concurrent * k
        return dataclasses.replace(
            b, rate_per_s=b.rate_per_s * k, burst=b.burst * k, max_concurrent=many
        )

    return dataclasses.replace(
        base,
        verify=scaled(base.verify),
        verify_block=scaled(base.verify_block),
        verify_lead=scaled(base.verify_lead),
        max_sessions_per_peer=base.max_sessions_per_peer * k,
    )


def serve(spec: Path, block_control: bool) -> None:
    """The verifier child: prints its address, then answers ``stats`` lines on stdin with the
    forward passes since the last ``stats`` (rows and positions of each, busy seconds)."""
    _one_thread()
    from p2pnode.identity import NodeKey
    from p2pnode.inference.models import load_model
    from p2pnode.overlay.limits import PeerLimiter
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
    from p2pnode.speculation.edge import target_generate
    from p2pnode.speculation.protocol import serve_verifier
    from p2pnode.speculation.verify import BatchedVerifier
    from p2pnode.testnet.netns import wan

    wan.install(str(spec), "cloud")
    target = load_model(None)
    target_generate(target, [1, 2, 3], 2)  # warm-up
    passes: list[tuple[int, int, float]] = []

    async def main() -> None:
        ip = wan.node_ip(wan.load_spec(str(spec)), "cloud", 0)
        cfg = OverlayConfig(
            key=NodeKey.generate(),
            listen_addrs=[f"/ip4/{ip}/tcp/0"],
            models=[target.model_id],
            roles={"verifier"},
            **_timeouts(spec, "cloud"),
        )
        # the node's defaults (bootstrap/node.py)
        verifier = BatchedVerifier(target, block_control=block_control)
        compute = verifier._compute

        def timed(rows):
            t0 = time.perf_counter()
            out = compute(rows)
            passes.append((len(rows), sum(len(r.inputs) for r in rows), time.perf_counter() - t0))
            return out

        verifier._compute = timed
        async with open_overlay_node(cfg) as node, trio.open_nursery() as nursery:
            await nursery.start(verifier.run)
            serve_verifier(node, verifier, limiter=PeerLimiter(_tenant_limits()))
            info = {"addr": f"{node.addrs[0]}", "peer_id": node.peer_id}
            print(json.dumps(info), flush=True)
            while line := await trio.to_thread.run_sync(sys.stdin.readline):
                if line.strip() == "stats":
                    got, passes[:] = list(passes), []
                    costs = {k: 1000 * v for k, v in verifier.pass_cost.items()}
                    reply = {"passes": got, "stats": verifier.stats, "pass_ms_per_position": costs}
                    print(json.dumps(reply), flush=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------- edge tenants


@dataclass
class Request:
    prompt: list[int]
    ref: list[int]
    preds: list[int]


async def tenant_run(edge, draft, requests: list[Request], mode: str, new_tokens: int, temp):
    """One tenant's requests, one after the other; per request: tokens, commit stamps, stats."""
    from p2pnode.speculation import NoVerifier

    out = []
    for req in requests:
        if isinstance(draft.model, ReplayDraft):
            draft.model.preds = req.preds
        t0, failures = time.perf_counter(), 0
        while True:  # a request the verifier dropped is asked again (and counted): at most 3
            stamps: list[float] = []
            try:
                r = await _one_request(edge, req, new_tokens, temp, len(out), mode, stamps)
                break
            except NoVerifier:
                failures += 1
                if failures == 3:
                    raise
        out.append((req, r, t0, stamps, failures))
    return out


async def _one_request(edge, req, new_tokens, temp, seed, mode, stamps):
    send, recv = trio.open_memory_channel[list[int]](math.inf)
    async with trio.open_nursery() as nursery:

        async def stamp() -> None:
            async for new in recv:
                stamps.extend([time.perf_counter()] * len(new))

        nursery.start_soon(stamp)
        async with send:
            return await edge.generate(
                req.prompt, new_tokens, temp, seed=seed, mode=mode, _sink=send
            )


async def run_config(nodes, peer_id, draft_for, requests, mode, n, new_tokens, temp) -> dict:
    from p2pnode.speculation.client import EdgeClient

    results: list[list] = [[] for _ in range(n)]
    clients = []
    for i in range(n):
        d = draft_for(i)
        clients.append(
            (
                EdgeClient(
                    nodes[i // TENANTS_PER_NODE], d, verifiers=[peer_id], result_timeout_s=120
                ),
                d,
            )
        )
    system = shared_prefix([r.prompt for r in requests])
    async with trio.open_nursery() as nursery:  # untimed: each draft warm on the system prompt
        for client, d in clients:
            nursery.start_soon(warm_draft, client, d, system)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, (client, d) in enumerate(clients):
            mine = requests_for(requests, i, n)

            async def one(i=i, client=client, d=d, mine=mine) -> None:
                results[i] = await tenant_run(client, d, mine, mode, new_tokens, temp)

            nursery.start_soon(one)
    wall = time.perf_counter() - t0
    for client, _ in clients:
        await client.aclose()
    return summarize(results, wall, temp)


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The tokens every prompt starts with (the chat workload's system turn)."""
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return prompts[0][:i]
    return prompts[0][:n]


async def warm_draft(client, draft, system: list[int]) -> None:
    """The tenant's draft KV of the shared system prompt in its ``DraftPrefix``, as an app's
    edge holds it after its first request. Why: the verifier's prefix cache is warmed on it
    before the timed runs, and a cold draft prefilled the 375-token prompt at the replay's
    10 ms a row (~3.9 s) while the verifier's lead answered the whole request: async was
    timed on that prefill, once per tenant of three requests."""
    from p2pnode.speculation import DraftRunner, SamplingOptions

    if len(system) < 2:
        return
    runner = DraftRunner(draft, SamplingOptions(), top_k=8, seed=None)
    runner.tokens = list(system)
    await trio.to_thread.run_sync(runner.prefill)  # all but the last token
    client.draft_prefix.keep(runner, runner.tokens)


def requests_for(requests: list[Request], i: int, n: int) -> list[Request]:
    """Tenant ``i`` of ``n``: its own requests (every tenant asks other questions)."""
    per = len(requests) // max(n, 1)
    per = max(1, min(per, REQUESTS_PER_TENANT))
    return [requests[(i * per + k) % len(requests)] for k in range(per)]


REQUESTS_PER_TENANT = 3  # set from --requests


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def summarize(results: list[list], wall: float, temp: float) -> dict:
    tokens, equal, p50s, p95s, ttfts = 0, True, [], [], []
    acc = drafted = lead = failures = 0
    modes: dict[str, int] = {}
    for per_tenant in results:
        gaps = []
        for req, r, t0, stamps, failed in per_tenant:
            failures += failed
            tokens += len(r.tokens)
            if temp == 0:
                equal &= r.tokens == req.ref[: len(r.tokens)] and len(r.tokens) == len(req.ref)
            if stamps:
                ttfts.append(stamps[0] - t0)
                gaps += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            acc, drafted = acc + r.stats.accepted, drafted + r.stats.drafted
            lead += r.stats.lead_tokens
            modes[r.mode] = modes.get(r.mode, 0) + 1
        p50s.append(1000 * _pct(gaps, 0.5))
        p95s.append(1000 * _pct(gaps, 0.95))
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "itl_p50_ms": statistics.mean(p50s),
        "itl_p95_ms": statistics.mean(p95s),
        "itl_p95_worst_ms": max(p95s),
        "ttft_ms": 1000 * statistics.mean(ttfts) if ttfts else 0.0,
        "ttft_p95_ms": 1000 * _pct(ttfts, 0.95),
        "acceptance": acc / drafted if drafted else None,
        "lead_tokens": lead,
        "modes_run": modes,
        "equal_to_target": equal if temp == 0 else None,
        "retried_requests": failures,
    }


def pass_stats(passes: list) -> dict:
    if not passes:
        return {"forwards": 0}
    rows = [p[0] for p in passes]
    pos = [p[1] for p in passes]
    return {
        "forwards": len(passes),
        "rows_mean": statistics.mean(rows),
        "rows_max": max(rows),
        "positions_mean": statistics.mean(pos),
        "busy_s": sum(p[2] for p in passes),
        "forward_ms_mean": 1000 * statistics.mean(p[2] for p in passes),
    }


async def edge_main(spec: Path, info: dict, child, trace: dict, args) -> list[dict]:
    from p2pnode.identity import NodeKey
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
    from p2pnode.speculation.draft import DraftModel, load_draft
    from p2pnode.testnet.netns import wan

    tenants = [int(x) for x in args.tenants.split(",")]
    modes = args.modes.split(",")
    reqs = [
        Request(p, r, d)
        for p, r, d in zip(trace["prompts"], trace["refs"], trace["preds"], strict=True)
    ]
    real = load_draft()  # its tokenizer serves the replay too

    def draft_for(i: int) -> DraftModel:
        if args.real_edges:
            return real
        replay = ReplayDraft(trace["vocab_size"], trace["draft_step_ms"], trace["draft_row_ms"])
        return dataclasses.replace(real, model=replay)

    async def verifier_passes() -> dict:
        child.stdin.write(b"stats\n")
        child.stdin.flush()
        reply = json.loads(await trio.to_thread.run_sync(child.stdout.readline))
        return pass_stats(reply["passes"]) | {"pass_ms_per_position": reply["pass_ms_per_position"]}

    rows: list[dict] = []
    for rtt in [int(x) for x in args.rtts.split(",")]:
        region = f"r{rtt}"
        wan.install(str(spec), region)
        loaded = wan.load_spec(str(spec))
        async with contextlib_nodes(
            [
                OverlayConfig(
                    key=NodeKey.generate(),
                    listen_addrs=[f"/ip4/{wan.node_ip(loaded, region, k)}/tcp/0"],
                    bootstrap=[info["addr"]],
                    roles={"edge"},
                    **_timeouts(spec, region),
                )
                for k in range(math.ceil(max(tenants) / TENANTS_PER_NODE))
            ],
            open_overlay_node,
        ) as nodes:
            # warm every tenant's connection and stream path (untimed)
            # One request first: the verifier's prefix cache then holds the shared system
            # prompt (16 sessions opening at once on a cold cache prefilled 375 tokens each,
            # one after another, past the edge's 30 s open timeout); then every node's path.
            await run_config(nodes, info["peer_id"], draft_for, reqs, "remote", 1, 4, 0.0)
            warm = len(nodes) * TENANTS_PER_NODE
            await run_config(nodes, info["peer_id"], draft_for, reqs, "remote", warm, 4, 0.0)
            await verifier_passes()
            for mode in modes:
                for n in tenants:
                    load0 = os.getloadavg()[0]
                    got = await run_config(
                        nodes,
                        info["peer_id"],
                        draft_for,
                        reqs,
                        mode,
                        n,
                        args.new_tokens,
                        args.temperature,
                    )
                    got.update(await verifier_passes())
                    got.update(mode=mode, rtt_ms=rtt, tenants=n, load=[load0, os.getloadavg()[0]])
                    got["verifier_busy"] = got.get("busy_s", 0.0) / got["wall_s"]
                    rows.append(got)
                    print(fmt(got), flush=True)
    return rows


class contextlib_nodes:  # noqa: N801 (an async context manager over many nodes)
    """Open all ``configs`` as overlay nodes at once; close them all on exit."""

    def __init__(self, configs, opener) -> None:
        from contextlib import AsyncExitStack

        self.configs, self.opener, self.stack = configs, opener, AsyncExitStack()

    async def __aenter__(self):
        await self.stack.__aenter__()
        return [await self.stack.enter_async_context(self.opener(c)) for c in self.configs]

    async def __aexit__(self, *exc):
        return await self.stack.__aexit__(*exc)


def fmt(r: dict) -> str:
    acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "  - "
    eq = {True: "", False: " OUTPUT DIFFERS", None: ""}[r["equal_to_target"]]
    return (
        f"  RTT {r['rtt_ms']:>3} ms {r['mode']:>6} N={r['tenants']:>2}: "
        f"{r['tokens_per_s']:6.1f} tok/s total, ITL p50 {r['itl_p50_ms']:5.0f} p95 "
        f"{r['itl_p95_ms']:5.0f} ms, TTFT {r['ttft_ms']:5.0f} ms, acc {acc}, "
        f"rows/pass {r.get('rows_mean', 0):.1f} positions/pass {r.get('positions_mean', 0):.1f} "
        f"{r.get('forward_ms_mean', 0):.0f} ms/pass, busy {r['verifier_busy']:.0%}, "
        f"load {r['load'][0]:.1f}{eq}"
        + (f", {r['retried_requests']} requests retried" if r["retried_requests"] else "")
    )


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = dict.fromkeys((r["mode"], r["rtt_ms"]) for r in rows)
    for mode, rtt in keys:
        pts = [r for r in rows if r["mode"] == mode and r["rtt_ms"] == rtt]
        xs = [r["tenants"] for r in pts]
        style = {"remote": "-", "async": "--", "auto": ":"}.get(mode, "-.")
        a1.plot(xs, [r["tokens_per_s"] for r in pts], style, marker="o", label=f"{mode} {rtt} ms")
        a2.plot(xs, [r["itl_p95_ms"] for r in pts], style, marker="o", label=f"{mode} {rtt} ms")
    for ax, label in ((a1, "total committed tokens/s"), (a2, "per-tenant p95 inter-token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("edge tenants on one verifier")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.suptitle("one verifier (SmolLM2-135M, 1 core): capacity per mode and RTT")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    global REQUESTS_PER_TENANT
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tenants", default="1,2,4,8,16")
    ap.add_argument("--rtts", default="0,50,100")
    ap.add_argument("--modes", default="remote,async,auto")
    ap.add_argument("--requests", type=int, default=3, help="requests per tenant, in turn")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompt-set", choices=["judge", "tune"], default="judge")
    ap.add_argument("--real-edges", action="store_true", help="the real draft in the edges")
    ap.add_argument("--quick", action="store_true", help="N 1,4,16; RTT 0,100; 2 x 16 tokens")
    ap.add_argument("--edge-core", type=int, default=0)
    ap.add_argument("--verifier-core", type=int, default=1)
    ap.add_argument("--out", default="verifier_capacity")
    ap.add_argument(
        "--no-block-control",
        action="store_true",
        help="the verifier gives no block-size advice and checks its full lookup guesses",
    )
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, not args.no_block_control)
        return
    if args.quick:
        args.tenants, args.rtts, args.requests, args.new_tokens = "1,4,16", "0,100", 2, 16
    if args.temperature > 0 and not args.real_edges:
        raise SystemExit("--temperature needs --real-edges: the trace holds greedy choices")
    REQUESTS_PER_TENANT = args.requests
    n_req = max(int(x) for x in args.tenants.split(",")) * args.requests
    trace = load_trace(n_req, args.new_tokens, args.prompt_set)
    os.sched_setaffinity(0, {args.edge_core})
    _one_thread()
    edges = "REAL draft in the edge process" if args.real_edges else "edges REPLAY the real "
    if not args.real_edges:
        edges += (
            f"draft's trace (its greedy choice per position, each after the measured draft "
            f"step of {trace['draft_step_ms']:.1f} ms, a sleep)"
        )
    print(
        f"one verifier on core {args.verifier_core}, tenants on core {args.edge_core}; {edges}; "
        f"{args.requests} requests x {args.new_tokens} tokens per tenant; verifier block-size "
        f"control {'off' if args.no_block_control else 'on'}; load at start {os.getloadavg()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_spec(Path(tmp), [int(x) for x in args.rtts.split(",")])
        cmd = ["taskset", "-c", str(args.verifier_core), sys.executable, __file__]
        cmd += ["--serve", str(spec)] + (["--no-block-control"] if args.no_block_control else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            line = child.stdout.readline()
            if not line:
                raise SystemExit("the verifier process exited before serving: see its stderr")
            try:
                rows = trio.run(edge_main, spec, json.loads(line), child, trace, args)
            except BaseExceptionGroup as group:  # nested once per open node: show the cause
                print(f"verifier process: {'alive' if child.poll() is None else child.poll()}")
                raise _leaf(group) from None
        finally:
            child.stdin.close()
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    out = RESULTS / f"{args.out}.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "edges": "real" if args.real_edges else "replayed trace",
        "block_control": not args.no_block_control,
        "draft_step_ms": trace["draft_step_ms"],
        "args": vars(args) | {"serve": None},
        "rows": rows,
        "ratios": ratios(rows),
        "load_end": os.getloadavg(),
    }
    out.write_text(json.dumps(result, indent=2, default=str))
    for line in result["ratios"]:
        print(line)
    print(f"wrote {out} and {plot(rows, out.with_suffix('.png'))}")


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def ratios(rows: list[dict]) -> list[str]:
    """Speculation (async, auto) against target-only at each RTT and N: tokens/s and p95 ITL."""
    base = {(r["rtt_ms"], r["tenants"]): r for r in rows if r["mode"] == "remote"}
    out = []
    for r in rows:
        b = base.get((r["rtt_ms"], r["tenants"]))
        if r["mode"] == "remote" or b is None:
            continue
        out.append(
            f"RTT {r['rtt_ms']:>3} N={r['tenants']:>2} {r['mode']:>5}/remote: tokens/s "
            f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x, p95 ITL "
            f"{r['itl_p95_ms']:.0f} vs {b['itl_p95_ms']:.0f} ms"
        )
    return out


if __name__ == "__main__":
    main()
