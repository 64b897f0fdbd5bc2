"""MMLU 5-shot through the engine: per-subject prefix reuse, time per question, accuracy.

Run: ``python bench/mmlu_prefix.py [--subjects a,b,c] [--per-subject 6] [--threads 2]``
(prints a table, writes bench/results/mmlu_prefix.json).

Two engines share the one loaded model: ``warm`` keeps its radix cache, ``cold`` clears it
before every question. Questions alternate between them so machine-load drift hits both alike.
Accuracy = the greedy first generated token is the answer letter (no restriction to A-D).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import trio

from p2pnode.datasets.mmlu import fewshot_prefix, questions
from p2pnode.inference.engine import open_engine
from p2pnode.inference.models import load_model
from p2pnode.inference.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results" / "mmlu_prefix.json"
DEFAULT_SUBJECTS = "astronomy,high_school_geography,marketing"


async def main(subject_list: list[str], per_subject: int, threads: int) -> None:
    loaded = load_model(None)
    one = SamplingParams(max_tokens=1)
    rows: dict[str, dict[str, list]] = {}
    async with (
        open_engine(loaded, torch_threads=threads, calibrate_cost=False) as warm,
        open_engine(loaded, torch_threads=threads, calibrate_cost=False) as cold,
    ):
        for q in questions(subject_list, per_subject):
            ids = warm.encode(q.prompt)
            r = rows.setdefault(
                q.subject,
                {"warm_s": [], "cold_s": [], "cached": [], "prompt": [], "correct": []},
            )
            cold.tree.clear()
            c = await cold.generate(ids, one)
            w = await warm.generate(ids, one)
            assert w.tokens == c.tokens, "cache reuse changed a greedy answer"
            r["cold_s"].append(c.total_s)
            r["warm_s"].append(w.total_s)
            r["cached"].append(w.cached_tokens)
            r["prompt"].append(w.prompt_tokens)
            r["correct"].append(warm.decode(w.tokens).strip() == q.answer)
        prefix_tokens = {s: len(warm.encode(fewshot_prefix(s))) for s in subject_list}
    out: dict = {"threads": threads, "per_subject": per_subject, "subjects": {}}
    print(f"{'subject':<24}{'prefix':>7}{'hit%':>7}{'cold s/q':>10}{'warm s/q':>10}{'acc':>6}")
    tot_cached = tot_prompt = 0
    for s, r in rows.items():
        hit = sum(r["cached"]) / sum(r["prompt"])
        # The first warm question of a subject is a miss (it brings the prefix in); later ones hit.
        warm_later = statistics.mean(r["warm_s"][1:]) if len(r["warm_s"]) > 1 else None
        res = {
            "prefix_tokens": prefix_tokens[s],
            "mean_prompt_tokens": statistics.mean(r["prompt"]),
            "hit_rate_tokens": hit,
            "cold_s_per_q": statistics.mean(r["cold_s"]),
            "warm_s_per_q": statistics.mean(r["warm_s"]),
            "warm_s_per_q_after_first": warm_later,
            "accuracy": sum(r["correct"]) / len(r["correct"]),
        }
        out["subjects"][s] = res
        tot_cached += sum(r["cached"])
        tot_prompt += sum(r["prompt"])
        print(
            f"{s:<24}{res['prefix_tokens']:>7}{100 * hit:>6.1f}%{res['cold_s_per_q']:>10.3f}"
            f"{res['warm_s_per_q']:>10.3f}{res['accuracy']:>6.2f}"
        )
    all_cold = [t for r in rows.values() for t in r["cold_s"]]
    all_warm = [t for r in rows.values() for t in r["warm_s"]]
    out["overall"] = {
        "questions": len(all_cold),
        "hit_rate_tokens": tot_cached / tot_prompt,
        "cold_s_per_q": statistics.mean(all_cold),
        "warm_s_per_q": statistics.mean(all_warm),
        "speedup": statistics.mean(all_cold) / statistics.mean(all_warm),
        "accuracy": statistics.mean(c for r in rows.values() for c in r["correct"]),
        "load_avg": os.getloadavg(),
    }
    o = out["overall"]
    print(
        f"overall: {o['questions']} questions, hit {100 * o['hit_rate_tokens']:.1f}% of prompt "
        f"tokens, {o['cold_s_per_q']:.3f} -> {o['warm_s_per_q']:.3f} s/question "
        f"(x{o['speedup']:.2f}), accuracy {o['accuracy']:.2f}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--subjects", default=DEFAULT_SUBJECTS)
    parser.add_argument("--per-subject", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    a = parser.parse_args()
    trio.run(main, a.subjects.split(","), a.per_subject, a.threads)
