"""``gqa_sdpa`` against transformers' own SDPA call (K/V heads repeated, boolean mask)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.masking_utils import sdpa_mask

from p2pnode.inference._cpu import attention as _attention


class _Layer(torch.nn.Module):
    is_causal = True


def _reference(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def _inputs(q_len: int, kv_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 9, q_len, 64, generator=g)
    k, v = (torch.randn(1, 3, kv_len, 64, generator=g) for _ in range(2))
    cached = kv_len - q_len
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(cached)[None, None]
    return q, k, v, mask


def test_masked_grouped_attention_matches_repeated_heads() -> None:
    q, k, v, mask = _inputs(20, 120, seed=0)
    out, _ = _attention.gqa_sdpa(_Layer(), q, k, v, mask)
    torch.testing.assert_close(out, _reference(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_the_forward_mask_is_additive_and_the_same_mask() -> None:
    # Made once a forward by transformers and handed to every layer: 0 where the boolean mask
    # lets a query see a key, -inf where not; a decode step's (one query) stays boolean, and
    # "no mask" (plain causal) stays None.
    args = dict(batch_size=1, q_length=6, kv_length=16, q_offset=10, device="cpu")
    boolean = sdpa_mask(**args, allow_is_causal_skip=False)
    additive = _attention.additive_sdpa_mask(**args, allow_is_causal_skip=False)
    assert boolean.dtype == torch.bool and additive.dtype == torch.float32
    assert torch.equal(additive == 0, boolean)
    assert torch.isneginf(additive[~boolean]).all()
    one = dict(args, q_length=1, q_offset=15)
    assert _attention.additive_sdpa_mask(**one, allow_is_causal_skip=False).dtype == torch.bool
    assert _attention.additive_sdpa_mask(batch_size=1, q_length=6, kv_length=6) is None
    q, k, v, _ = _inputs(6, 16, seed=1)
    out, _ = _attention.gqa_sdpa(_Layer(), q, k, v, additive)
    torch.testing.assert_close(out, _reference(q, k, v, boolean), rtol=1e-5, atol=1e-6)
