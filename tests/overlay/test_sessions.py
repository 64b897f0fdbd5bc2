"""The router's look-ahead for chat sessions (overlay/routing/sessions.py, overlay/routing/router.py)."""

from __future__ import annotations

import pytest

from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.inference.vllm.events import BlockStored
from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.routing.router import LOCAL, LocalState, Router
from p2pnode.overlay.routing.sessions import SessionTurns


def test_future_turns_are_learned_from_the_turn_counts_seen() -> None:
    turns = SessionTurns(decay=1.0)
    assert turns.future_turns(0) == 0.0  # nothing seen yet
    for _ in range(10):  # ten sessions of four turns
        for t in range(4):
            turns.observe(t)
    for _ in range(10):  # and ten one-shot chats
        turns.observe(0)
    assert turns.future_turns(0) == pytest.approx(30 / 20)
    assert turns.future_turns(2) == pytest.approx(1.0)
    assert turns.future_turns(3) == 0.0 and turns.future_turns(9) == 0.0
    with pytest.raises(ValueError):
        turns.observe(-1)


def test_forgetting_follows_a_change_of_traffic() -> None:
    turns = SessionTurns(decay=0.9)
    for _ in range(50):  # long sessions first ...
        for t in range(6):
            turns.observe(t)
    for _ in range(50):  # ... then only one-shot chats
        turns.observe(0)
    assert turns.future_turns(0) < 0.05


def test_a_first_turn_stays_local_when_its_session_would_pay_the_wan_each_turn() -> None:
    model, peer = "session-model", "peer-far"
    system = [(11 * i) % 40000 + 1 for i in range(480)]  # a 480-token system prompt
    tokens = system + [7, 8, 9] * 11
    hashes = block_hashes(tokens, model_salt(model))
    speeds = LoadInfo(
        queue_depth=0, est_wait_s=0.0, push_back=False,
        prefill_s_per_token=0.0025, decode_s_per_token=0.06,
    )  # fmt: skip
    holder = DigestBuilder(peer, model, load_fn=lambda: speeds)
    holder.on_event(BlockStored(tuple(hashes[:30]), None))
    views = PeerViews()
    views.apply(holder.full())
    router = Router(views, rtt_s=lambda _p: 0.2)  # 200 ms away: a forward costs ~3 RTT

    def decide(future: float):
        return router.decide(
            model_id=model, prompt_block_hashes=hashes, prompt_tokens=len(tokens),
            max_tokens=32,
            local=LocalState(cached_tokens=0, wait_s=0.0, prefill_s_per_token=0.0025,
                             decode_s_per_token=0.06),
            future_turns=future,
        )  # fmt: skip

    # One-shot: the peer saves ~1.2 s of prefill for ~0.6 s of network: forward.
    alone = decide(0.0)
    assert alone.chosen == peer and alone.estimate_for(peer).lookahead_s == 0.0
    # Three more turns will follow wherever this one runs: 4 x 0.6 s of network > 1.2 s.
    session = decide(3.0)
    est = session.estimate_for(peer)
    assert session.chosen == LOCAL
    assert est.lookahead_s == pytest.approx(3 * est.network_s)
