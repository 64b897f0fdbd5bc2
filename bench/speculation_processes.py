"""Speculative decoding as deployed: the edge and the verifier in SEPARATE OS processes, each
pinned to its own core with one torch thread, talking over the real ``/p2pnode/verify/1``
libp2p protocol, the WAN round trip injected by ``testnet/netns/wan.py`` (every TCP write of libp2p
is held for the one-way delay in userspace, in both processes, so a round trip costs the RTT).

    python bench/speculation_processes.py [--rtts 0,50,100,200] [--new-tokens 32] [--gamma 4]
        [--modes sync:1:4,async:2:4,async:3:2] [--prompts 2] [--edge-core 0] [--verifier-core 1]
        [--prompt-set judge|tune] [--lookup N]

A mode is NAME:DEPTH:GAMMA[:LEAD] (depth = blocks in flight; 1 is the synchronous baseline;
LEAD > 0: the verifier keeps decoding on its own for up to LEAD tokens while no block of the
session waits, see ``speculation/verify.py``). The
verifier child (``--serve``) is started under ``taskset -c VERIFIER_CORE``; this process pins
itself to EDGE_CORE. Regions of a generated spec: "cloud" (the verifier) and "rN" (the edge
at RTT N ms, one-way N/2 ms); the edge opens a fresh libp2p node per RTT, dialing from rN.

Target-only remote generation (``target_remote``) is measured over the same protocol:
``edge.remote_generate`` opens a session with a lead of all the tokens, so the verifier
streams the target's own tokens (no draft). ``target_local+rtt`` is the verifier's decoding
timed in its own process plus one round trip per request: what streaming could reach at best.
``--delay-in transport`` puts the delay above an undelayed libp2p stream instead (the edge holds
each block and each result for RTT/2: ``DelayedTransport``), to tell the protocol's cost under
wan.py's per-write delays apart from the algorithm's.
``--warm`` starts each session on a stream opened beforehand (as ``EdgeClient`` does for every
request after its first), so the first token pays no stream negotiation (2 RTT in py-libp2p).
Every speculative output is checked token for token against the target's greedy output.
``--prompt-set tune`` runs on other prompts (``TUNE_PROMPTS``): the edge's constants are chosen
there, and the figures reported on the default judging set. ``--lookup N``: the prompt-lookup
guesses the verifier's lead steps check (``speculation/_lookup.py``; 0 turns them off).
Writes bench/results/speculation_processes.json. ``SPEC_TRACE=FILE`` also writes a timeline:
``FILE.verifier`` (each forward pass: wall-clock start, end, rows) and ``FILE.edge`` (each draft
step, block sent, verdict and lead token received), to see what each side waits on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import trio

PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer with details.",
    "List three uses of Python.",
]
# The prompts an edge constant may be chosen on (``--prompt-set tune``), kept apart from the
# judging ones above, which only measure.
TUNE_PROMPTS = [
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarize the plot of Romeo and Juliet.",
]
PROMPT_SETS = {"judge": PROMPTS, "tune": TUNE_PROMPTS}


def _one_thread() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # one core each: >1 thread on a shared core collapses (OpenMP)


def write_spec(folder: Path, rtts: list[int]) -> Path:
    regions = ["cloud", *[f"r{r}" for r in rtts]]
    lines = ['name = "speculation-processes"', "[network]", f"regions = {json.dumps(regions)}"]
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            delay = int(b[1:]) / 2 if a == "cloud" else 0.0
            lines += ["[[network.links]]", f'between = ["{a}", "{b}"]', f"delay_ms = {delay}"]
    lines += ["[nodes]", "count = 1", 'placement = ["cloud"]']
    path = folder / "spec.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def chat_ids(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"])


def forward_ms(model, prompt: list[int], width: int, reps: int = 7) -> float:
    """Median ms of one cached forward over ``width`` new positions (a decode step at 1)."""
    import torch
    from transformers import DynamicCache

    times = []
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        for _ in range(reps):
            t0 = time.perf_counter()
            model(input_ids=torch.tensor([prompt[-width:]]), past_key_values=cache, use_cache=True)
            times.append(1000 * (time.perf_counter() - t0))
            cache.crop(-width)
    return statistics.median(times)


def _timeouts(spec: Path, region: str) -> dict:
    from p2pnode.testnet.netns import wan

    # Generous floors: on a machine loaded by others a 1-3 s ping/connect limit marks the peer
    # down and libp2p drops the connection mid-session (seen at load ~20).
    return {k: max(v, 15.0) for k, v in wan.suggested_timeouts(str(spec), region).items()}


class DelayedTransport:
    """``--delay-in transport``: a one-way delay on each direction of a ``VerifierTransport``, in
    this (edge) process only, FIFO like a stream; the libp2p connection itself is not delayed."""

    def __init__(self, inner, one_way_s: float, nursery) -> None:
        self.inner, self.delay, self.nursery = inner, one_way_s, nursery
        self.up_send, self.up_recv = trio.open_memory_channel(math.inf)
        self.down_send, self.down_recv = trio.open_memory_channel(math.inf)

    async def open(self, prompt, options, *, lead: int = 0) -> int:
        await trio.sleep(self.delay)
        granted = await self.inner.open(prompt, options, lead=lead)
        await trio.sleep(self.delay)
        self.nursery.start_soon(self._up)
        self.nursery.start_soon(self._down)
        return granted

    async def _up(self) -> None:
        async for due, block in self.up_recv:
            await trio.sleep_until(due)
            await self.inner.send_block(block)

    async def _down(self) -> None:
        while True:
            try:
                res = await self.inner.receive_result()
            except Exception as exc:  # handed to the reader in order
                res = exc
            self.down_send.send_nowait((trio.current_time() + self.delay, res))
            if isinstance(res, Exception):
                return

    async def send_block(self, block) -> None:
        self.up_send.send_nowait((trio.current_time() + self.delay, block))

    async def receive_result(self):
        due, res = await self.down_recv.receive()
        await trio.sleep_until(due)
        if isinstance(res, Exception):
            raise res
        return res

    async def close(self) -> None:
        await self.inner.close()


# ---------------------------------------------------------------- verifier process


def serve(spec: Path, n_prompts: int, new_tokens: int, texts: list[str], lookup: int) -> None:
    _one_thread()
    from p2pnode.identity import NodeKey
    from p2pnode.inference.models import load_model
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
    from p2pnode.speculation.edge import target_generate
    from p2pnode.speculation.protocol import serve_verifier
    from p2pnode.speculation.verify import BatchedVerifier
    from p2pnode.testnet.netns import wan

    wan.install(str(spec), "cloud")
    trace = os.environ.get("SPEC_TRACE")
    target = load_model(None)
    prompts = [chat_ids(target.tokenizer, p) for p in texts[:n_prompts]]
    target_generate(target, prompts[0], 4)  # warm-up
    t0 = time.perf_counter()
    refs = [
        target_generate(target, p, new_tokens, eos_token_ids=target.eos_token_ids) for p in prompts
    ]
    local_s = time.perf_counter() - t0
    verify_ms = {k: forward_ms(target.model, prompts[0], k + 1) for k in (0, 4)}

    async def main() -> None:
        ip = wan.node_ip(wan.load_spec(str(spec)), "cloud", 0)
        cfg = OverlayConfig(
            key=NodeKey.generate(),
            listen_addrs=[f"/ip4/{ip}/tcp/0"],
            models=[target.model_id],
            roles={"verifier"},
            **_timeouts(spec, "cloud"),
        )
        verifier = BatchedVerifier(target, lookup=lookup)
        if trace:
            _trace_verifier(verifier, trace + ".verifier")
        async with open_overlay_node(cfg) as node, trio.open_nursery() as nursery:
            await nursery.start(verifier.run)
            serve_verifier(node, verifier)
            info = {
                "addr": f"{node.addrs[0]}",
                "peer_id": node.peer_id,
                "model_id": target.model_id,
                "refs": refs,
                "texts": texts[:n_prompts],
                "target_seconds": local_s,
                "target_tokens": sum(len(r) for r in refs),
                "verify_ms": verify_ms,
            }
            print(json.dumps(info), flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the edge closes our stdin
            nursery.cancel_scope.cancel()

    trio.run(main)


def _trace_verifier(verifier, path: str) -> None:
    """``SPEC_TRACE=FILE``: one JSON line per forward pass (wall-clock start and end, each row's
    kind and draft length), to see where the verifier's time goes."""
    out = open(path, "w")  # noqa: SIM115 (open for the process's life)
    compute = verifier._compute

    def traced(rows):
        t0 = time.time()
        res = compute(rows)
        kinds = [("lead" if r.waiter is None else f"block{len(r.draft)}") for r in rows]
        out.write(json.dumps({"t0": t0, "t1": time.time(), "rows": kinds}) + "\n")
        out.flush()
        return res

    verifier._compute = traced


