"""The verifier's prefix cache: sessions that share a prompt prefix share its prefill.

A chat's second turn opens a new verification session on the whole history; without a cache
the verifier prefills all of it again. ``PrefixKV`` keeps the KV of sessions' committed tokens
in a radix tree (``inference/radix.py``, the engine's own, in its layout
``[layers, 2, kv_heads, T, head_dim]``), so a new session starts from the longest cached prefix
and prefills only the rest. The tree's block events are what the verifier advertises in its
digests (the edge picks a verifier by what it has cached).

``take(prompt, keep_last)`` returns a ``DynamicCache`` holding the KV of the longest cached
prefix, at most ``len(prompt) - keep_last`` tokens (those still to run give the logits the
session needs), and its length. ``keep(tokens, cache)`` stores the first ``len(tokens)`` tokens
of a session's cache. Both copy: a session crops and grows its own cache freely.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from p2pnode.inference.blockhash import BlockEvent
from p2pnode.inference.radix import RadixCache


class PrefixKV:
    def __init__(self, model_id: str, max_tokens: int) -> None:
        self.tree = RadixCache(model_id, max_tokens=max_tokens)
        self.enabled = max_tokens > 0

    def add_listener(self, fn: Callable[[BlockEvent], None]) -> None:
        self.tree.add_listener(fn)

    def cached_len(self, tokens: Sequence[int]) -> int:
        return self.tree.prefix_len(tokens) if self.enabled else 0

    def take(self, prompt: Sequence[int], keep_last: int) -> tuple[DynamicCache, int]:
        if not self.enabled:
            return DynamicCache(), 0
        m = self.tree.match(prompt)
        usable = max(0, min(m.length, len(prompt) - keep_last))
        kv = self.tree.gather(m, usable) if usable else None
        if kv is None:
            return DynamicCache(), 0
        layers = [
            (kv[i, 0].unsqueeze(0).clone(), kv[i, 1].unsqueeze(0).clone())
            for i in range(kv.shape[0])
        ]
        return DynamicCache(ddp_cache_data=layers), usable

    def keep(self, tokens: Sequence[int], cache: DynamicCache) -> None:
        n = min(len(tokens), cache.get_seq_length())
        if not self.enabled or n <= 0:
            return

        def kv(begin: int, end: int) -> torch.Tensor:
            return torch.stack(
                [
                    torch.stack([lay.keys[0, :, begin:end], lay.values[0, :, begin:end]])
                    for lay in cache.layers
                ]
            ).clone()

        self.tree.insert(list(tokens[:n]), kv)
