"""A made-up model's prompts, block hashes, load figures and digest builders, for the tests of
digests, peer views and the router (no engine, no network).

Load figures are SmolLM2-135M's CPU rates (measured on 2 cores): ~2.4 ms a token of prefill,
~60 ms a token of decode, so the router's arithmetic meets realistic numbers.
"""

from __future__ import annotations

import random

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo

MODEL = "smollm2-test-model"
PREFILL = 0.0024
DECODE = 0.060
KEY_A = NodeKey.from_seed(bytes(range(32)))
KEY_B = NodeKey.from_seed(bytes(range(1, 33)))


def rand_hashes(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def prompt(n_tokens: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49152) for _ in range(n_tokens)]


def hashes_of(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, model_salt(MODEL))


def load(**kw: object) -> LoadInfo:
    """``LoadInfo`` of an idle node at the rates above, with ``kw`` changed."""
    base = dict(
        queue_depth=0,
        est_wait_s=0.0,
        push_back=False,
        prefill_s_per_token=PREFILL,
        decode_s_per_token=DECODE,
    )
    base.update(kw)
    return LoadInfo(**base)  # type: ignore[arg-type]


def builder_for(key: NodeKey, **kw: object) -> DigestBuilder:
    return DigestBuilder(key.peer_id, MODEL, load_fn=load, **kw)  # type: ignore[arg-type]
