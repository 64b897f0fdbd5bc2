"""Fuzzing every decoder of untrusted bytes: random and mutated-valid inputs may only raise our
own error types (WireError / IdentityError / DigestError / VerifierError / ForwardFailed /
PullFailed), never crash with anything else, never hang, and leave the server able to answer a
valid request. The longer, coverage-guided run of the same decoders is bench/fuzz_long.py."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.identity import (
    IdentityError,
    NodeKey,
    new_node_record,
    open_envelope,
    peek_timestamp,
    plaincbor,
    seal,
    sign_node_record,
    verify_node_record,
)
from p2pnode.overlay.cache.antientropy import (
    DIGEST_PROTOCOL,
    AntiEntropy,
    DigestPull,
    DigestReply,
    DigestUnavailable,
    PullFailed,
)
from p2pnode.overlay.cache.digest import (
    DIGEST_KIND,
    DROP_REASONS,
    Digest,
    DigestBuilder,
    DigestError,
    LoadInfo,
    decode_fingerprints,
    digest_to_payload,
    encode_fingerprints,
    open_digest,
)
from p2pnode.overlay.cache.views import ApplyResult, PeerViews
from p2pnode.overlay.limits import Budget, LimitsConfig, PeerLimiter
from p2pnode.overlay.serve.forward import (
    FORWARD_PROTOCOL,
    ForwardAccepted,
    ForwardDone,
    ForwardError,
    ForwardFailed,
    ForwardRequest,
    ForwardServer,
    ForwardTokens,
    forward_request,
)
from p2pnode.overlay.wire import (
    WireError,
    bounded,
    decode_frame,
    encode_frame,
    from_wire,
    limit_for,
    message,
    read_frame,
    to_wire,
)
from p2pnode.speculation import BadBlock, BatchedVerifier
from p2pnode.speculation import protocol as protocol_module
from p2pnode.speculation.protocol import (
    LIMIT as VERIFY_LIMIT,
)
from p2pnode.speculation.protocol import (
    VerifyBlock,
    VerifyClose,
    VerifyError,
    VerifyOpen,
    VerifyOpened,
    VerifyRefused,
    VerifyResult,
    decode_q,
    serve_limited,
)

from testkit.streams import BytesStream, StubNode, feed, frame_bytes, read_frames, run_now

KEY = NodeKey.from_seed(b"\x07" * 32)
NOW = time.time()
LIMIT = 4096

# 2000 examples per decoder keeps this file under ~40 s on 2 shared cores; the deadline
# is generous (a single decode takes well under 1 ms) so that only a real hang trips it.
FUZZ = settings(
    max_examples=2000,
    deadline=timedelta(milliseconds=500),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@message("fuzz-inner")
@dataclass(frozen=True)
class FuzzInner:
    k: str = field(metadata=bounded(max_len=8))


@message("fuzz-msg")
@dataclass(frozen=True)
class FuzzMsg:
    n: int = field(metadata=bounded(ge=0, le=100))
    x: float
    s: str
    b: bytes = field(metadata=bounded(max_len=8))
    hashes: list[int]
    caps: dict[str, float]
    pair: tuple[int, str]
    roles: frozenset[str]
    inner: FuzzInner
    opt: int | None = None


VALID_MSG = FuzzMsg(
    1, 2.5, "s", b"b", [1, 2], {"a": 1.0}, (1, "x"), frozenset({"r"}), FuzzInner("k")
)
VALID_FRAME = encode_frame(to_wire(VALID_MSG), limit=LIMIT)
VALID_ENVELOPE = seal(KEY, "digest", {"blocks": [1, 2, 3], "m": "model"}, now=NOW)
VALID_RECORD = sign_node_record(
    KEY, new_node_record(KEY, ["/ip4/127.0.0.1/tcp/1"], ["m"], ["router"], {"slots": 2}, "0.1")
)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with a few random flips, insertions, deletions, or a truncation."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos : pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


def inputs(valid: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=600), mutated(valid))


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
_keys = st.text(max_size=6) | st.binary(max_size=4)
# Two levels of containers by hand: much cheaper to draw than st.recursive.
_shallow = _leaves | st.lists(_leaves, max_size=4) | st.dictionaries(_keys, _leaves, max_size=4)
plain_values = (
    _shallow
    | st.lists(_shallow, max_size=3)
    | st.dictionaries(_keys | st.sampled_from(["t", "k", "n"]), _shallow, max_size=3)
)


@FUZZ
@given(inputs(VALID_FRAME))
def test_decode_frame_only_wire_errors(data: bytes) -> None:
    try:
        obj = decode_frame(data, limit=LIMIT)
    except WireError:
        return
    # Whatever decodes must also go through the schema layer cleanly.
    with contextlib.suppress(WireError):
        from_wire(obj, FuzzMsg)


@FUZZ
@given(inputs(VALID_FRAME), st.integers(1, 64))
def test_read_frame_only_wire_errors(data: bytes, chunk: int) -> None:
    stream = BytesStream(data, chunk)
    # Bounded: every frame read consumes at least its 4-byte header.
    for _ in range(len(data) // 4 + 2):
        try:
            if run_now(read_frame(stream, limit=LIMIT)) is None:
                return
        except WireError:
            return
    raise AssertionError("more frames than the input can hold")


def _wire_mutations(obj: dict[str, Any]) -> st.SearchStrategy[Any]:
    keys = sorted(obj) + ["zz", "inner"]
    return st.one_of(
        plain_values,
        st.builds(lambda k, v: {**obj, k: v}, st.sampled_from(keys), plain_values),
        st.builds(lambda k: {a: b for a, b in obj.items() if a != k}, st.sampled_from(keys)),
    )


@FUZZ
@given(_wire_mutations(to_wire(VALID_MSG)))
def test_from_wire_only_schema_errors(obj: Any) -> None:
    try:
        msg = from_wire(obj, FuzzMsg)
    except WireError:
        return
    assert to_wire(msg)["t"] == "fuzz-msg"  # anything accepted re-encodes


@FUZZ
@given(inputs(VALID_ENVELOPE))
def test_open_envelope_only_identity_errors(data: bytes) -> None:
    try:
        opened = open_envelope(data, "digest", now=NOW)
    except IdentityError:
        return
    # Mutations that survive must not have changed anything signed.
    assert opened.payload == {"blocks": [1, 2, 3], "m": "model"}


@FUZZ
@given(st.one_of(inputs(VALID_ENVELOPE), plain_values.map(plaincbor.encode)))
def test_peek_timestamp_never_raises(data: bytes) -> None:
    # Pubsub peeks at every message of a digest topic before anything else checks it (to
    # drop expired gossip): a raise there ended the sender's loop to that peer.
    stamp = peek_timestamp(data)
    assert stamp is None or isinstance(stamp, float)


def test_peek_timestamp_of_a_map_that_is_no_envelope_is_none() -> None:
    assert peek_timestamp(plaincbor.encode({"v": 1})) is None


@FUZZ
@given(inputs(VALID_RECORD))
def test_verify_node_record_only_identity_errors(data: bytes) -> None:
    try:
        record = verify_node_record(data)
    except IdentityError:
        return
    assert record.peer_id == KEY.peer_id


# ------------------------------------------------------------------------------------------
# Overlay and speculation decoders and handlers: digests, forwarding, verifier,
# digest pull. Handlers get garbage over in-memory trio streams, one fresh trio run per example;
# afterwards the same server must still answer a valid request (no state corruption). Budgets
# are set per test so that all of this section stays well under ~40 s on 2 shared cores.

HANDLER = settings(
    max_examples=100,
    deadline=None,  # a handler run is bounded by its own trio.fail_after instead
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DIGEST_FUZZ = settings(
    max_examples=250,
    deadline=timedelta(milliseconds=2000),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Schema-level and client-side tests (one trio run per example for the clients).
NET = settings(DIGEST_FUZZ, max_examples=200, deadline=None)
MODEL_ID = "fuzz-model@0"
PEER_KEY = NodeKey.from_seed(b"\x09" * 32)


def _sealed_digest(payload: dict[str, Any]) -> bytes:
    return seal(PEER_KEY, DIGEST_KIND, payload, now=NOW)


def _valid_digest(base: int | None = None, added: range = range(5, 40, 3)) -> Digest:
    return Digest(
        peer_id=PEER_KEY.peer_id,
        model_id=MODEL_ID,
        epoch=7,
        version=3,
        base_version=base,
        fp_bits=32,
        added=frozenset(added),
        removed=frozenset({1, 2}) if base is not None else frozenset(),
        cleared=False,
        load=LoadInfo(2, 0.5, False, 0.001, 0.05),
    )


VALID_FULL_PAYLOAD = digest_to_payload(_valid_digest())
VALID_DELTA_PAYLOAD = digest_to_payload(_valid_digest(base=2, added=range(100, 110)))
VALID_DIGEST = _sealed_digest(VALID_FULL_PAYLOAD)


def _check_view(views: PeerViews) -> None:
    for view in views.views():
        assert all(0 <= fp < 1 << view.fp_bits for fp in view.fingerprints)


@DIGEST_FUZZ
@given(st.integers(-2, 2**70), st.integers(-2, 70), st.binary(max_size=64), st.integers(16, 64))
def test_decode_fingerprints_only_digest_errors(count: int, k: int, data: bytes, bits: int) -> None:
    try:
        out = decode_fingerprints(count, k, data, bits)
    except DigestError:
        return
    assert len(out) == count and out == sorted(set(out)) and all(0 <= x < 1 << bits for x in out)


@DIGEST_FUZZ
@given(st.sets(st.integers(0, 2**32 - 1), max_size=200))
def test_fingerprint_sets_round_trip(values: set[int]) -> None:
    assert decode_fingerprints(*encode_fingerprints(values, 32), 32) == sorted(values)


@DIGEST_FUZZ
@given(
    st.one_of(_wire_mutations(VALID_FULL_PAYLOAD), _wire_mutations(VALID_DELTA_PAYLOAD)),
    st.booleans(),
)
def test_signed_digest_payloads_only_digest_errors_and_views_stay_sane(
    payload: Any, delta_first: bool
) -> None:
    """Payloads signed by a real key (so the signature passes and the payload checks are what
    is fuzzed), opened and applied to views that already hold a valid state."""
    try:
        data = _sealed_digest(payload)
    except IdentityError:
        return  # not plain data: it could never be sent
    views = PeerViews()
    views.apply(dataclasses.replace(_valid_digest(), version=2, timestamp=NOW))
    try:
        digest = open_digest(data, now=NOW)
    except DigestError as exc:
        assert exc.reason in DROP_REASONS
        return
    assert digest.peer_id == PEER_KEY.peer_id
    views.apply(digest)
    _check_view(views)


@DIGEST_FUZZ
@given(inputs(VALID_DIGEST))
def test_open_digest_bytes_only_digest_errors(data: bytes) -> None:
    try:
        digest = open_digest(data, now=NOW)
    except DigestError as exc:
        assert exc.reason in DROP_REASONS
        return
    assert digest.model_id == MODEL_ID  # only an untouched envelope can pass the signature


@DIGEST_FUZZ
@given(st.lists(inputs(VALID_DIGEST), min_size=1, max_size=3), st.sampled_from(["gossip", "pull"]))
def test_ingest_garbage_never_raises_and_keeps_views_sane(datas: list[bytes], source: str) -> None:
    ae = AntiEntropy(StubNode("me"), KEY, PeerViews(), models=[MODEL_ID])

    async def main() -> None:  # ingest reads trio's clock
        for data in datas:
            expected = PEER_KEY.peer_id if source == "gossip" else None
            result = ae.ingest(data, model=MODEL_ID, source=source, expected_peer=expected)
            assert result is None or isinstance(result, ApplyResult)

    trio.run(main)
    _check_view(ae.views)
    assert sum(ae.drops.values()) + sum(ae.results.values()) <= len(datas)


@st.composite
def stream_inputs(draw: st.DrawFn, first: Any, rest: Any, limit: int) -> bytes:
    """Garbage for a handler: raw bytes, or a (mutated) first message then (mutated) others."""
    if draw(st.integers(0, 3)) == 0:
        return draw(inputs(frame_bytes(first, limit)))
    parts = []
    for i, msg in enumerate([first] + [rest] * draw(st.integers(0, 2))):
        wire_obj = draw(_wire_mutations(to_wire(msg))) if draw(st.booleans()) else to_wire(msg)
        try:
            frame = encode_frame(wire_obj, limit=limit)
        except WireError:
            frame = b""
        parts.append(draw(mutated(frame)) if frame and i and draw(st.booleans()) else frame)
    return b"".join(parts)


@pytest.fixture(scope="module")
def fuzz_model(loaded: Any) -> Any:
    torch.set_num_threads(1)  # the verifier's forwards: 2 shared cores
    return loaded


# -- forwarding


FWD_LIMIT = limit_for(FORWARD_PROTOCOL)
FWD_REQUEST = ForwardRequest(
    model_id="placeholder", prompt=[10, 11, 12], max_tokens=3, deadline_s=5.0
)
FWD_REPLIES = (ForwardAccepted(0, 0), ForwardTokens(0, [5]), ForwardDone(1, "length", 0, 3, 0, 0))


@NET
@given(
    st.one_of(
        *(_wire_mutations(to_wire(m)) for m in (FWD_REQUEST, *FWD_REPLIES)),
        _wire_mutations(to_wire(ForwardError("busy", "x"))),
    )
)
def test_forward_messages_only_schema_errors(obj: Any) -> None:
    types = (ForwardRequest, ForwardAccepted, ForwardTokens, ForwardDone, ForwardError)
    try:
        msg = from_wire(obj, *types)
    except WireError:
        return
    assert from_wire(to_wire(msg), *types) == msg


@contextlib.asynccontextmanager
async def _emulated(loaded: Any) -> Any:
    from p2pnode.inference.engine import open_engine

    async with open_engine(loaded, backend="emulated", calibrate_cost=False, torch_threads=1) as e:
        e.cost.prefill_s_per_token = e.cost.decode_s_per_token = e.cost.overhead_s = 0.0
        yield e


async def _valid_forward(server: ForwardServer, model_id: str) -> None:
    req = dataclasses.replace(FWD_REQUEST, model_id=model_id)
    out, raised = await feed(server.handle, frame_bytes(req, FWD_LIMIT))
    replies = [from_wire(f) for f in read_frames(out, FWD_LIMIT)]
    assert raised is None and isinstance(replies[-1], ForwardDone), replies
    assert replies[-1].n_tokens == 3


def test_forward_handler_with_garbage_then_serves_a_valid_request(fuzz_model: Any) -> None:
    request = dataclasses.replace(FWD_REQUEST, model_id=fuzz_model.model_id)

    @HANDLER
    @given(stream_inputs(request, request, FWD_LIMIT))
    def run(data: bytes) -> None:
        async def main() -> None:
            async with _emulated(fuzz_model) as engine:
                server = ForwardServer(engine, limiter=PeerLimiter())
                out, raised = await feed(server.handle, data)
                assert raised is None or isinstance(raised, WireError), repr(raised)
                for obj in read_frames(out, FWD_LIMIT):  # everything sent back is well formed
                    from_wire(obj, ForwardAccepted, ForwardTokens, ForwardDone, ForwardError)
                assert engine.queue_depth == 0
                assert server.limiter.usage("unknown-peer")["bytes"] == 0
                await _valid_forward(server, engine.model_id)

        trio.run(main)

    run()


@NET
@given(stream_inputs(FWD_REPLIES[0], FWD_REPLIES[1], FWD_LIMIT))
def test_forward_client_with_garbage_replies_only_forward_failed(data: bytes) -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        await server.send_all(data)
        await server.send_eof()
        with trio.fail_after(10):
            try:
                out = await forward_request(
                    StubNode("me", client),
                    "peer",
                    FWD_REQUEST,
                    accept_timeout_s=5,
                    first_token_timeout_s=5,
                    idle_timeout_s=5,
                )
            except ForwardFailed as exc:
                assert exc.reason in {"eof", "protocol", "timeout", "unreachable"} or exc.tokens
                return
        assert len(out.tokens) == out.done.n_tokens <= FWD_REQUEST.max_tokens

    trio.run(main)


# -- verifier


VERIFY_OPEN = VerifyOpen("placeholder", [1, 2, 3])
VERIFY_BLOCK = VerifyBlock(0, 3, 3, [4, 5])


@NET
@given(
    st.one_of(
        *(
            _wire_mutations(to_wire(m))
            for m in (
                VERIFY_OPEN,
                VERIFY_BLOCK,
                VerifyOpened(3, 10, 4),
                VerifyResult(0, 1, 3, 5),
                VerifyRefused("BadMessage", "x"),
            )
        )
    )
)
def test_verifier_messages_only_schema_errors(obj: Any) -> None:
    types = (VerifyOpen, VerifyBlock, VerifyOpened, VerifyResult, VerifyRefused, VerifyClose)
    try:
        msg = from_wire(obj, *types)
    except WireError:
        return
    assert from_wire(to_wire(msg), *types) == msg


@NET
@given(
    st.lists(st.integers(0, 40), max_size=4),
    st.integers(0, 4),
    st.binary(max_size=64),
    st.binary(max_size=64),
    st.booleans(),
)
def test_decode_q_only_bad_block(
    tokens: list[int], width: int, ids: bytes, vals: bytes, aligned: bool
) -> None:
    n = 4 * len(tokens) * width
    if aligned:  # right sizes, random content: reaches the value checks
        ids, vals = (
            (ids * (n // max(len(ids), 1) + 1))[:n],
            (vals * (n // max(len(vals), 1) + 1))[:n],
        )
    try:
        q = decode_q(VerifyBlock(0, 3, 3, tokens, width, ids, vals), 32)
    except BadBlock:
        return
    assert q is None or torch.allclose(q.sum(-1), torch.ones(len(tokens)), atol=1e-3)


def test_verifier_handler_with_garbage_then_serves_a_valid_session(fuzz_model: Any) -> None:
    open_msg = dataclasses.replace(VERIFY_OPEN, model_id=fuzz_model.model_id)
    valid = frame_bytes(open_msg, VERIFY_LIMIT) + frame_bytes(VERIFY_BLOCK, VERIFY_LIMIT)

    @settings(HANDLER, max_examples=12)  # ~0.3 s per real-model session on 1 thread
    @given(stream_inputs(open_msg, VERIFY_BLOCK, VERIFY_LIMIT))
    def run(data: bytes) -> None:
        # Fresh per example: trio primitives (the verifier's lock and channel) belong to one run.
        verifier = BatchedVerifier(fuzz_model, max_sessions=4, idle_timeout_s=30)
        # Every example comes from the same (unknown) peer: lift its rates, keep other limits.
        limiter = PeerLimiter(LimitsConfig(verify=Budget(1e6, 1e6, 8, 64)))

        async def serve(stream: Any) -> None:
            await serve_limited(stream, verifier, limiter)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                await nursery.start(verifier.run)
                out, raised = await feed(serve, data)
                assert raised is None, repr(raised)  # every failure becomes a refusal frame
                for obj in read_frames(out, VERIFY_LIMIT):
                    from_wire(obj, VerifyOpened, VerifyRefused, VerifyResult, VerifyError)
                assert not verifier.sessions  # the session is always released
                assert limiter.usage("unknown-peer") == {
                    "active": {"verify": 0},
                    "sessions": 0,
                    "bytes": 0,
                }
                out, raised = await feed(serve, valid)  # and the verifier still works
                replies = [from_wire(f) for f in read_frames(out, VERIFY_LIMIT)]
                assert raised is None and isinstance(replies[0], VerifyOpened), replies
                assert isinstance(replies[1], VerifyResult) and replies[1].accepted >= 0
                nursery.cancel_scope.cancel()

        trio.run(main)

    run()


async def test_verifier_handler_with_a_stalled_peer_ends_cleanly(
    fuzz_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that sends half an open frame and then nothing: the handler gives up after
    OPEN_TIMEOUT_S (shortened here) without an error of its own. Before, ``obj`` was unbound
    there and the handler died with UnboundLocalError."""
    monkeypatch.setattr(protocol_module, "OPEN_TIMEOUT_S", 0.2)
    verifier = BatchedVerifier(fuzz_model)
    limiter = PeerLimiter()
    client, server = trio.testing.memory_stream_pair()
    await client.send_all(frame_bytes(VERIFY_OPEN, VERIFY_LIMIT)[:10])  # header + part of the body
    with trio.fail_after(10):
        await serve_limited(server, verifier, limiter)
    assert not verifier.sessions and limiter.usage("unknown-peer")["bytes"] == 0


