"""The decode fast paths without the model: streaming kernels and KV slabs (small tensors)."""

from __future__ import annotations

import copy
import itertools
import platform
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from p2pnode.inference._cpu import kernels as _kernels
from p2pnode.inference._cpu.kvslab import Slab, SlabPool, _SlabLayer

from testkit.kernels import check_panels

lib = _kernels.library()
needs_lib = pytest.mark.skipif(
    lib is None,
    reason="kernels unavailable (no C compiler, or P2PNODE_KERNELS=0): the torch path is used",
)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_linear_matches_f_linear_and_rows_are_independent(dtype) -> None:
    torch.manual_seed(0)
    # 201 outputs: not a multiple of any block size (two weight rows a pass leave one alone)
    w = torch.randn(201, 96).to(dtype)
    lin = _kernels.StreamLinear(w, lib)
    for rows in (1, 3, 5, 6, 7, 8, 9, 16):
        x = torch.randn(1, rows, 96)
        ref = F.linear(x, w.float())
        y = lin(x)
        assert y.shape == ref.shape
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
        # The same row alone gives the same bits: a verify block agrees with a decode step.
        assert torch.equal(lin(x[:, -1:]), y[:, -1:])
    long = torch.randn(40, 96)  # past MAX_ROWS: torch's matmul in the weights' dtype
    ref = F.linear(long, w.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 inputs there: an 8-bit mantissa
    assert (lin(long) - ref).abs().max() <= tol * ref.abs().max()


def _cpu_has(*flags: str) -> bool:
    line = f" {_kernels._cpu_flags()} "
    return all(f" {f} " in line for f in flags)


# The build for this CPU takes one vector width; volunteers' CPUs take the others. Each narrower
# x86 level is compiled and run here where the CPU can execute it (v3: AVX2 and FMA; v2: SSE4.2,
# the 16-byte vectors NEON has too).
NARROWER = [("x86-64-v3", 8, ("avx2", "fma")), ("x86-64-v2", 4, ("sse4_2",))]


@needs_lib
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 -march levels")
@pytest.mark.parametrize(("march", "lanes", "needs"), NARROWER, ids=[m for m, _, _ in NARROWER])
def test_narrower_builds_give_the_same_numbers_in_their_own_width(march, lanes, needs) -> None:
    if not _cpu_has(*needs):
        pytest.skip(f"this CPU cannot run {march} code")
    narrow = _kernels.build(_kernels._SOURCE.read_bytes(), march=march)
    assert narrow is not None and narrow.vec_lanes() == lanes
    torch.manual_seed(4)
    # 96 inputs: one weight row a pass at 4-6 rows; 1,024: two (the rows of X outgrow L1)
    for dtype, shape in itertools.product((torch.float32, torch.bfloat16), ((201, 96), (34, 1024))):
        w = torch.randn(*shape).to(dtype)
        lin = _kernels.StreamLinear(w, narrow)
        x_all = torch.randn(9, shape[1])
        for rows in (1, 2, 5, 7, 9):
            x = x_all[:rows]
            ref = F.linear(x, w.float())
            with torch.no_grad():
                y = lin(x)
            assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
            assert torch.equal(lin(x[-1:]), y[-1:])  # rows independent in this width too
    # int4 on fp32 activations (gemv_int4), and int8 activations where the level has them.
    q = torch.randint(0, 16, (42, 576), dtype=torch.int32)
    scales = torch.rand(42, 576 // 64) + 0.1
    deq = (q.float() - 8) * scales.repeat_interleave(64, dim=1)
    packed = _kernels.pack_int4(q)
    x = torch.randn(5, 576) * 3
    ref = x.double() @ deq.double().t()
    for fn in (narrow.gemv_int4, narrow.gemv_q4a8):
        y = torch.empty(5, 42)
        fn(packed.data_ptr(), scales.data_ptr(), x.data_ptr(), y.data_ptr(), 5, 42, 576, 64)
        step = x.reshape(5, 9, 64).abs().amax(-1).double() / 127
        bound = step @ deq.abs().double().reshape(42, 9, 64).sum(-1).t() / 2
        err = (y.double() - ref).abs()
        assert (err <= bound + 1e-4 * ref.abs().max()).all(), fn.__name__
        rounded = fn is narrow.gemv_q4a8 and lanes == 8  # AVX2's int8 path, else fp32 inputs
        assert (err.max() > 1e-4 * ref.abs().max()) == rounded, fn.__name__
    assert narrow.q4a8_native() == (1 if lanes == 8 else 0)
    assert narrow.panel_width() == 2 * lanes
    check_panels(narrow)
    _fast_path_in_build(narrow)


def _fast_path_in_build(lib) -> None:
    """The C decoder stack of build ``lib`` (its attention's own vector width) against
    transformers, and a verify block's rows against one-token steps."""
    from p2pnode.inference._cpu import fastpath as _fastpath
    from p2pnode.inference._cpu import gemm as _gemm

    model = _tiny_llama(256)  # 64-wide heads
    assert _fastpath.install(model)
    _fastpath.plan(model).lib = lib
    for mod in model.modules():  # prefill panels in this build's width
        if isinstance(mod, _kernels.StreamLinear):
            form = _gemm.PanelWeight(mod.weight.data, lib, lib.panel_width())
            mod._prefill[:] = [(mod.weight, form)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            _prefill_against_transformers(model, torch.randint(0, 96, (1, 150)), 0)
    finally:
        torch.set_num_threads(threads)
    prompt, block = torch.randint(0, 96, (1, 125)), torch.randint(0, 96, (1, 5))
    with torch.inference_mode():
        ref, got, cache = _torch_and_fast(model, prompt, block)
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
        cache.crop(-5)
        steps = [
            model(input_ids=block[:, i : i + 1], past_key_values=cache).logits[0, 0]
            for i in range(5)
        ]
        assert torch.equal(torch.stack(steps), got[0])


@needs_lib
def test_a_model_with_stream_linears_deep_copies_with_its_ties() -> None:
    # GPTQ and the audit tests copy a loaded (accelerated) model: the kernel handle is shared,
    # the weights copied, and a tied head stays tied to the copy's embedding.
    emb = torch.nn.Embedding(64, 96)
    model = torch.nn.ModuleDict({"emb": emb, "head": _kernels.StreamLinear(emb.weight, lib)})
    twin = copy.deepcopy(model)
    assert twin["head"].weight is twin["emb"].weight
    assert twin["head"].weight is not emb.weight
    x = torch.randn(1, 2, 96)
    assert torch.equal(twin["head"](x), model["head"](x))


@needs_lib
def test_int4_kernel_matches_the_dequantized_matmul() -> None:
    torch.manual_seed(1)
    q = torch.randint(0, 16, (12, 128), dtype=torch.int32)
    scales = torch.rand(12, 2) + 0.1  # group 64
    deq = (q.float() - 8) * scales.repeat_interleave(64, dim=1)
    x = torch.randn(9, 128)
    y = _kernels.int4_matmul(_kernels.pack_int4(q), scales, x, 64)
    assert (y - x @ deq.t()).abs().max() <= 1e-4 * (x @ deq.t()).abs().max()
    # A row's bits do not depend on how many rows came with it (9 rows run as 5 + 4).
    for rows in (slice(0, 1), slice(4, 9), slice(8, 9)):
        assert torch.equal(
            _kernels.int4_matmul(_kernels.pack_int4(q), scales, x[rows], 64), y[rows]
        )
    # A group size other than 64 takes the kernel's general loop.
    scales32 = torch.rand(12, 4) + 0.1
    deq32 = (q.float() - 8) * scales32.repeat_interleave(32, dim=1)
    y32 = _kernels.int4_matmul(_kernels.pack_int4(q), scales32, x, 32)
    assert (y32 - x @ deq32.t()).abs().max() <= 1e-4 * (x @ deq32.t()).abs().max()


@needs_lib
def test_int4_kernel_on_int8_activations_stays_within_the_rounding_bound() -> None:
    # The draft's decode path rounds each group of 64 activations to int8 (scale amax / 127,
    # round to nearest), so an input is off by at most scale / 2 and an output by at most
    # sum_k |W[n, k]| * scale(k) / 2; the integer dot products add nothing. Widths 576 and 1536
    # are the draft's (576 = 4.5 chunks of 128: the half-chunk tail runs too); 42 weight rows,
    # so one input row runs four weight rows a pass and then two alone.
    torch.manual_seed(2)
    for k in (576, 1536):
        q = torch.randint(0, 16, (42, k), dtype=torch.int32)
        scales = torch.rand(42, k // 64) + 0.1
        deq = (q.float() - 8) * scales.repeat_interleave(64, dim=1)
        x = torch.randn(9, k) * 3
        y = _kernels.int4_matmul(_kernels.pack_int4(q), scales, x, 64, int8_act=True)
        ref = x.double() @ deq.double().t()
        if not _kernels.int8_activations():  # neither VNNI nor AVX2: the fp32 kernel, as above
            assert (y - ref).abs().max() <= 1e-4 * ref.abs().max()
            continue
        step = x.reshape(9, k // 64, 64).abs().amax(-1).double() / 127
        per_group = deq.abs().double().reshape(42, k // 64, 64).sum(-1)
        bound = step @ per_group.t() / 2 + 1e-4 * ref.abs().max()  # + fp32 rounding of the sum
        err = (y.double() - ref).abs()
        assert (err <= bound).all()
        assert err.max() > 1e-4 * ref.abs().max()  # it did round: the int8 path ran
        # A row's bits do not depend on how many rows came with it.
        for rows in (slice(0, 1), slice(4, 9), slice(8, 9)):
            got = _kernels.int4_matmul(_kernels.pack_int4(q), scales, x[rows], 64, int8_act=True)
            assert torch.equal(got, y[rows])


@needs_lib
@pytest.mark.skipif(not _kernels.interleaved_int4(), reason="no AVX-512 VNNI here")
def test_interleaved_int4_layout_gives_the_int8_path_to_float_rounding() -> None:
    # The blocks of four rows the draft decodes from: the same integer products, summed in
    # another order, so the outputs agree with the row-major int8 path to float rounding.
    torch.manual_seed(3)
    for k in (576, 1536):
        q = torch.randint(0, 16, (44, k), dtype=torch.int32)
        scales = torch.rand(44, k // 64) + 0.1
        x = torch.randn(9, k) * 3
        packed = _kernels.pack_int4(q)
        ref = _kernels.int4_matmul(packed, scales, x, 64, int8_act=True)
        p4, s4 = _kernels.interleave_q4(packed, scales)
        assert p4.shape == packed.shape and not torch.equal(p4, packed)
        y = _kernels.int4_matmul(p4, s4, x, 64, int8_act=True, interleaved=True)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
        for rows in (slice(0, 1), slice(4, 9), slice(8, 9)):  # rows stay independent
            got = _kernels.int4_matmul(p4, s4, x[rows], 64, int8_act=True, interleaved=True)
            assert torch.equal(got, y[rows])
    with pytest.raises(ValueError, match="N % 4"):
        _kernels.interleave_q4(packed[:42], scales[:42])


def test_kernels_off_switch_falls_back_to_f_linear() -> None:
    w = torch.randn(8, 32)
    if lib is None:
        assert _kernels.accelerate(torch.nn.Sequential(torch.nn.Linear(32, 8, bias=False))) == 0
        return
    lin = _kernels.StreamLinear(w, lib)
    x = torch.randn(2, 32)
    old = _kernels.set_enabled(False)
    try:
        assert torch.equal(lin(x), F.linear(x, w))
    finally:
        _kernels.set_enabled(old)


def test_slab_writes_in_place_grows_crops_and_loads_spans() -> None:
    slab = Slab(num_layers=2, kv_heads=1, head_dim=4, capacity=3)
    layer = slab.cache.layers[0]
    k = torch.arange(2 * 4, dtype=torch.float32).reshape(1, 1, 2, 4)
    keys, values = slab.cache.update(k, -k, 0)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    slab.cache.update(k, -k, 1)
    assert slab.cache.get_seq_length() == 2
    k2 = torch.ones(1, 1, 5, 4)  # past the capacity: the slab doubles and keeps what it held
    keys, _ = slab.cache.update(k2, k2, 0)
    assert slab.capacity >= 7 and torch.equal(keys[:, :, :2], k) and keys.shape[2] == 7
    layer.crop(-5)
    assert layer.get_seq_length() == 2 and torch.equal(layer.keys, k)
    # A radix-layout prefix [layers, 2, heads, T, dim] loads from its spans with one copy each.
    full = torch.randn(2, 2, 1, 6, 4)
    other = Slab(num_layers=2, kv_heads=1, head_dim=4)
    other.load_parts([full[..., :4, :], full[..., 4:, :]])
    assert other.length == 6 and torch.equal(other.export(0, 0, 6), full)
    assert torch.equal(other.cache.layers[1].values[0], full[1, 1])
    # keys / values are views of the slab made when read, at its current length; assigning
    # one would be lost, so it is refused.
    other.set_length(3)
    assert torch.equal(other.cache.layers[0].keys[0], full[0, 0, :, :3])
    with pytest.raises(TypeError, match="lives in its slab"):
        other.cache.layers[0].keys = torch.zeros(1, 1, 3, 4)


def test_deferred_spans_are_copied_on_first_read_and_not_into_a_given_back_tensor() -> None:
    full = torch.randn(2, 2, 1, 6, 4)
    slab = Slab(num_layers=2, kv_heads=1, head_dim=4)
    slab.load_parts([full[..., :4, :], full[..., 4:, :]], defer=True)
    assert slab.length == 6 and not torch.equal(slab._kv[:, :, 0, :, :6], full)  # not yet
    assert torch.equal(slab.cache.layers[1].values[0], full[1, 1])  # a read copies them in
    assert torch.equal(slab.export(0, 0, 6), full)
    pool = SlabPool()
    given = Slab(num_layers=2, kv_heads=1, head_dim=4, capacity=8)
    given._kv.zero_()
    given.load_parts([full], defer=True)
    pool.give(given)  # dropped, not copied: the tensor is the pool's now
    assert pool.slab(2, 1, 4, 1, 8)._kv.abs().sum() == 0


@needs_lib
@pytest.mark.parametrize("new", [5, 40])  # a verify-sized block, a cache hit's prefill
def test_fast_path_copies_a_deferred_prefix_while_it_runs(c_prefill, monkeypatch, new) -> None:
    """A cache hit's prefix left deferred in the slab: the C stack copies it in, layer by
    layer on its own thread, and gives the bits of the same forward on an eagerly loaded slab."""
    from p2pnode.inference._cpu import fastpath as _fastpath

    handed = []
    copies = _fastpath._copies
    monkeypatch.setattr(
        _fastpath, "_copies", lambda kv, pending: handed.append(len(pending)) or copies(kv, pending)
    )
    model = _tiny_llama(256)
    assert _fastpath.install(model)
    prefix = torch.randint(0, 96, (1, 70))
    block = torch.randint(0, 96, (1, new))
    with torch.inference_mode():
        src = Slab(2, 2, 64, capacity=80)
        model(input_ids=prefix, past_key_values=src.cache)
        parts = [src.export(0, 0, 30), src.export(0, 30, 70)]  # two radix spans
        out = []
        for defer in (False, True):
            slab = Slab(2, 2, 64, capacity=80 + new)
            slab.load_parts(parts, defer=defer)
            logits = model(input_ids=block, past_key_values=slab.cache).logits
            assert not slab._pending  # taken by the C call, not read through ``kv`` first
            out.append((logits, slab.export(0, 0, 70 + new)))
    assert handed[-2:] == [0, 2]  # the deferred spans reached the C call, not a torch read
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert torch.equal(out[1][1][..., :70, :], torch.cat(parts, dim=-2))


def test_slab_pool_reuses_a_given_back_tensor_only_where_it_fits() -> None:
    pool = SlabPool(max_bytes=2 * 2 * 2 * 1 * 100 * 4 * 4)  # room for two 100-position slabs
    first = pool.slab(2, 1, 4, 1, 100)
    storage = first.kv.data_ptr()
    pool.give(first)
    assert pool.slab(2, 1, 4, 2, 60).kv.data_ptr() != storage  # another batch size
    assert pool.slab(2, 1, 4, 1, 101).kv.data_ptr() != storage  # too few positions
    assert pool.slab(2, 1, 4, 1, 40).kv.data_ptr() != storage  # would waste over half of it
    again = pool.slab(2, 1, 4, 1, 60)
    assert again.kv.data_ptr() == storage and again.length == 0 and again.capacity == 100
    again.cache.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 0)
    assert again.length == 3
    assert pool.slab(2, 1, 4, 1, 60).kv.data_ptr() != storage  # taken: not handed out twice
    for _ in range(3):
        pool.give(Slab(2, 1, 4, 1, 100))
    assert pool.held_bytes <= pool.max_bytes
    with pytest.raises(ValueError, match="positions"):
        Slab(2, 1, 4, 1, 200, kv=torch.empty(2, 2, 1, 1, 100, 4))


def _tiny_llama(hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    _kernels.accelerate(model)
    return model


def _torch_and_fast(model, prompt: torch.Tensor, block: torch.Tensor):
    """Logits of ``block`` after ``prompt`` by transformers' own forward and by the fast path,
    each on its own cache (the prompt as the model takes it: a long one through transformers),
    and the fast path's cache."""
    from transformers import DynamicCache

    caches = [DynamicCache(), DynamicCache()]
    for c in caches:
        model(input_ids=prompt, past_key_values=c)
    old = _kernels.set_enabled(False)
    try:
        ref = model(input_ids=block, past_key_values=caches[0]).logits
    finally:
        _kernels.set_enabled(old)
    return ref, model(input_ids=block, past_key_values=caches[1]).logits, caches[1]


@needs_lib
@pytest.mark.parametrize(
    "hidden, cached",
    # head width 16 and 64 (the C attention's narrow and wide paths); 125 cached tokens put the
    # block's rows on both sides of a 64-key chunk boundary
    [(64, 40), (256, 125)],
)
def test_fast_path_matches_transformers_and_rows_are_independent(hidden, cached) -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama(hidden)
    assert _fastpath.install(model)
    prompt = torch.randint(0, 96, (1, cached))
    block = torch.randint(0, 96, (1, 5))
    with torch.inference_mode():
        ref, got, cache = _torch_and_fast(model, prompt, block)
        # Float rounding only; a wrong position, slot or head shows up at the logits' scale.
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
        assert cache.get_seq_length() == cached + 5
        assert isinstance(cache.layers[0], _SlabLayer)  # the fast path ran: KV now in a slab
        # The block's rows are the bits of one-token steps, and a crop rolls back in place.
        cache.crop(-5)
        steps = [
            model(input_ids=block[:, i : i + 1], past_key_values=cache).logits[0, 0]
            for i in range(5)
        ]
        assert torch.equal(torch.stack(steps), got[0])


@pytest.fixture
def c_prefill(monkeypatch):
    """The conditions of the C stack's prefill: the panel GEMM (pinned, whatever this machine
    would choose) and one torch thread; restored after."""
    from p2pnode.inference._cpu import gemm as _gemm

    monkeypatch.setenv("P2PNODE_PREFILL_GEMM", "panels")
    _gemm.choice.cache_clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    _gemm.choice.cache_clear()


def _prefill_against_transformers(model, ids: torch.Tensor, cached: int) -> None:
    """``ids`` prefilled by the fast path (``cached`` tokens first, then the rest in one call)
    against one transformers forward of them all: every new row's logits and the KV."""
    from transformers import DynamicCache

    old = _kernels.set_enabled(False)
    try:
        ref_cache = DynamicCache()
        ref = model(input_ids=ids, past_key_values=ref_cache).logits
    finally:
        _kernels.set_enabled(old)
    cache = DynamicCache()
    if cached:
        model(input_ids=ids[:, :cached], past_key_values=cache)
    got = model(input_ids=ids[:, cached:], past_key_values=cache).logits
    assert isinstance(cache.layers[0], _SlabLayer)  # the fast path ran: KV now in a slab
    assert (got - ref[:, cached:]).abs().max() <= 1e-4 * ref.abs().max()
    for lay, want in zip(cache.layers, ref_cache.layers, strict=True):
        for a, b in ((lay.keys, want.keys), (lay.values, want.values)):
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * b.abs().max()


@needs_lib
@pytest.mark.parametrize(
    "hidden, cached, new",
    # 16- and 64-wide heads; new rows past one tile of queries and past 64-key chunks, from an
    # empty cache and after a cached prefix (the rows of a cache hit, a chunked prefill)
    [(64, 0, 83), (256, 0, 150), (256, 70, 41), (256, 130, 17)],
)
def test_prefill_through_the_c_stack_matches_transformers(c_prefill, hidden, cached, new) -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama(hidden)
    assert _fastpath.install(model)
    ids = torch.randint(0, 96, (1, cached + new))
    with torch.inference_mode():
        _prefill_against_transformers(model, ids, cached)
    assert _fastpath._prefill_lins(_fastpath.plan(model)) is not None


def _prefill_took_the_c_stack(ids: torch.Tensor):
    """A fresh tiny model prefilled with ``ids``: whether the C stack ran (its KV in a slab),
    and the model."""
    from transformers import DynamicCache

    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama()
    assert _fastpath.install(model)
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache)
    return isinstance(cache.layers[0], _SlabLayer), model


@needs_lib
def test_prefill_stays_on_transformers_with_threads_or_without_panels(c_prefill, monkeypatch):
    from p2pnode.inference._cpu import fastpath as _fastpath
    from p2pnode.inference._cpu import gemm as _gemm

    ids = torch.randint(0, 96, (1, 40))
    torch.set_num_threads(2)  # oneDNN's GEMM and torch's attention use the threads
    assert not _prefill_took_the_c_stack(ids)[0]
    torch.set_num_threads(1)
    monkeypatch.setenv("P2PNODE_PREFILL_GEMM", "onednn")
    _gemm.choice.cache_clear()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN: the panels are the only packed form")
    took, model = _prefill_took_the_c_stack(ids)
    assert not took and _fastpath._prefill_lins(_fastpath.plan(model)) is None


@needs_lib
def test_fast_path_plan_follows_a_replaced_weight() -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama()
    assert _fastpath.install(model)
    first = _fastpath.plan(model)
    assert _fastpath.plan(model) is first  # the same tensors: the same plan, no rebuild
    lin = model.model.layers[1].mlp.down_proj
    lin.weight = torch.nn.Parameter(torch.randn_like(lin.weight))
    second = _fastpath.plan(model)
    assert second is not first and second.current() and not first.current()
    prompt, step = torch.randint(0, 96, (1, 12)), torch.randint(0, 96, (1, 1))
    with torch.inference_mode():
        ref, got, cache = _torch_and_fast(model, prompt, step)
    assert isinstance(cache.layers[0], _SlabLayer)  # the fast path ran, on the new weight
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_rope_table_rows_equal_the_rotary_module() -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    rot = _tiny_llama().model.rotary_emb
    x = torch.zeros(1, 3, 64)
    for pos in ([[0, 1, 2]], [[5, 511, 700]], [[3, 4, 1500]]):  # the last two grow the table
        positions = torch.tensor(pos)
        cos, sin = _fastpath._cos_sin(rot, x, positions)
        ref_cos, ref_sin = rot(x, positions)
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    assert _fastpath._rope_tables[rot][0].shape[0] >= 1501


@needs_lib
def test_batched_decode_with_left_pads_equals_each_row_alone() -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama()
    assert _fastpath.install(model)
    # two neighbours of one length: their rows share pads (and a KV window) but not their KV
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 19, 19, 12)]
    with torch.inference_mode():
        alone = []
        for p in prompts:
            backend, (s,) = _prefilled(model, [p])
            alone.append([backend.decode([s], [t])[0] for t in (5, 9, 11)])
        backend, states = _prefilled(model, prompts)
        together = [backend.decode(states, [t] * len(prompts)) for t in (5, 9, 11)]
    for i in range(len(prompts)):
        for step in range(3):
            assert torch.equal(together[step][i], alone[i][step])


def _prefilled(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[Any, list[Any]]:
    """A backend on ``model`` and one sequence state per prompt, each prompt prefilled."""
    from p2pnode.inference._backend import HFBackend

    backend = HFBackend(model)
    states = [backend.new_state(None, 0) for _ in prompts]
    for s, p in zip(states, prompts, strict=True):
        backend.extend(s, p)
    return backend, states


@needs_lib
def test_a_decode_batch_past_16_rows_takes_the_panel_gemm_to_float_rounding(
    c_prefill, monkeypatch
) -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama(256)
    assert _fastpath.install(model)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in range(3, 21)]  # 18
    with torch.inference_mode():
        alone = []
        for p in prompts:
            backend, (s,) = _prefilled(model, [p])
            alone.append(backend.decode([s], [5]))
        backend, states = _prefilled(model, prompts)
        asked = []
        lins = _fastpath._prefill_lins
        monkeypatch.setattr(
            _fastpath, "_prefill_lins", lambda p: asked.append(lins(p)) or asked[-1]
        )
        together = backend.decode(states, [5] * len(prompts))
    assert asked and asked[-1] is not None  # the 18 rows took the panels
    for i, a in enumerate(alone):
        assert (together[i] - a[0]).abs().max() <= 1e-4 * a.abs().max()


@needs_lib
def test_build_compiles_another_version_beside_the_current_one(caplog) -> None:
    # bench/kernel_ab.py loads a revision's source beside the tree's: the same source gives
    # a working library again, a broken one None and a warning (never an exception).
    again = _kernels.build(_kernels._SOURCE.read_bytes())
    assert again is not None and again.q4a8_native() in (0, 1, 2)
    with caplog.at_level("WARNING", logger=_kernels.__name__):
        assert _kernels.build(b"this is not C\n") is None
    assert "building kernels.c failed" in caplog.text


def _alone_and_together(model, prompts: list[list[int]], blocks: list[list[int]], defer: bool):
    """Each block's logits after its prompt, each sequence a forward of its own, and all of
    them in one ``extend_many`` call (the prompts' KV deferred spans there when ``defer``),
    with each sequence's KV after the block both ways."""
    from transformers import DynamicCache

    from p2pnode.inference._cpu import fastpath as _fastpath

    alone, slabs = [], []
    for p, b in zip(prompts, blocks, strict=True):
        cache = DynamicCache()
        if p:
            model(input_ids=torch.tensor([p]), past_key_values=cache)
        logits = model(input_ids=torch.tensor([b]), past_key_values=cache).logits[0]
        slab = _fastpath.slab_of(cache, model)
        alone.append((logits, slab.export(0, 0, len(p) + len(b))))
        slab.crop(len(b))
        if defer:  # a cache hit's prefix, handed over as spans: copied in before the call
            fresh = Slab(2, 2, slab.kv.shape[-1], capacity=len(p) + len(b))
            fresh.load_parts([slab.export(0, 0, len(p))], defer=True)
            slab = fresh
        slabs.append(slab)
    together = _fastpath.extend_many(model, slabs, blocks)
    kv = [s.export(0, 0, s.length) for s in slabs]
    assert [s.length for s in slabs] == [
        len(p) + len(b) for p, b in zip(prompts, blocks, strict=True)
    ]
    return alone, list(zip(together, kv, strict=True))


@needs_lib
@pytest.mark.parametrize("defer", [False, True])
def test_many_sequences_in_one_call_give_each_sequences_own_bits(defer) -> None:
    """Up to 16 rows in all (the decode kernels): each sequence's rows are the bits of its own
    forward, whatever its neighbours' lengths, slabs and row counts (an empty cache too)."""
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama(256)
    assert _fastpath.install(model)
    g = torch.Generator().manual_seed(5)
    lengths, widths = [40, 0, 125, 7], [5, 1, 6, 3]  # 15 rows; 125: past a 64-key chunk
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    blocks = [torch.randint(0, 96, (w,), generator=g).tolist() for w in widths]
    with torch.inference_mode():
        alone, together = _alone_and_together(model, prompts, blocks, defer)
    for (a_logits, a_kv), (t_logits, t_kv) in zip(alone, together, strict=True):
        assert torch.equal(a_logits, t_logits) and torch.equal(a_kv, t_kv)


@needs_lib
@pytest.mark.parametrize("prefill_gemm", ["panels", "onednn"])
def test_many_sequences_past_16_rows_take_the_panel_gemm_to_float_rounding(
    prefill_gemm, c_prefill, monkeypatch
) -> None:
    """Past 16 rows every linear is the panel GEMM over all of them, also where prefill chose
    oneDNN (the pass packs panels of its own): each sequence's logits and KV are float
    rounding away from its own forward, never another's."""
    from p2pnode.inference._cpu import fastpath as _fastpath
    from p2pnode.inference._cpu import gemm as _gemm

    monkeypatch.setenv("P2PNODE_PREFILL_GEMM", prefill_gemm)
    _gemm.choice.cache_clear()
    model = _tiny_llama(256)
    assert _fastpath.install(model)
    g = torch.Generator().manual_seed(6)
    lengths, widths = [40, 0, 125, 7, 66], [5, 1, 6, 5, 17]  # 34 rows; one run of 17
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    blocks = [torch.randint(0, 96, (w,), generator=g).tolist() for w in widths]
    gemm_calls = []
    lins = _fastpath._batch_lins

    def spy(p):
        gemm_calls.append(lins(p))
        return gemm_calls[-1]

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fastpath, "_batch_lins", spy)
        alone, together = _alone_and_together(model, prompts, blocks, defer=False)
    assert gemm_calls and gemm_calls[-1] is not None  # the panels ran the 34 rows
    for (a_logits, a_kv), (t_logits, t_kv) in zip(alone, together, strict=True):
        assert (t_logits - a_logits).abs().max() <= 1e-4 * a_logits.abs().max()
        assert (t_kv - a_kv).abs().max() <= 1e-4 * a_kv.abs().max()


@needs_lib
def test_many_sequences_refuse_a_shared_slab_or_an_empty_block() -> None:
    from p2pnode.inference._cpu import fastpath as _fastpath

    model = _tiny_llama()
    assert _fastpath.install(model)
    slab = Slab(2, 2, 16)
    with pytest.raises(ValueError, match="distinct"):
        _fastpath.extend_many(model, [slab, slab], [[1], [2]])
    with pytest.raises(ValueError, match="non-empty"):
        _fastpath.extend_many(model, [slab, Slab(2, 2, 16)], [[1], []])
