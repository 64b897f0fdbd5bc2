"""Audit benchmark: false alarms, throughput cost and detection latency of audited forwards.

Run: ``python bench/audit_bench.py [--answers 100] [--requests 24] [--rounds 3]
[--parts alarms,cost,third,detect]``.
Prints the figures and writes ``bench/results/audit.json``. A few minutes on 2 cores.

- ``alarms`` (real model, SmolLM2-135M fp32, engine batching 4): ``--answers`` honest answers
  sampled at temperature 0.8 / top-p 0.95 and greedy answers, each audited with the checks of
  ``overlay/trust/audit.py`` against the same model: the false-alarm rate (honest answers flagged).
  The same prompts answered by a copy of the model with noisy weights (the stand-in for another
  fine-tune) and by random tokens give the per-answer detection rate of each.
- ``cost`` (real model): one engine serves ``--requests`` requests (48-token chat prompts, 16
  tokens out, 2 at a time) alone, then again while the node audits one forwarded answer of the
  same shape per request it serves, with probability 1 (an open network, every peer new: on
  probation) and ``AuditConfig.trusted_rate`` (a closed network's members, or trusted peers of
  an open one). Throughput = generated tokens / wall time until the workload AND its
  audits are done. ``cost`` = 1 - tokens per CPU-second of this process / the same alone
  (CPU time, because on a machine shared with other jobs wall time swings 10x between runs;
  ``cost_wall`` is the wall-clock version), the three phases interleaved ``--rounds`` times
  (medians; per-round costs kept).
- ``third`` (real model): what an audit costs a third peer that holds the prompt's 500-token
  prefix (``Engine.score``: one prefill of the answer on the cached prefix) against the
  origin's own pass over prompt + answer (``ModelScorer``), medians of ``--rounds`` x 5
  interleaved repetitions, the same logits checked; ``ratio`` = third peer / own.
- ``detect`` (emulated compute, real libp2p on loopback): per liar kind, an origin, an honest
  peer and a faster liar; the origin sends requests until the liar is demoted (at most 12).
  Then a second liar of the same kind appears under a new key (a liar restarted with a new
  identity) and is caught again. Figures: answers the liar served until demotion, seconds from
  the first request routed to it to its demotion, and ``wrong_answers``: answers the client
  kept that differ from the honest answer (the emulated model's output is a function of the
  input, so it is recomputed here).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import trio

from p2pnode.inference.sampling import SamplingParams
from p2pnode.testing.waiting import wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "audit.json"
QUESTIONS = [
    "Name a fruit.",
    "What colour is the sky?",
    "Say hello in French.",
    "Count to three.",
    "Name a large animal.",
    "What is two plus two?",
    "Name a planet.",
    "What do bees make?",
]


def chat(tokenizer: Any, i: int) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def noisy_copy(loaded: Any, scale: float = 0.2) -> Any:
    from p2pnode.inference.models import LoadedModel

    model = copy.deepcopy(loaded.model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * float(p.std()))
    return LoadedModel(loaded.name, model, loaded.tokenizer, loaded.model_id, loaded.path)


async def _answers(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
    out: list[Any] = [None] * len(prompts)
    for start in range(0, len(prompts), 4):

        async def one(j: int) -> None:
            out[j] = (await engine.generate(prompts[j], params)).tokens

        async with trio.open_nursery() as nursery:
            for j in range(start, min(start + 4, len(prompts))):
                nursery.start_soon(one, j)
    return out


async def part_alarms(loaded: Any, n: int) -> dict[str, Any]:
    from p2pnode.inference.engine import open_engine
    from p2pnode.inference.scoring import ModelScorer
    from p2pnode.overlay.trust.audit import AuditConfig, check_answer

    cfg = AuditConfig()
    scorer = ModelScorer(loaded.model)
    prompts = [chat(loaded.tokenizer, i) for i in range(n)]
    other = noisy_copy(loaded)
    out: dict[str, Any] = {"answers": n}
    for name, params in (
        ("sampled", SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95)),
        ("greedy", SamplingParams(max_tokens=16)),
    ):
        async with open_engine(loaded, calibrate_cost=False, torch_threads=2) as engine:
            honest = await _answers(engine, prompts, params)
        async with open_engine(other, calibrate_cost=False, torch_threads=2) as engine:
            liar = await _answers(engine, prompts, params)
        rng = random.Random(0)
        rand = [[rng.randrange(loaded.vocab_size) for _ in a] for a in honest]
        flagged: dict[str, int] = {}
        stats: list[float] = []
        for kind, answers in (("honest", honest), ("other-model", liar), ("random-text", rand)):
            bad = 0
            for p, a in zip(prompts, answers, strict=True):
                v = check_answer(scorer.logits(p, a), a, params, cfg)
                bad += not v.passed
                if kind == "honest" and v.statistic != float("inf"):
                    stats.append(v.statistic)
            flagged[kind] = bad
        out[name] = {
            "false_alarm_rate": flagged["honest"] / n,
            "other_model_detected_per_answer": flagged["other-model"] / n,
            "random_text_detected_per_answer": flagged["random-text"] / n,
            "honest_statistic_max": round(max(stats), 3) if stats else None,
            "honest_statistic_mean": round(statistics.fmean(stats), 3) if stats else None,
        }
        print(f"alarms {name}: {out[name]}", flush=True)
    return out


async def _serve_with_audits(
    engine: Any, loaded: Any, prompts: list[list[int]], answers: list[Any], rate: float | None
) -> dict[str, Any]:
    """Serve ``prompts`` two at a time; per request audit a forwarded answer w.p. ``rate``."""
    from p2pnode.inference.scoring import ModelScorer
    from p2pnode.overlay.trust.audit import AuditConfig, Auditor
    from p2pnode.overlay.trust.book import TrustBook

    params = SamplingParams(max_tokens=16)
    cfg = AuditConfig(
        probation_answers=10**9 if rate == 1.0 else 0,
        trusted_rate=rate or 0.0,
        budget_share=1.0,
        defer_max_s=0.5,
    )
    auditor = Auditor(
        ModelScorer(loaded.model, engine.cost), TrustBook(), cfg, rng=random.Random(1)
    )
    done = {"tokens": 0, "queued": 0}

    async def serve(i: int) -> None:
        res = await engine.generate(prompts[i], params)
        done["tokens"] += len(res.tokens)
        if rate is None:
            return
        p, a = prompts[i % len(answers)], answers[i % len(answers)]
        plan = auditor.plan("peer", params)
        if plan.hold:
            await auditor.check("peer", p, a, params)
        elif plan.audit:
            auditor.later("peer", p, a, params)
            done["queued"] += 1

    t0, cpu0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(auditor.run)
        for start in range(0, len(prompts), 2):
            async with trio.open_nursery() as pair:
                for i in range(start, min(start + 2, len(prompts))):
                    pair.start_soon(serve, i)
        # The clock stops once the background audits are done too (bounded).
        with trio.move_on_after(600):
            while sum(auditor.counts.values()) < done["queued"]:  # noqa: ASYNC110
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "tokens_per_s": round(done["tokens"] / wall, 3),
        "tokens_per_cpu_s": round(done["tokens"] / cpu, 3),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "audits": dict(auditor.counts),
        "audit_s": round(auditor.seconds, 2),
    }


async def part_cost(loaded: Any, requests: int, rounds: int) -> dict[str, Any]:
    """Phases interleaved over ``rounds`` (the machine's load drifts); medians reported."""
    from p2pnode.inference.engine import open_engine
    from p2pnode.overlay.trust.audit import AuditConfig

    prompts = [chat(loaded.tokenizer, i) for i in range(requests)]
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "probation": [], "trusted": []}
    async with open_engine(loaded, calibrate_cost=True, torch_threads=2, max_batch=2) as engine:
        answers = await _answers(engine, prompts[:4], SamplingParams(max_tokens=16))  # warm-up
        for r in range(rounds):
            trusted = AuditConfig().trusted_rate
            for label, rate in (("alone", None), ("probation", 1.0), ("trusted", trusted)):
                res = await _serve_with_audits(engine, loaded, prompts, answers, rate)
                runs[label].append(res)
                print(f"cost round {r} {label}: {res}", flush=True)
    out: dict[str, Any] = {"requests": requests, "rounds": rounds, "runs": runs}
    for label, xs in runs.items():
        out[label] = {
            key: statistics.median(x[key] for x in xs)
            for key in ("tokens_per_s", "tokens_per_cpu_s")
        }
    for label in ("probation", "trusted"):
        for key in ("tokens_per_s", "tokens_per_cpu_s"):
            name = "cost" if key == "tokens_per_cpu_s" else "cost_wall"
            out[label][name] = round(1 - out[label][key] / out["alone"][key], 4)
            out[label][f"{name}_per_round"] = [
                round(1 - p[key] / a[key], 4)
                for p, a in zip(runs[label], runs["alone"], strict=True)
            ]
    print(f"cost: probation {out['probation']}, trusted {out['trusted']}", flush=True)
    return out


