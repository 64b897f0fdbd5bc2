"""The verifier protocol (speculation/protocol.py): the sparse draft distribution on the wire.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

import pytest
import torch

from p2pnode.speculation import (
    BadBlock,
    truncate_probs,
)
from p2pnode.speculation.protocol import VerifyBlock, decode_q, encode_q


def test_sparse_q_round_trip_is_exact() -> None:
    q = truncate_probs(torch.softmax(torch.randn(3, 1000), -1), 64)
    width, ids, vals = encode_q(q)
    msg = VerifyBlock(0, 5, 1, [int(t) for t in q.argmax(-1)], width, ids, vals)
    assert torch.equal(decode_q(msg, 1000), q)
    with pytest.raises(BadBlock):
        decode_q(VerifyBlock(0, 5, 1, [1, 2, 3], width, ids[:-4], vals), 1000)
    with pytest.raises(BadBlock):
        decode_q(VerifyBlock(0, 5, 1, [1, 2, 3], width, ids, vals), 10)  # ids beyond vocab
