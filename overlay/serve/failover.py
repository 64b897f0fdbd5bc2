"""Failing over one request: the next target continues the answer, it does not restart it.

``Continuation(prompt, max_tokens)`` holds the tokens delivered so far (``add``); the next
target is given ``context`` (the prompt plus those tokens) and ``remaining`` of the budget, so a
delivered token is never repeated or lost, and a greedy answer equals an uninterrupted run.
``begin(target)`` and ``fail(target, why)`` keep the order of targets, where each began and
why each was left.

Shared by the routed service (``service.py``: the router's attempts in order, local last) and
the speculation edge client (``speculation/client.py``: verifiers found anew after each
failure, until the answer is finished). The loops stay with them: they differ in where the next
target comes from and in what ends them.
"""

from __future__ import annotations

from collections.abc import Sequence


class Continuation:
    def __init__(self, prompt: Sequence[int], max_tokens: int) -> None:
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.delivered: list[int] = []
        self.targets: list[str] = []  # in the order they were tried
        self.starts: list[int] = []  # how many tokens were delivered when each began
        self.failures: dict[str, str] = {}  # target -> why it was left

    def add(self, tokens: Sequence[int]) -> None:
        self.delivered.extend(tokens)

    def begin(self, target: str) -> None:
        self.targets.append(target)
        self.starts.append(len(self.delivered))

    def fail(self, target: str, why: str) -> None:
        self.failures[target] = why

    @property
    def context(self) -> list[int]:
        """What the next target continues from."""
        return self.prompt + self.delivered

    @property
    def remaining(self) -> int:
        """What is left of the token budget."""
        return self.max_tokens - len(self.delivered)