class TracedTransport:
    """``SPEC_TRACE=FILE``: the edge's sends and receipts with wall-clock times."""

    def __init__(self, inner, out) -> None:
        self.inner, self.out = inner, out
        self.max_block = None

    def _log(self, **kw) -> None:
        self.out.write(json.dumps({"t": time.time(), **kw}) + "\n")

    async def open(self, prompt, options, *, lead: int = 0) -> int:
        self._log(ev="open")
        granted = await self.inner.open(prompt, options, lead=lead)
        self.max_block = getattr(self.inner, "max_block", None)
        self._log(ev="opened")
        return granted

    async def send_block(self, block) -> None:
        self._log(ev="send", n=block.number, base=block.base_len, k=len(block.tokens))
        await self.inner.send_block(block)

    async def receive_result(self):
        res = await self.inner.receive_result()
        if hasattr(res, "position"):
            self._log(ev="lead", pos=res.position)
        else:
            self._log(ev="result", n=res.number, acc=res.accepted, clen=res.committed_len)
        return res

    async def close(self) -> None:
        self._log(ev="close")
        await self.inner.close()


# ---------------------------------------------------------------- edge process


async def edge_runs(
    spec: Path, info: dict, rtts: list[int], modes, new_tokens: int, delay_in: str, warm: bool
) -> list[dict]:
    from p2pnode.identity import NodeKey
    from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
    from p2pnode.speculation._flight import DraftHistory
    from p2pnode.speculation.draft import load_draft
    from p2pnode.speculation.edge import remote_generate, speculative_generate
    from p2pnode.speculation.protocol import P2PVerifierTransport, open_spare
    from p2pnode.speculation.verify import VerifierError
    from p2pnode.testnet.netns import wan

    draft = load_draft()
    trace = os.environ.get("SPEC_TRACE")
    edge_trace = open(trace + ".edge", "w") if trace else None  # noqa: SIM115, ASYNC230
    if edge_trace is not None:
        from p2pnode.speculation import edge

        extend = edge.DraftRunner.extend

        def traced_extend(self, n, *, argmax=False):
            t0 = time.time()
            out = extend(self, n, argmax=argmax)
            edge_trace.write(json.dumps({"t0": t0, "t": time.time(), "ev": "draft"}) + "\n")
            return out

        edge.DraftRunner.extend = traced_extend
    eos = (draft.tokenizer.eos_token_id,)
    prompts = [chat_ids(draft.tokenizer, p) for p in info["texts"][: len(info["refs"])]]
    t_d = forward_ms(draft.model, prompts[0], 1)
    v0, v4 = info["verify_ms"]["0"], info["verify_ms"]["4"]

    def t_v(k: int) -> float:
        return v0 + (v4 - v0) * k / 4

    print(f"draft step {t_d:.1f} ms; verify 1 position {v0:.1f} ms, 5 positions {v4:.1f} ms")
    rows: list[dict] = []
    for rtt in rtts:
        # What one edge learns about a verifier this far away, as EdgeClient keeps per verifier.
        history = DraftHistory()
        region = f"r{rtt}"
        if delay_in == "transport":
            region = f"r{rtts[0]}"  # connections undelayed when rtts[0] is 0
        wan.install(str(spec), region)
        ip = wan.node_ip(wan.load_spec(str(spec)), region, 0)
        cfg = OverlayConfig(
            key=NodeKey.generate(),
            listen_addrs=[f"/ip4/{ip}/tcp/0"],
            bootstrap=[info["addr"]],
            roles={"edge"},
            **_timeouts(spec, region),
        )
        async with open_overlay_node(cfg) as node:

            async def run(prompt, depth, gamma, n, lead=0, node=node, rtt=rtt, history=history):
                spare = await open_spare(node, info["peer_id"]) if warm else None
                stamps: list[float] = [time.perf_counter()]  # start, then one per token
                tr = P2PVerifierTransport(node, info["peer_id"], info["model_id"], spare=spare)
                on_commit = lambda new: stamps.extend([time.perf_counter()] * len(new))  # noqa: E731
                async with trio.open_nursery() as nursery:
                    if delay_in == "transport":
                        tr = DelayedTransport(tr, rtt / 2000, nursery)
                    if edge_trace is not None:
                        edge_trace.write(json.dumps({"run": [rtt, depth, gamma, lead]}) + "\n")
                        tr = TracedTransport(tr, edge_trace)
                    if depth == 0:  # target-only remote generation
                        r = await remote_generate(
                            tr, prompt, n, eos_token_ids=eos, on_commit=on_commit
                        )
                    else:
                        r = await speculative_generate(
                            draft,
                            tr,
                            prompt,
                            n,
                            gamma=gamma,
                            depth=depth,
                            lead=lead,
                            eos_token_ids=eos,
                            on_commit=on_commit,
                            history=history,
                        )
                    nursery.cancel_scope.cancel()
                return r, stamps

            await run(prompts[0], 2, 4, 6)  # warm the connection and the stream path
            secs_local = info["target_seconds"]
            n_local = info["target_tokens"]
            rows.append(
                {
                    "rtt_ms": rtt,
                    "mode": "target_local+rtt",
                    "tokens_per_s": n_local / (secs_local + rtt / 1000 * len(prompts)),
                    "inter_token_ms": 1000 * (secs_local + rtt / 1000 * len(prompts)) / n_local,
                    "inter_token_after_first_ms": 1000 * secs_local / n_local,
                }
            )
            for name, depth, gamma, lead in [("target_remote", 0, 0, 0), *modes]:
                tot = {"n": 0, "secs": 0.0, "acc": 0, "rej": 0, "drafted": 0, "blocks": 0}
                tot.update(stale=0, sent=0)
                equal = True
                for p, ref in zip(prompts, info["refs"], strict=True):
                    try:
                        r, stamps = await run(p, depth, gamma, new_tokens, lead)
                    except VerifierError as exc:  # retried once, and counted
                        print(f"  {name}: {exc!r}; retrying", flush=True)
                        tot["failures"] = tot.get("failures", 0) + 1
                        r, stamps = await run(p, depth, gamma, new_tokens, lead)
                    equal &= r.tokens == ref
                    s = r.stats
                    tot["n"] += len(r.tokens)
                    tot["secs"] += s.seconds
                    tot["acc"] += s.accepted
                    tot["rej"] += s.rejections
                    tot["drafted"] += s.drafted
                    tot["blocks"] += s.blocks_verified
                    tot["stale"] += s.blocks_stale
                    tot["sent"] += s.blocks_sent
                    tot["lead"] = tot.get("lead", 0) + s.lead_tokens
                    tot["lead_only"] = tot.get("lead_only", 0) + s.lead_only
                    tot["first"] = tot.get("first", 0.0) + stamps[1] - stamps[0]
                    tot["gaps"] = tot.get("gaps", 0.0) + stamps[-1] - stamps[1]
                    tot["n_gaps"] = tot.get("n_gaps", 0) + len(stamps) - 2
                alpha = tot["acc"] / max(tot["acc"] + tot["rej"], 1)
                row = {
                    "rtt_ms": rtt,
                    "mode": name,
                    "depth": depth,
                    "gamma": gamma,
                    "lead": lead,
                    "lead_tokens": tot.get("lead", 0),
                    "lead_only_switches": tot.get("lead_only", 0),
                    "tokens_per_s": tot["n"] / tot["secs"],
                    "inter_token_ms": 1000 * tot["secs"] / tot["n"],
                    # after the first token: (last commit - first commit) / tokens in between
                    "inter_token_after_first_ms": 1000 * tot["gaps"] / max(tot["n_gaps"], 1),
                    "first_token_ms": 1000 * tot["first"] / len(prompts),
                    "acceptance_per_drafted": tot["acc"] / max(tot["drafted"], 1),
                    "alpha": alpha,
                    "tokens_per_block": (tot["acc"] + tot["blocks"]) / max(tot["blocks"], 1),
                    "expected_tokens_per_block": expected_tokens(alpha, gamma),
                    "blocks_sent": tot["sent"],
                    "blocks_verified": tot["blocks"],
                    "blocks_stale": tot["stale"],
                    "equal_to_target": equal,
                    "failures": tot.get("failures", 0),
                    # the model replays the edge loop without leads
                    "model_tokens_per_s": (
                        simulate(alpha, gamma, depth, rtt, t_d, t_v) if depth and not lead else None
                    ),
                    "draft_ms": t_d,
                    "verify_ms": [v0, v4],
                    "load": os.getloadavg()[0],
                }
                rows.append(row)
            for r in rows[-2 - len(modes) :]:
                print(fmt(r), flush=True)
        await trio.sleep(0.2)
    return rows


