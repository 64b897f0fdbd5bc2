"""Fixtures of the speculation tests: the real target (the shared default model), its W4A16
draft, and chat prompts tokenized for it."""

from __future__ import annotations

import pytest

from p2pnode.speculation import load_draft

PROMPTS = ["Explain why the sky is blue.", "Write a haiku about autumn.", "Hi"]


@pytest.fixture(scope="session")
def target(loaded):
    """The shared real model, here in its role: the target the drafts are checked against."""
    return loaded


@pytest.fixture(scope="session")
def draft():
    return load_draft()


@pytest.fixture(scope="session")
def prompts(target) -> list[list[int]]:
    tok = target.tokenizer
    out = []
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        out.append(
            list(
                tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)[
                    "input_ids"
                ]
            )
        )
    return out
