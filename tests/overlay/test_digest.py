"""Cache digests (overlay/cache/digest.py): fingerprint sets, sealed digests and what is refused, and
the builder's versions, deltas and refcounts."""

from __future__ import annotations

import pytest

from p2pnode.identity import seal
from p2pnode.inference.blockhash import AllBlocksCleared, BlockRemoved, BlockStored
from p2pnode.overlay.cache.digest import (
    MAX_DIGEST_BYTES,
    DigestBuilder,
    DigestError,
    decode_fingerprints,
    digest_to_payload,
    encode_fingerprints,
    fingerprint,
    open_digest,
    seal_digest,
)

from testkit.routing import KEY_A, KEY_B, MODEL, builder_for, rand_hashes

# --------------------------------------------------------------------------- fingerprint sets


@pytest.mark.parametrize("bits", [16, 24, 32, 64])
@pytest.mark.parametrize("n", [0, 1, 2, 100, 3000])
def test_fingerprint_set_round_trip(bits: int, n: int) -> None:
    values = {fingerprint(h, bits) for h in rand_hashes(n, seed=n + bits)}
    count, k, data = encode_fingerprints(values, bits)
    assert count == len(values)
    assert decode_fingerprints(count, k, data, bits) == sorted(values)


def test_fingerprint_set_edge_values() -> None:
    values = {0, 1, 2, (1 << 32) - 1}
    assert decode_fingerprints(*encode_fingerprints(values, 32), 32) == sorted(values)
    with pytest.raises(ValueError):
        encode_fingerprints({1 << 32}, 32)


def test_fingerprint_set_rejects_corrupt_data() -> None:
    count, k, data = encode_fingerprints({fingerprint(h) for h in rand_hashes(200)}, 32)
    bad_inputs = [
        (count + 1, k, data),  # more items than encoded
        (count, k, data[:-5]),  # truncated
        (count, k, data + b"\x01"),  # trailing garbage
        (count, 70, data),  # impossible Rice parameter
        (10**9, k, data),  # absurd count
        (1, 0, b"\xff" * 64),  # unary run past the 32-bit range
        (0, 0, b"\x00"),
    ]
    for args in bad_inputs:
        with pytest.raises(DigestError) as info:
            decode_fingerprints(*args, 32)
        assert info.value.reason == "malformed"


# --------------------------------------------------------------------------- digests


def test_sealed_digest_round_trip() -> None:
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(500)), None))
    full = b.full()
    opened = open_digest(seal_digest(KEY_A, full))
    assert opened.peer_id == KEY_A.peer_id and opened.is_full
    assert (opened.epoch, opened.version, opened.added) == (full.epoch, full.version, full.added)
    assert opened.load == full.load and opened.timestamp > 0


def test_digest_rejections_are_counted_by_reason() -> None:
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(10)), None))
    good = seal_digest(KEY_A, b.full())
    payload = digest_to_payload(b.full())
    tampered = bytearray(good)
    tampered[-70] ^= 0x01  # inside the signed body or the signature
    cases = {
        "oversized": b"\x00" * (MAX_DIGEST_BYTES + 1),
        "malformed": b"\xff\x00garbage",
        "bad_signature": bytes(tampered),
        "expired": seal_digest(KEY_A, b.full(), now=1000.0),
    }
    # Signed as another kind: the domain tag differs, so the signature cannot verify as a digest.
    cases_other_kind = seal(KEY_A, "node-record", payload)
    for reason, data in cases.items():
        with pytest.raises(DigestError) as info:
            open_digest(data)
        assert info.value.reason == reason, (reason, info.value)
    with pytest.raises(DigestError) as info:
        open_digest(cases_other_kind)
    assert info.value.reason in {"bad_signature", "malformed"}
    with pytest.raises(DigestError) as info:
        open_digest(good, expected_peer=KEY_B.peer_id)
    assert info.value.reason == "wrong_signer"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p.update(n=-1),
        lambda p: p.update(n=True),
        lambda p: p.update(extra=1),
        lambda p: p.pop("m"),
        lambda p: p.update(b=5, n=3),  # base after version
        lambda p: p.update(c=True),  # a full digest cannot clear
        lambda p: p.update(w=float("nan")),
        lambda p: p.update(a=[1, 2]),
        lambda p: p.update(fb=8),
        lambda p: p.update(f=2),
    ],
)
def test_malformed_payloads_are_refused(mutate) -> None:
    b = builder_for(KEY_A)
    b.on_event(BlockStored(tuple(rand_hashes(5)), None))
    payload = digest_to_payload(b.full())
    mutate(payload)
    with pytest.raises(DigestError) as info:
        open_digest(seal(KEY_A, "digest", payload))
    assert info.value.reason in {"malformed", "unsupported"}


def test_builder_versions_deltas_and_refcounts() -> None:
    b = builder_for(KEY_A)
    h = rand_hashes(6)
    assert b.cut() == 0
    b.on_event(BlockStored(tuple(h[:4]), None))
    v1 = b.cut()
    b.on_event(BlockRemoved((h[0],)))
    b.on_event(BlockStored((h[4],), h[3]))
    b.on_event(BlockStored((h[4],), h[3]))  # repeated event: no change
    b.on_event(BlockRemoved((h[5],)))  # never stored: ignored
    d = b.delta_since(v1)
    assert d.base_version == v1 and d.version == v1 + 1
    assert d.added == {fingerprint(h[4])} and d.removed == {fingerprint(h[0])}
    assert b.delta_since(b.version).added == frozenset()  # heartbeat delta
    # Add then remove within one delta window: the last operation wins.
    b.on_event(BlockStored((h[5],), None))
    b.on_event(BlockRemoved((h[5],)))
    d2 = b.delta_since(v1)
    assert fingerprint(h[5]) not in d2.added
    b.on_event(AllBlocksCleared())
    b.on_event(BlockStored((h[1],), None))
    d3 = b.delta_since(v1)
    assert d3.cleared and d3.added == {fingerprint(h[1])}


def test_builder_shared_fingerprint_is_refcounted() -> None:
    b = DigestBuilder(KEY_A.peer_id, MODEL, fp_bits=16)
    x = 0xABCD_0000_0000_0001
    y = 0xABCD_0000_0000_0002  # same top 16 bits
    b.on_event(BlockStored((x, y), None))
    v = b.cut()
    b.on_event(BlockRemoved((x,)))
    assert b.delta_since(v).removed == frozenset()  # y still holds the fingerprint
    b.on_event(BlockRemoved((y,)))
    assert b.delta_since(v).removed == {fingerprint(x, 16)}


def test_builder_log_floor_falls_back_to_full() -> None:
    b = builder_for(KEY_A, max_log=3)
    for i, h in enumerate(rand_hashes(10)):
        b.on_event(BlockStored((h,), None))
        assert b.cut() == i + 1
    assert b.delta_since(1).is_full  # older than the 3 kept changes
    assert not b.delta_since(8).is_full
    assert b.delta_since(99).is_full  # a base from the future (another epoch): full


def test_builder_sync_reconciles_with_engine_set() -> None:
    b = builder_for(KEY_A)
    h = rand_hashes(5)
    b.on_event(BlockStored(tuple(h[:3]), None))
    b.sync(h[2:])
    assert b.fingerprints == {fingerprint(x) for x in h[2:]}