def simulate(alpha, gamma, depth, rtt, t_d, t_v, n_tokens=20000, seed=0) -> float:
    """tok/s that ``edge.speculative_generate`` can reach: its algorithm (token-granular
    drafting, ``depth`` blocks in flight, the bonus guessed by the draft) replayed with each draft
    token accepted with probability ``alpha`` and the guess right with probability ``alpha``;
    ``t_d`` ms per draft token, ``t_v(k)`` ms to verify k drafts, FIFO verifier, RTT in ms."""
    rng = random.Random(seed)
    te = v_free = 0.0
    committed = 0
    inflight = deque()
    part = None
    while committed < n_tokens:
        if inflight and inflight[0]["rt"] <= te:
            b = inflight.popleft()
            if b["valid"]:
                committed += b["a"] + 1
                if not (b["a"] == gamma and b["guess_ok"]):
                    inflight.clear()
                    part = None
            continue
        if part is None and len(inflight) >= depth:
            te = inflight[0]["rt"]
            continue
        if part is None:
            if inflight:
                te += t_d
                last = inflight[-1]
                part = {"valid": last["valid"] and last["a"] == gamma and last["guess_ok"], "n": 0}
            else:
                part = {"valid": True, "n": 0}
            continue
        te += t_d
        part["n"] += 1
        if part["n"] == gamma:
            arrive = te + rtt / 2
            if part["valid"]:
                a = 0
                while a < gamma and rng.random() < alpha:
                    a += 1
                v_free = max(arrive, v_free) + t_v(gamma)
                rt = v_free + rtt / 2
            else:
                a, rt = 0, max(arrive, v_free) + rtt / 2
            inflight.append(
                {"valid": part["valid"], "a": a, "guess_ok": rng.random() < alpha, "rt": rt}
            )
            part = None
    return 1000 * committed / te


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[A] = (1 - a^(g+1)) / (1 - a): expected committed tokens per block of g drafts."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def fmt(r: dict) -> str:
    line = (
        f"  RTT {r['rtt_ms']:>4} ms {r['mode']:>14}: {r['tokens_per_s']:6.2f} tok/s, "
        f"inter-token {r['inter_token_ms']:5.0f} ms (after the first "
        f"{r['inter_token_after_first_ms']:4.0f})"
    )
    if "equal_to_target" in r:
        line += f"{'' if r['equal_to_target'] else ' OUTPUT DIFFERS'} load {r['load']:.1f}"
    if r.get("depth"):
        line += (
            f", d{r['depth']} g{r['gamma']} lead {r['lead']} alpha {r['alpha']:.2f}, "
            f"tokens/block {r['tokens_per_block']:.2f} "
            f"(E[A] {r['expected_tokens_per_block']:.2f}), blocks "
            f"{r['blocks_verified']}/{r['blocks_sent']} stale {r['blocks_stale']}, "
            f"{r['lead_tokens']} tokens by lead"
        )
        if r.get("lead_only_switches"):
            line += f" ({r['lead_only_switches']} switches to lead only)"
    if r.get("model_tokens_per_s"):
        line += f"; model {r['model_tokens_per_s']:.1f} tok/s"
    return line


