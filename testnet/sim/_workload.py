"""The simulated workload: MMLU prompts and the seeded Poisson arrivals that pick them.

``mmlu_prompts`` tokenizes MMLU 5-shot prompts with the model's tokenizer, subject by subject.
``poisson_arrivals(cfg)`` is the one draw of arrivals: an endless stream of ``(gap s, prompt
index, entry node)``, Zipf popularity over subjects, uniform questions and entry nodes, from
``random.Random(cfg.seed + 1)``. The run (``_run.py``) and ``arrival_order`` (the sequence the
hit-rate ceiling is computed over) both read it, so the two cannot drift apart.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from p2pnode.testnet.sim._config import SimConfig


def mmlu_prompts(subjects: int, per_subject: int) -> list[list[int]]:
    """Token ids of the MMLU prompts, subject by subject (``per_subject`` each)."""
    from p2pnode.datasets import mmlu
    from p2pnode.inference.models import default_model_path, load_light_model

    default_model_path()  # on a fresh machine, converts the packaged model once (as trials do)
    tok = load_light_model().tokenizer
    out = []
    for s in mmlu.subjects()[:subjects]:
        for q in mmlu.questions([s], per_subject):
            out.append(tok.encode(q.prompt, add_special_tokens=False))
    return out


def poisson_arrivals(cfg: SimConfig) -> Iterator[tuple[float, int, int]]:
    """``(gap s, prompt index, entry node)`` without end; the caller stops at the duration."""
    rng = random.Random(cfg.seed + 1)
    weights = [1 / (k + 1) ** cfg.zipf_s for k in range(cfg.subjects)]
    per = cfg.per_subject
    while True:
        gap = rng.expovariate(cfg.rate)
        subject = rng.choices(range(cfg.subjects), weights)[0]
        yield gap, subject * per + rng.randrange(per), rng.randrange(cfg.nodes)


def arrival_order(cfg: SimConfig) -> list[int]:
    """The prompt indices a run without a plan serves, in arrival order."""
    t, out = 0.0, []
    for gap, q, _ in poisson_arrivals(cfg):
        t += gap
        if t >= cfg.duration_s:
            return out
        out.append(q)
    raise AssertionError("unreachable: the arrivals never end")
