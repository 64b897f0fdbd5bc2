"""Tests of p2pnode.identity: keys and peer ids (checked against libp2p), envelopes, records."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import cbor2
import pytest
from libp2p.crypto.ed25519 import Ed25519PublicKey, create_new_key_pair
from libp2p.peer.id import ID

from p2pnode.identity import (
    KINDS,
    BadSignature,
    EnvelopeTooLarge,
    ExpiredEnvelope,
    IdentityError,
    InsecureKeyFile,
    InvalidRecord,
    MalformedEnvelope,
    NodeKey,
    NodeRecord,
    RecordBook,
    StaleRecord,
    UnknownKind,
    WrongSigner,
    known_kinds,
    new_node_record,
    open_envelope,
    peek_timestamp,
    peer_id_from_public_key,
    plaincbor,
    register_kind,
    seal,
    sign_node_record,
    verify_node_record,
    verify_signature,
)

T0 = 1_700_000_000.0
ALICE = NodeKey.from_seed(bytes(range(32)))
BOB = NodeKey.from_seed(bytes(range(1, 33)))


# ---------------------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "seed", [bytes(32), b"\x01" * 32, bytes(range(32)), hashlib.sha256(b"seed").digest()]
)
def test_peer_id_equals_libp2p_derivation(seed: bytes) -> None:
    key = NodeKey.from_seed(seed)
    assert key.peer_id == ID.from_pubkey(Ed25519PublicKey.from_bytes(key.public_key)).to_base58()
    libp2p_pair = create_new_key_pair(seed)  # libp2p derives the same key from the same seed
    assert key.public_key == libp2p_pair.public_key.to_bytes()
    assert key.peer_id == ID.from_pubkey(libp2p_pair.public_key).to_base58()
    assert key.peer_id.startswith("12D3KooW")


def test_generated_keys_differ_and_sign() -> None:
    a, b = NodeKey.generate(), NodeKey.generate()
    assert a.peer_id != b.peer_id and len(a.seed) == 32 and len(a.public_key) == 32
    sig = a.sign(b"hello")
    verify_signature(a.public_key, sig, b"hello")
    with pytest.raises(BadSignature):
        verify_signature(b.public_key, sig, b"hello")
    with pytest.raises(BadSignature):
        verify_signature(a.public_key, sig, b"hellO")
    with pytest.raises(BadSignature):
        verify_signature(a.public_key[:31], sig, b"hello")
    assert a.seed.hex() not in repr(a)


def test_bad_seed_and_public_key_lengths() -> None:
    with pytest.raises(IdentityError, match="32 bytes"):
        NodeKey.from_seed(b"short")
    with pytest.raises(IdentityError, match="32 raw bytes"):
        peer_id_from_public_key(b"\x00" * 33)


def test_load_or_create_mode_0600_and_stable(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = NodeKey.load_or_create(home)
    path = home / "node_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == first.seed
    again = NodeKey.load_or_create(home)
    assert again.peer_id == first.peer_id
    assert [p.name for p in home.iterdir()] == ["node_key"]  # no temp file left behind


def test_load_or_create_ignores_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)  # even a umask denying everything must not yield an unreadable key
    try:
        key = NodeKey.load_or_create(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "node_key").stat().st_mode) == 0o600
    assert NodeKey.load_or_create(tmp_path).peer_id == key.peer_id


def test_refuses_readable_key_file(tmp_path: Path) -> None:
    NodeKey.load_or_create(tmp_path)
    path = tmp_path / "node_key"
    path.chmod(0o644)
    with pytest.raises(InsecureKeyFile, match="chmod 600"):
        NodeKey.load_or_create(tmp_path)
    path.chmod(0o600)
    NodeKey.load_or_create(tmp_path)


def test_refuses_corrupt_key_file(tmp_path: Path) -> None:
    path = tmp_path / "node_key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"\x01" * 31)
    os.close(fd)
    with pytest.raises(IdentityError, match="expected a 32-byte"):
        NodeKey.load_or_create(tmp_path)
    (tmp_path / "dir_home").mkdir()
    (tmp_path / "dir_home" / "node_key").mkdir(mode=0o700)
    with pytest.raises(InsecureKeyFile, match="not a regular file"):
        NodeKey.load_or_create(tmp_path / "dir_home")


def test_concurrent_creation_yields_one_key(tmp_path: Path) -> None:
    results: list[str] = []
    barrier = threading.Barrier(8, timeout=10)

    def create() -> None:
        barrier.wait()
        results.append(NodeKey.load_or_create(tmp_path).peer_id)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(results) == 8 and len(set(results)) == 1


# ------------------------------------------------------------------------ envelopes


def test_envelope_round_trip() -> None:
    payload = {"blocks": [1, 2**64 - 1], "model": "m", "raw": b"\x00\xff", "x": 1.5, "n": None}
    data = seal(ALICE, "digest", payload, now=T0)
    opened = open_envelope(data, "digest", now=T0 + 1)
    assert opened.payload == payload
    assert opened.kind == "digest" and opened.timestamp == T0
    assert opened.signer == ALICE.public_key and opened.peer_id == ALICE.peer_id
    assert (
        open_envelope(data, "digest", now=T0, expected_signer=ALICE.public_key).payload == payload
    )
    assert "node-record" in KINDS and len(KINDS) == 9


def test_envelope_wrong_expected_signer() -> None:
    data = seal(ALICE, "digest", {}, now=T0)
    with pytest.raises(WrongSigner):
        open_envelope(data, "digest", now=T0, expected_signer=BOB.public_key)


def _outer(data: bytes) -> dict:
    return cbor2.loads(data)


def test_envelope_signer_swapped_is_bad_signature() -> None:
    outer = _outer(seal(ALICE, "digest", {"a": 1}, now=T0))
    outer["signer"] = BOB.public_key
    with pytest.raises(BadSignature):
        open_envelope(cbor2.dumps(outer), "digest", now=T0)


def test_envelope_tampered_payload_and_signature() -> None:
    outer = _outer(seal(ALICE, "digest", {"a": 1}, now=T0))
    body = bytearray(outer["body"])
    body[-1] ^= 0x01  # flips the payload's value 1 -> 0: still valid CBOR, wrong content
    with pytest.raises(BadSignature):
        open_envelope(cbor2.dumps({**outer, "body": bytes(body)}), "digest", now=T0)
    sig = bytearray(outer["sig"])
    sig[0] ^= 0x80
    with pytest.raises(BadSignature):
        open_envelope(cbor2.dumps({**outer, "sig": bytes(sig)}), "digest", now=T0)


def test_cross_kind_never_verifies() -> None:
    data = seal(ALICE, "digest", {"a": 1}, now=T0)
    with pytest.raises(BadSignature):
        open_envelope(data, "digest-pull", now=T0)
    # Relabelling the body as the other kind, keeping the signature, fails too.
    outer = _outer(data)
    _, ts, payload = cbor2.loads(outer["body"])
    relabelled = plaincbor.encode(["digest-pull", ts, payload])
    with pytest.raises(BadSignature):
        open_envelope(cbor2.dumps({**outer, "body": relabelled}), "digest-pull", now=T0)


def test_unknown_kind_and_register_kind() -> None:
    data = seal(ALICE, "digest", {}, now=T0)
    with pytest.raises(UnknownKind):
        open_envelope(data, "no-such-kind", now=T0)
    with pytest.raises(UnknownKind):
        seal(ALICE, "no-such-kind", {}, now=T0)
    with pytest.raises(UnknownKind, match="invalid envelope kind"):
        register_kind("Bad Kind\0")
    register_kind("test-identity-extra")
    assert "test-identity-extra" in known_kinds()
    opened = open_envelope(
        seal(ALICE, "test-identity-extra", [1], now=T0), "test-identity-extra", now=T0
    )
    assert opened.payload == [1]


def test_expired_and_future_envelopes() -> None:
    data = seal(ALICE, "digest", {}, now=T0)
    open_envelope(data, "digest", now=T0 + 299, max_age=300)
    with pytest.raises(ExpiredEnvelope, match="old"):
        open_envelope(data, "digest", now=T0 + 301, max_age=300)
    open_envelope(data, "digest", now=T0 - 59)
    with pytest.raises(ExpiredEnvelope, match="future"):
        open_envelope(data, "digest", now=T0 - 61)


def test_peek_timestamp_reads_the_stamp_without_verifying() -> None:
    data = seal(ALICE, "digest", {"pad": b"x" * 100}, now=T0)
    assert peek_timestamp(data) == T0
    forged = cbor2.loads(data)
    forged["sig"] = b"\0" * 64
    assert peek_timestamp(cbor2.dumps(forged)) == T0  # unverified: only ever to drop
    assert peek_timestamp(data, max_size=len(data) - 1) is None
    for junk in (b"", b"\xff", cbor2.dumps([1, 2]), b"\xc1\x00", cbor2.dumps({"body": b"\xff"})):
        assert peek_timestamp(junk) is None
    body = plaincbor.encode(["digest", 1, {}])  # an int stamp: no envelope of ours
    assert peek_timestamp(cbor2.dumps({"body": body})) is None


def test_oversized_rejected_before_decoding() -> None:
    data = seal(ALICE, "digest", {"pad": b"x" * 2000}, now=T0)
    with pytest.raises(EnvelopeTooLarge):
        open_envelope(data, "digest", now=T0, max_size=1000)
    # Garbage over the size limit reports the size, proving nothing was decoded.
    with pytest.raises(EnvelopeTooLarge):
        open_envelope(b"\xff" * 1001, "digest", now=T0, max_size=1000)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff",
        cbor2.dumps([1, 2]),
        cbor2.dumps({"v": 1, "body": b"", "signer": b"", "sig": b""}),
        cbor2.dumps({"v": 2, "body": b"", "signer": b"\0" * 32, "sig": b"\0" * 64}),
        cbor2.dumps({"v": 1.0, "body": b"", "signer": b"\0" * 32, "sig": b"\0" * 64}),
        cbor2.dumps({"v": 1, "body": b"", "signer": b"\0" * 32, "sig": b"\0" * 64, "x": 0}),
        b"\xc1\x00",  # a CBOR datetime tag
    ],
)
def test_malformed_envelopes(data: bytes) -> None:
    with pytest.raises(MalformedEnvelope):
        open_envelope(data, "digest", now=T0)


def test_valid_signature_over_malformed_body_is_malformed() -> None:
    from p2pnode.identity import domain_tag

    for body in (b"\xff", plaincbor.encode(["digest", 1, {}]), plaincbor.encode(["digest"])):
        sig = ALICE.sign(domain_tag("digest") + body)
        outer = {"v": 1, "body": body, "signer": ALICE.public_key, "sig": sig}
        with pytest.raises(MalformedEnvelope):
            open_envelope(cbor2.dumps(outer), "digest", now=T0)


def test_seal_rejects_non_plain_payload() -> None:
    with pytest.raises(MalformedEnvelope, match="cannot be sealed"):
        seal(ALICE, "digest", {1, 2}, now=T0)
    with pytest.raises(MalformedEnvelope):
        seal(ALICE, "digest", {1: "int key"}, now=T0)


# -------------------------------------------------------------------------- records


def _record(key: NodeKey, **overrides: object) -> NodeRecord:
    record = new_node_record(
        key,
        addrs=["/ip4/127.0.0.1/tcp/4001"],
        models=["smollm2-135m"],
        roles=["router", "verifier"],
        capacity={"slots": 4, "tok_s": 120.5},
        version="0.1.0",
    )
    if overrides:
        fields = {**record.__dict__, **overrides}
        record = NodeRecord(**fields)
    return record


def test_node_record_round_trip() -> None:
    record = _record(ALICE)
    assert record.capacity == {"slots": 4.0, "tok_s": 120.5}
    assert record.roles == frozenset({"router", "verifier"})
    back = verify_node_record(sign_node_record(ALICE, record))
    assert back == record


def test_new_node_record_seq_is_monotone() -> None:
    seqs = [_record(ALICE).seq for _ in range(50)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 50


def test_record_book_newer_replaces_older_replay_rejected() -> None:
    book = RecordBook()
    old = verify_node_record(sign_node_record(ALICE, _record(ALICE)))
    new = verify_node_record(
        sign_node_record(ALICE, _record(ALICE, addrs=("/ip4/10.0.0.1/tcp/1",)))
    )
    assert new.seq > old.seq
    book.accept(old)
    assert book.accept(new) is new and book.get(ALICE.peer_id) == new
    with pytest.raises(StaleRecord, match="older"):
        book.accept(old)
    with pytest.raises(StaleRecord, match="replay"):
        book.accept(new)
    assert book.get(ALICE.peer_id) == new and len(book) == 1
    assert book.get(BOB.peer_id) is None
    book.accept(_record(BOB))
    assert len(book) == 2 and BOB.peer_id in book
    assert RecordBook.select_newest([old, new, old]) == 1
    with pytest.raises(IdentityError):
        RecordBook.select_newest([])


def test_record_signed_by_other_key_rejected() -> None:
    record = _record(ALICE)
    with pytest.raises(WrongSigner):
        sign_node_record(BOB, record)
    forged = seal(BOB, "node-record", record.to_payload(), now=record.timestamp)
    with pytest.raises(WrongSigner):
        verify_node_record(forged)


def test_record_expiry_and_kind() -> None:
    record = _record(ALICE, timestamp=T0)
    data = sign_node_record(ALICE, record)
    assert verify_node_record(data, now=T0 + 23 * 3600) == record
    with pytest.raises(ExpiredEnvelope):
        verify_node_record(data, now=T0 + 25 * 3600)
    with pytest.raises(BadSignature):  # a node record is not a digest
        open_envelope(data, "digest", now=T0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"roles": frozenset({"king"})},
        {"capacity": {"slots": float("nan")}},
        {"capacity": {"slots": True}},
        {"seq": -1},
        {"seq": 2**63},
        {"addrs": ("x" * 300,)},
        {"addrs": tuple(f"/a/{i}" for i in range(33))},
        {"version": ""},
        {"addrs": "/ip4/1.2.3.4"},
    ],
)
def test_invalid_record_fields(overrides: dict) -> None:
    with pytest.raises(InvalidRecord):
        _record(ALICE, **overrides)


def test_malformed_record_payload_rejected() -> None:
    payload = _record(ALICE).to_payload()
    for bad in (
        {**payload, "extra": 1},
        {k: v for k, v in payload.items() if k != "seq"},
        {**payload, "roles": "router"},
        {**payload, "capacity": [1]},
        {**payload, "seq": 1.5},
        [payload],
    ):
        with pytest.raises(InvalidRecord):
            verify_node_record(seal(ALICE, "node-record", bad))


def test_unusable_home_is_identity_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(IdentityError, match="cannot load or create"):
        NodeKey.load_or_create(tmp_path / "file")  # a file where the home directory should be
