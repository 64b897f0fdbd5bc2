"""The verifier's block-size control (speculation/_blocksize.py): the rule on a fake clock (each
pass's duration is given, never read from a clock), and two tenants through the real verifier
following its advice with outputs equal to the target's."""

from __future__ import annotations

import pytest
import trio

from p2pnode.overlay import wire
from p2pnode.speculation import BatchedVerifier, speculative_generate, target_generate
from p2pnode.speculation._blocksize import AcceptanceMeter, BlockSizer
from p2pnode.speculation.protocol import LIMIT, VerifyResult
from p2pnode.speculation.testing import inprocess_transport


def _passes(sizer: BlockSizer, positions: int, seconds: float, committed: int, n: int = 20):
    for _ in range(n):
        sizer.observe_pass(positions, seconds, committed)


def test_load_up_shortens_blocks() -> None:
    light, heavy = BlockSizer(), BlockSizer()
    # one tenant: 5 positions a pass in one decode step's time (memory-bound)
    _passes(light, 5, 0.044, 3)
    # sixteen tenants of 5 positions: 0.66 s a pass (8 ms a position past the free ones)
    _passes(heavy, 80, 0.66, 48)
    assert light.want(0.75, own_positions=5) == 4  # the free positions, no more
    assert heavy.want(0.75, own_positions=5) == 1
    assert heavy.c_s == pytest.approx((0.66 - 0.044) / 75, rel=0.05)
    # four tenants in between: fewer drafts than alone, more than among sixteen
    mid = BlockSizer()
    _passes(mid, 20, 0.167, 12)
    assert 1 <= mid.want(0.75, own_positions=5) < 4
    assert mid.want(0.9, own_positions=5) > heavy.want(0.9, own_positions=5)


def test_acceptance_down_shortens_blocks() -> None:
    sizer = BlockSizer()
    _passes(sizer, 40, 0.33, 30)
    wants = [sizer.want(a, own_positions=5) for a in (0.95, 0.85, 0.7, 0.5)]
    assert wants == sorted(wants, reverse=True) and wants[0] > wants[-1]
    assert wants[-1] == 0
    meter = AcceptanceMeter()
    before = meter.alpha
    for _ in range(5):
        meter.observe(drafted=4, accepted=0)  # every block rejected at its first draft
    assert meter.alpha < before / 2
    for _ in range(20):
        meter.observe(drafted=4, accepted=4)
    assert meter.alpha > 0.9
    meter.observe(drafted=0, accepted=0)  # an empty block judges nothing
    meter.observe(drafted=4, accepted=-1)  # nor does a stale one
    assert meter.alpha > 0.9


def test_no_drafts_where_a_position_costs_a_token() -> None:
    # When one position's time commits a token or more at the pass's rate, no draft below
    # certain acceptance pays: every session decodes target-only.
    sizer = BlockSizer()
    _passes(sizer, 64, 0.55, 64)  # 64 one-token rows: ~8 ms a position, 116 tokens/s
    assert sizer.c_s * sizer.rate >= 0.9
    assert all(sizer.want(a, own_positions=1) == 0 for a in (0.5, 0.8, 0.89))


def test_want_travels_on_the_wire_and_old_frames_read_as_no_advice() -> None:
    frame = wire.encode_frame(wire.to_wire(VerifyResult(3, 1, 7, 12, 2)), limit=LIMIT)
    got = wire.from_wire(wire.decode_frame(frame, limit=LIMIT), VerifyResult)
    assert got.want == 2
    old = wire.to_wire(VerifyResult(3, 1, 7, 12))
    assert wire.from_wire(old, VerifyResult).want == -1


class _Recording:
    """The in-process transport, recording each block's size and each result's advice."""

    def __init__(self, inner) -> None:
        self.inner, self.max_block = inner, inner.max_block
        self.events: list[tuple[str, int]] = []

    async def open(self, prompt, options, *, lead: int = 0) -> int:
        return await self.inner.open(prompt, options, lead=lead)

    async def send_block(self, block) -> None:
        self.events.append(("block", len(block.tokens)))
        await self.inner.send_block(block)

    async def receive_result(self):
        res = await self.inner.receive_result()
        if getattr(res, "want", None) is not None:
            self.events.append(("want", res.want))
        return res

    async def close(self) -> None:
        await self.inner.close()


async def test_two_tenants_follow_the_advice_and_equal_the_target(target, draft, prompts) -> None:
    # A verifier that wants at most one draft per block: the tenant without lead, asking for
    # 4, sends blocks of one token once advised (no lead: no lengthened first blocks); the one
    # with lead may also be moved to lead-only decoding. Both outputs equal the target's.
    n = 20
    eos = target.eos_token_ids
    refs = [target_generate(target, p, n, eos_token_ids=eos) for p in prompts[:2]]
    verifier = BatchedVerifier(target, max_wait_ms=5)
    verifier.sizer = BlockSizer(max_want=1)
    got: dict[int, list[int]] = {}
    records: dict[int, _Recording] = {}

    async def tenant(i: int, lead: int) -> None:
        async with inprocess_transport(verifier, one_way_delay_s=0.01) as inner:
            records[i] = _Recording(inner)
            r = await speculative_generate(
                draft, records[i], prompts[i], n, gamma=4, depth=2, lead=lead, eos_token_ids=eos
            )
        got[i] = r.tokens

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            await nursery.start(verifier.run)
            async with trio.open_nursery() as runs:
                runs.start_soon(tenant, 0, 0)
                runs.start_soon(tenant, 1, 8)
            nursery.cancel_scope.cancel()
    assert [got[0], got[1]] == refs
    for rec in records.values():
        wants = [v for kind, v in rec.events if kind == "want"]
        assert wants and max(wants) <= 1, rec.events
    events = records[0].events
    first = next(i for i, (kind, _) in enumerate(events) if kind == "want")
    sizes = [v for kind, v in events[first:] if kind == "block"]
    # the block in the making when the advice came keeps its size; every later one has 1
    assert len(sizes) >= 3 and all(v == 1 for v in sizes[1:]), events