async def part_third(loaded: Any, rounds: int) -> dict[str, Any]:
    from p2pnode.inference.engine import open_engine
    from p2pnode.inference.scoring import ModelScorer

    prompt = [(7 + 31 * i) % 40000 + 100 for i in range(500)]
    own_s, third_s = [], []
    async with open_engine(loaded, calibrate_cost=False, torch_threads=2) as engine:
        answer = (await engine.generate(prompt, SamplingParams(max_tokens=16))).tokens
        scorer = ModelScorer(loaded.model, engine.cost)
        for _ in range(rounds * 5):  # bounded, interleaved: the machine's load drifts
            t0 = time.perf_counter()
            own = await trio.to_thread.run_sync(scorer.logits, prompt, answer)
            own_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rows = await engine.score(prompt, answer)
            third_s.append(time.perf_counter() - t0)
            assert torch.allclose(own, rows, atol=1e-3)
    out = {
        "prompt_tokens": len(prompt),
        "answer_tokens": len(answer),
        "own_s": round(statistics.median(own_s), 4),
        "third_peer_s": round(statistics.median(third_s), 4),
    }
    out["ratio"] = round(out["third_peer_s"] / out["own_s"], 4)
    print(f"third-peer audit on a cached prefix: {out}", flush=True)
    return out