# -- digest pull


DIGEST_LIMIT = limit_for(DIGEST_PROTOCOL)
PULL = DigestPull(MODEL_ID, 7, 1)


def _pull_server() -> AntiEntropy:
    builder = DigestBuilder(KEY.peer_id, MODEL_ID, epoch=7)
    builder.sync(range(1 << 40, (1 << 40) + 50 * (1 << 33), 1 << 33))
    return AntiEntropy(StubNode(KEY.peer_id), KEY, PeerViews(), builders={MODEL_ID: builder})


@HANDLER
@given(stream_inputs(PULL, PULL, DIGEST_LIMIT))
def test_digest_pull_server_with_garbage_then_answers_a_valid_pull(data: bytes) -> None:
    ae = _pull_server()

    async def main() -> None:
        out, raised = await feed(ae._serve_pull, data)
        assert raised is None or isinstance(raised, WireError), repr(raised)
        for obj in read_frames(out, DIGEST_LIMIT):
            from_wire(obj, DigestReply, DigestUnavailable)
        out, raised = await feed(ae._serve_pull, frame_bytes(DigestPull(MODEL_ID), DIGEST_LIMIT))
        (reply,) = [from_wire(f, DigestReply) for f in read_frames(out, DIGEST_LIMIT)]
        assert len(open_digest(reply.envelope, now=time.time()).added) == 50

    trio.run(main)


@NET
@given(stream_inputs(DigestReply(VALID_DIGEST), DigestReply(VALID_DIGEST), DIGEST_LIMIT))
def test_digest_pull_client_with_garbage_replies_only_pull_failed(data: bytes) -> None:
    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        await server.send_all(data)
        await server.send_eof()
        ae = AntiEntropy(StubNode("me", client), KEY, PeerViews(), models=[MODEL_ID])
        with trio.fail_after(10), contextlib.suppress(PullFailed):
            await ae.pull(PEER_KEY.peer_id, MODEL_ID)
        _check_view(ae.views)

    trio.run(main)