def parse_modes(text: str) -> list[tuple[str, int, int, int]]:
    out = []
    for item in text.split(","):
        name, depth, gamma, *lead = item.split(":")
        n = int(lead[0]) if lead else 0
        tag = f"{name}-d{depth}g{gamma}" + (f"L{n}" if n else "")
        out.append((tag, int(depth), int(gamma), n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rtts", default="0,50,100,200")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument(
        "--lookup",
        type=int,
        help="prompt-lookup guesses a verifier lead step checks (0: none; default: the "
        "verifier's own, speculation.verify.LOOKUP)",
    )
    ap.add_argument(
        "--prompt-set",
        choices=sorted(PROMPT_SETS),
        default="judge",
        help="judge: the prompts the figures are reported on; tune: others, to choose an edge "
        "constant on (never on the judging set)",
    )
    ap.add_argument("--modes", default="sync:1:4,async:3:2,async:3:2:8,async:3:4:8")
    ap.add_argument("--edge-core", type=int, default=0)
    ap.add_argument("--verifier-core", type=int, default=1)
    ap.add_argument(
        "--delay-in",
        choices=["wan", "transport"],
        default="wan",
        help="wan: testnet/netns/wan.py delays every libp2p TCP write in both processes; transport: "
        "the edge delays blocks and results above an undelayed libp2p stream",
    )
    ap.add_argument(
        "--warm",
        action="store_true",
        help="start each session on a stream opened beforehand (untimed), as EdgeClient does "
        "for every request after its first: no stream negotiation in the first token",
    )
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve, args.prompts, args.new_tokens, PROMPT_SETS[args.prompt_set], args.lookup)
        return
    os.sched_setaffinity(0, {args.edge_core})
    _one_thread()
    if args.lookup is None:
        from p2pnode.speculation.verify import LOOKUP

        args.lookup = LOOKUP
    rtts = [int(x) for x in args.rtts.split(",")]
    modes = parse_modes(args.modes)
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_spec(Path(tmp), rtts)
        cmd = ["taskset", "-c", str(args.verifier_core), sys.executable, __file__]
        cmd += ["--serve", str(spec), "--prompts", str(args.prompts)]
        cmd += ["--prompt-set", args.prompt_set, "--lookup", str(args.lookup)]
        cmd += ["--new-tokens", str(args.new_tokens)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            if not line:
                raise SystemExit("the verifier process exited before serving: see its stderr")
            info = json.loads(line)
            print(
                f"load at start {os.getloadavg()}; cores edge {args.edge_core}, verifier "
                f"{args.verifier_core}; {args.prompts} prompts x {args.new_tokens} tokens"
            )
            rows = trio.run(
                edge_runs, spec, info, rtts, modes, args.new_tokens, args.delay_in, args.warm
            )
        finally:
            if child.stdin is not None:
                child.stdin.close()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
    tag = args.delay_in + ("_warm" if args.warm else "")
    tag += "_tune" if args.prompt_set == "tune" else ""
    out = Path(__file__).parent / "results" / f"speculation_processes_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "delay_in": args.delay_in,
        "warm": args.warm,
        "prompt_set": args.prompt_set,
        "lookup": args.lookup,
        "rows": rows,
        "load_end": os.getloadavg(),
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    print(f"wrote {plot(rows, out.with_suffix('.png'))}")


def plot(rows: list[dict], path: Path) -> Path:
    """tok/s against RTT, one line per mode (the figure the README's table comes from)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = [(r["rtt_ms"], r["tokens_per_s"]) for r in rows if r["mode"] == mode]
        ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
    ax.set_xlabel("injected RTT (ms)")
    ax.set_ylabel("tokens/s (incl. first token)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("edge speculation vs target-only, separate pinned processes")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
