"""The verifier's batching step without a model (``speculation/_batching.py``), the edge's choice
between drafting and letting the verifier decode alone (``_flight.DraftHistory``), what the edge
tells a stream of its committed tokens (``_flight.Committed``), the package face
and the error codes the verify protocol carries (``speculation/_errors.py``)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

import p2pnode.speculation as spec
from p2pnode.errors import P2PNodeError
from p2pnode.speculation import protocol
from p2pnode.speculation._batching import Row, Session, Waiter, accept, may_lead, plan
from p2pnode.speculation._errors import VerifierError
from p2pnode.speculation._flight import Committed, DraftHistory
from p2pnode.speculation._lookup import NgramIndex

V = 8


def _session(tokens: list[int], *, lead: int = 0, sid: str = "s") -> Session:
    gen = torch.Generator().manual_seed(0)
    return Session(sid, spec.SamplingOptions(), tokens, DynamicCache(), gen, 0.0, lead, lead)


def _logits(best: list[int]) -> torch.Tensor:
    """Logits whose argmax at row i is ``best[i]``."""
    out = torch.zeros(len(best), V)
    out[torch.arange(len(best)), best] = 1.0
    return out


def test_plan_answers_stale_superseded_and_led_blocks_without_computing() -> None:
    s = _session([1, 2, 3, 4, 5], lead=3)  # committed 5: tokens 3..4 came from leads
    blocks = {
        "stale": spec.Block(0, 3, 9, (4,)),  # the edge believes token 2 is 9
        "superseded": spec.Block(1, 3, 3, (4, 7)),  # a lead committed 5 where it drafted 7
        "led": spec.Block(2, 3, 3, (4,)),  # every draft token agreed; the next is known
        "compute": spec.Block(3, 3, 3, (4, 5, 6)),  # 2 agree with leads, 1 left to verify
        "keepalive": spec.Block(4, 3, 3, ()),  # empty: "keep decoding", behind the leads
    }
    for name, block in blocks.items():
        s.busy = False
        batch = plan([Waiter(s, block)], [], max_batch=8, max_tokens=100)
        if name == "compute":
            assert not batch.decided and [(r.skip, r.draft) for r in batch.rows] == [(2, (6,))]
            continue
        (out,) = batch.decided
        assert not batch.rows
        assert (
            out.answer
            == {
                "stale": spec.BlockResult(0, -1, -1, 5),
                "superseded": spec.BlockResult(1, 1, 5, 5),
                "led": spec.BlockResult(2, 1, 5, 5),
                "keepalive": spec.BlockResult(4, 0, 4, 5),
            }[name]
        )
        # a broken pipeline refills the lead budget, and so does an empty block
        assert out.lead_left == (None if name == "led" else 3)


def test_draft_history_measures_both_behaviours_then_keeps_the_faster() -> None:
    h = DraftHistory()
    assert [h.choose(4), h.choose(4)] == ["draft", "draft"]  # nothing measured yet
    h.observe("draft", 16, 0.4)  # 40 tokens/s
    assert h.choose(4) == "lead"  # the other is measured once, then compared
    h.observe("lead", 16, 0.8)
    h.observe("lead", 0, 0.1)  # an empty stretch says nothing
    assert h.rates == {"draft": 40.0, "lead": 20.0}
    assert h.choose(4) == "lead"  # the 4th choice explores the slower
    assert [h.choose(4) for _ in range(3)] == ["draft"] * 3
    h.observe("draft", 16, 1.6)  # the round trip grew: 10 tokens/s, smoothed to 25
    assert h.rates["draft"] == 25.0 and h.choose(4) == "lead"


def test_a_stream_hears_the_committed_tokens_up_to_the_output_limit_and_eos() -> None:
    heard: list[list[int]] = []
    c = Committed([1, 2], None, heard.append, limit=4)
    c.place(2, [5, 6, 7])
    c.place(5, [8, 9, 3])  # a whole block accepted: past the limit, which the result drops
    c.place(2, [5, 6])  # already committed: nothing new
    assert heard == [[5, 6, 7], [8]] and c.tokens == [1, 2, 5, 6, 7, 8, 9, 3]
    heard.clear()
    c = Committed([1], None, heard.append, limit=10, eos=(0,))
    c.place(1, [4, 0, 6])  # the output ends at its first end-of-sequence token
    c.place(4, [7])
    assert heard == [[4, 0]]


def test_plan_refuses_past_the_limit_and_fills_the_batch_with_lead_steps() -> None:
    s = _session([1, 2, 3])
    (out,) = plan([Waiter(s, spec.Block(0, 3, 3, (4, 5)))], [], 8, max_tokens=5).decided
    assert isinstance(out.answer, spec.SessionLimit)
    leaders = [_session([1], lead=2, sid=f"l{i}") for i in range(3)]
    batch = plan([Waiter(s, spec.Block(0, 3, 3, ()))], leaders, max_batch=3, max_tokens=100)
    assert [r.waiter is None for r in batch.rows] == [False, True, True]
    free, at_limit = may_lead([*leaders, _session([1, 2, 3, 4], lead=1, sid="full")], 5)
    assert [x.sid for x in free] == ["l0", "l1", "l2"] and [x.sid for x in at_limit] == ["full"]


def test_a_lead_step_checks_prompt_lookup_guesses_within_its_budget_and_limit() -> None:
    # The session's tokens end in (5, 6), which was followed by 7, 5, 6 before: those are the
    # guesses. The target takes the first two and then says 3: three tokens commit, each told
    # as its own Lead at its position, and the budget pays for all three.
    s = _session([5, 6, 7, 5, 6], lead=6)
    s.lookup = NgramIndex(2)
    s.lookup.extend(s.tokens)
    (row,) = plan([], [s], max_batch=8, max_tokens=100, lookup=3).rows
    assert row.waiter is None and row.guess == (7, 5, 6) and row.inputs == [6, 7, 5, 6]
    (out,) = accept([row], [(_logits([7, 5, 3, 0]), DynamicCache())])
    assert out.commit == (7, 5, 3)
    assert out.answer == (spec.Lead(5, 7), spec.Lead(6, 5), spec.Lead(7, 3))
    assert out.lead_left == 3
    assert dict(out.tally) == {"lead": 3, "lookup_guessed": 3, "lookup_accepted": 2}
    # never more guesses than the budget leaves room for, nor past the token limit
    s.lead_left = 2
    assert plan([], [s], 8, max_tokens=100, lookup=3).rows[0].guess == (7,)
    s.lead_left = 6
    assert plan([], [s], 8, max_tokens=len(s.tokens) + 3, lookup=3).rows[0].guess == (7,)
    assert plan([], [s], 8, max_tokens=100, lookup=0).rows[0].guess == ()


def test_accept_is_greedy_verification_and_leaves_sessions_alone() -> None:
    s = _session([1, 2, 3], lead=4)
    w = Waiter(s, spec.Block(0, 3, 3, (4, 5, 6)))
    block_row, lead_row = Row(s, w), Row(_session([1], lead=2, sid="t"), None)
    cache = DynamicCache()
    out = accept([block_row, lead_row], [(_logits([4, 7, 0, 0]), cache), (_logits([6]), cache)])
    assert out[0].answer == spec.BlockResult(0, 1, 7, 5) and out[0].commit == (4, 7)
    assert out[0].lead_left == 4  # rejected: lead while the correction travels
    assert out[1].answer == (spec.Lead(1, 6),) and out[1].lead_left == 1
    assert s.tokens == [1, 2, 3]  # committing is BatchedVerifier._apply's
    broken = accept([block_row], [(_logits([4]), cache)])  # too few logit rows: a bug
    assert isinstance(broken[0].answer, VerifierError)


def test_every_error_is_a_p2pnode_error_and_the_wire_codes_stay_the_class_names() -> None:
    errors = [getattr(spec, n) for n in spec.__all__ if n.endswith(("Error", "Verdict"))]
    errors += [spec.VerifierFull, spec.NoVerifier, spec.PeerLimited, spec.WrongModel]
    assert all(issubclass(e, P2PNodeError) and "reason" in vars(e) for e in errors)
    sent = (
        spec.VerifierError,
        spec.VerifierFull,
        spec.SessionLimit,
        spec.UnknownSession,
        spec.SessionBusy,
        spec.BadBlock,
        spec.BadRequest,
        spec.WrongModel,
        spec.PeerLimited,
    )
    wire_codes = {c.__name__: c for c in sent}  # what the wire carried before ``reason``
    assert wire_codes == protocol._BY_CODE
    assert isinstance(protocol._error("BadVerdict", "x"), spec.VerifierError)
    assert not isinstance(protocol._error("BadVerdict", "x"), spec.BadVerdict)
    assert protocol._code(spec.SessionLimit("x")) == "SessionLimit"


def test_the_face_exports_what_it_lists() -> None:
    assert all(hasattr(spec, name) for name in spec.__all__)
    assert len(set(spec.__all__)) == len(spec.__all__)