# --------------------------------------------------------------------------- detection


PREFILL_S, DECODE_S = 1 / 430, 1 / 16


def emulated_reference(prompt: list[int], n: int, vocab: int, eos: int) -> list[int]:
    from p2pnode.inference._backend import emulated_logits

    seq = list(prompt)
    for _ in range(n):
        seq.append(int(emulated_logits(len(seq), seq[-1], vocab, eos).argmax()))
    return seq[len(prompt) :]


async def detect_kind(kind: str, max_requests: int) -> dict[str, Any]:
    from p2pnode.inference.models import ShapeOnlyModel
    from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
    from p2pnode.overlay.serve.forward import ForwardConfig
    from p2pnode.testing.localcluster import emulated_routed_services
    from p2pnode.testnet.adversary.trial import make_adversary

    model = ShapeOnlyModel("audit-bench-model")
    out: dict[str, Any] = {"kind": kind, "liars": []}
    from p2pnode.testing.localcluster import loopback_overlays

    async with loopback_overlays(4) as nodes:
        await wait_until(lambda: all(len(x.peers.up_peers()) == 3 for x in nodes), 30, "mesh")
        async with emulated_routed_services(
            nodes,
            model=model,
            prefill_s=PREFILL_S,
            decode_s=DECODE_S,
            rtt_s=0.002,
            antientropy_config=AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3),
            forward_config=ForwardConfig(accept_slack_s=20, first_token_slack_s=30, idle_min_s=20),
        ) as services:
            origin, honest, liar1, liar2 = services
            origin.engine.cost.decode_s_per_token = 1.0  # the origin forwards
            for liar in (liar1, liar2):  # the liars advertise the fastest engines: chosen first
                liar.engine.cost.decode_s_per_token = DECODE_S / 4
            liar2.server.admit = lambda: False  # not there yet: refuses ("busy"), no evidence
            for liar in (liar1, liar2):
                make_adversary(liar, kind, rate=1 / 20)
            ids = [s.node.peer_id for s in services]
            await wait_until(
                lambda: all(origin.views.get(p, origin.model_id) for p in ids[1:]),
                30,
                "the origin's views of every peer",
            )
            served = 0
            for n_liar, liar in enumerate((liar1, liar2)):
                if n_liar == 1:  # the liar comes back under a new key
                    liar.server.admit = liar._admit
                pid = liar.node.peer_id
                t_first = None
                t_demoted = time.perf_counter()
                answers = wrong = 0
                for _ in range(max_requests):
                    prompt = [random.randrange(3, 49152) for _ in range(48)]
                    t_request = time.perf_counter()
                    res = await origin.generate(prompt, {"max_tokens": 16})
                    served += 1
                    ref = emulated_reference(prompt, len(res.tokens), model.vocab_size, 2)
                    wrong += res.tokens != ref
                    tried = [a.target for a in res.attempts]
                    if pid in tried:
                        answers += 1
                        t_first = t_first or t_request
                    if not origin.trust.usable(pid):
                        upto = tried.index(pid) + 1 if pid in tried else 0
                        t_demoted = t_request + sum(a.seconds for a in res.attempts[:upto])
                        break
                out["liars"].append(
                    {
                        "identity": n_liar + 1,
                        "answers_until_demoted": answers,
                        "seconds_from_first_request": (
                            round(t_demoted - t_first, 2) if t_first else None
                        ),
                        "demoted": not origin.trust.usable(pid),
                        "wrong_answers_kept": wrong,
                    }
                )
            out["requests"] = served
            out["liars_demoted"] = sum(x["demoted"] for x in out["liars"])
            out["wrong_answers"] = sum(x["wrong_answers_kept"] for x in out["liars"])
            out["audits"] = dict(origin.auditor.counts) if origin.auditor else None
    print(f"detect {kind}: {out}", flush=True)
    return out


async def main(args: argparse.Namespace) -> None:
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {"args": vars(args)}
    loaded = None
    if parts & {"alarms", "cost", "third"}:
        from p2pnode.inference.models import load_model

        loaded = load_model(None)
    if "alarms" in parts:
        results["alarms"] = await part_alarms(loaded, args.answers)
    if "cost" in parts:
        results["cost"] = await part_cost(loaded, args.requests, args.rounds)
    if "third" in parts:
        results["third"] = await part_third(loaded, args.rounds)
    if "detect" in parts:
        results["detect"] = [
            await detect_kind(k, 12) for k in ("wrong-output", "random-text", "other-model")
        ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=100)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="alarms,cost,third,detect")
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "WARNING"))
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    random.seed(0)
    trio.run(main, parser.parse_args())
