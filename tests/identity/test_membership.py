"""Membership credentials, invite grants and revocations (identity/membership.py) and the
files a member keeps (identity/memberhome.py)."""

from __future__ import annotations

import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.errors import P2PNodeError
from p2pnode.identity import NodeKey, plaincbor
from p2pnode.identity.memberhome import GrantLedger, MemberHome
from p2pnode.identity.membership import (
    MAX_CREDENTIAL_SIZE,
    BadCredentialSignature,
    CredentialExpired,
    Issuer,
    MalformedCredential,
    MembershipError,
    RevokedCredential,
    WrongMember,
    WrongNetwork,
    issue_grant,
    issue_membership,
    issue_revocation,
    load_network_key,
    load_or_create_network_key,
    parse_grant,
    parse_membership,
    parse_revocation,
    verify_grant,
    verify_membership,
    verify_revocation,
)

NOW = 1_800_000_000.0
NET = NodeKey.from_seed(b"n" * 32)
ALICE = NodeKey.from_seed(b"a" * 32)
BOB = NodeKey.from_seed(b"b" * 32)


def test_network_key_file_is_private_and_stable(tmp_path):
    assert load_network_key(tmp_path) is None
    key = load_or_create_network_key(tmp_path)
    assert stat.S_IMODE((tmp_path / "network_key").stat().st_mode) == 0o600
    assert load_or_create_network_key(tmp_path).public_key == key.public_key


def test_membership_signed_by_the_network_verifies():
    cred = issue_membership(Issuer(NET), ALICE.peer_id, now=NOW)
    got = verify_membership(cred.raw, NET.public_key, ALICE.peer_id, NOW + 1)
    assert got.member == ALICE.peer_id and not got.admin


def test_membership_refusals_name_the_reason():
    cred = issue_membership(Issuer(NET), ALICE.peer_id, ttl=60, now=NOW)
    with pytest.raises(CredentialExpired, match="expired"):
        verify_membership(cred.raw, NET.public_key, ALICE.peer_id, NOW + 61)
    with pytest.raises(WrongNetwork):
        verify_membership(cred.raw, BOB.public_key, ALICE.peer_id, NOW)
    with pytest.raises(WrongMember):
        verify_membership(cred.raw, NET.public_key, BOB.peer_id, NOW)
    with pytest.raises(RevokedCredential):
        verify_membership(cred.raw, NET.public_key, ALICE.peer_id, NOW, {ALICE.peer_id})
    # Signed by a key that is neither the network's nor an admin's.
    forged = issue_membership(Issuer(BOB), ALICE.peer_id, now=NOW)
    with pytest.raises(WrongNetwork):
        verify_membership(forged.raw, NET.public_key, ALICE.peer_id, NOW)
    assert all(issubclass(c, P2PNodeError) for c in (MembershipError, MalformedCredential))


def test_tampering_breaks_the_signature():
    cred = issue_membership(Issuer(NET), ALICE.peer_id, now=NOW)
    body, sig = plaincbor.decode(cred.raw)
    fields = plaincbor.decode(body)
    fields["admin"] = True
    tampered = plaincbor.encode([plaincbor.encode(fields), sig])
    with pytest.raises(BadCredentialSignature):
        verify_membership(tampered, NET.public_key, ALICE.peer_id, NOW)
    with pytest.raises(BadCredentialSignature):
        verify_membership(plaincbor.encode([body, bytes(64)]), NET.public_key, ALICE.peer_id, NOW)


def test_a_grant_never_verifies_as_a_membership():
    grant = issue_grant(Issuer(NET), ALICE.peer_id, now=NOW)
    with pytest.raises(MalformedCredential):
        parse_membership(grant.raw)


@pytest.mark.parametrize(
    "raw",
    [b"", b"\xff" * 10, b"x" * (MAX_CREDENTIAL_SIZE + 1), plaincbor.encode([1, 2]), "text"],
)
def test_malformed_input_is_a_clear_error(raw):
    with pytest.raises(MalformedCredential):
        verify_membership(raw, NET.public_key, ALICE.peer_id, NOW)


def test_admin_chain_of_depth_one():
    admin = issue_membership(Issuer(NET), ALICE.peer_id, admin=True, now=NOW)
    by_admin = issue_membership(Issuer(ALICE, admin), BOB.peer_id, now=NOW)
    assert verify_membership(by_admin.raw, NET.public_key, BOB.peer_id, NOW).parent == admin
    assert by_admin.expires <= admin.expires
    # A revoked admin's members are refused with it.
    with pytest.raises(RevokedCredential, match="admin"):
        verify_membership(by_admin.raw, NET.public_key, BOB.peer_id, NOW, {ALICE.peer_id})
    # A plain member cannot issue, and an admin of an admin is not accepted.
    plain = issue_membership(Issuer(NET), BOB.peer_id, now=NOW)
    with pytest.raises(MembershipError):
        Issuer(BOB, plain)
    carol = NodeKey.from_seed(b"c" * 32)
    sub_admin = issue_membership(Issuer(ALICE, admin), carol.peer_id, admin=True, now=NOW)
    with pytest.raises(MalformedCredential):
        issue_membership(Issuer(carol, sub_admin), BOB.peer_id, now=NOW)


def test_grant_and_revocation_verify():
    grant = issue_grant(Issuer(NET), ALICE.peer_id, max_uses=2, ttl=60, now=NOW)
    assert verify_grant(grant.raw, NET.public_key, NOW).max_uses == 2
    with pytest.raises(CredentialExpired, match="invite has expired"):
        verify_grant(grant.raw, NET.public_key, NOW + 61)
    admin = issue_membership(Issuer(NET), ALICE.peer_id, admin=True, now=NOW)
    by_admin = issue_grant(Issuer(ALICE, admin), ALICE.peer_id, now=NOW)
    assert verify_grant(by_admin.raw, NET.public_key, NOW).issuer == ALICE.peer_id
    rev = issue_revocation(Issuer(ALICE, admin), BOB.peer_id, now=NOW)
    assert verify_revocation(rev.raw, NET.public_key, NOW).peer == BOB.peer_id
    with pytest.raises(WrongNetwork):  # a stranger's key is not the network's
        verify_revocation(
            issue_revocation(Issuer(BOB), ALICE.peer_id, now=NOW).raw, NET.public_key, NOW
        )


def test_uses_are_counted_per_peer_and_persisted(tmp_path):
    ledger = GrantLedger(tmp_path)
    nonce = b"\x01" * 16
    assert ledger.redeem(nonce, "peer-a", 2)
    assert ledger.redeem(nonce, "peer-a", 2)  # the same joiner again is not a new use
    assert ledger.redeem(nonce, "peer-b", 2)
    assert not ledger.redeem(nonce, "peer-c", 2)
    assert not GrantLedger(tmp_path).redeem(nonce, "peer-c", 2)  # survives a restart
    assert GrantLedger(tmp_path).redeem(b"\x02" * 16, "peer-c", None)


def test_member_home_keeps_membership_revocations_and_inbox(tmp_path):
    home = MemberHome(tmp_path)
    assert home.membership is None and home.revocations() == []
    home.save_membership(b"cred")
    home.save_revocations([b"r1", b"r2"])
    assert MemberHome(tmp_path).membership == b"cred"
    assert MemberHome(tmp_path).revocations() == [b"r1", b"r2"]
    home.post_revocation(b"posted")
    assert home.take_posted() == [b"posted"] and home.take_posted() == []


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_are_a_clear_error_never_a_crash(data):
    for parse in (parse_membership, parse_grant, parse_revocation):
        with pytest.raises(MembershipError):
            parse(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=400), st.integers(min_value=0, max_value=255))
def test_one_flipped_byte_never_verifies(position, value):
    cred = issue_membership(Issuer(NET), ALICE.peer_id, now=NOW)
    raw = bytearray(cred.raw)
    i = position % len(raw)
    if raw[i] == value:
        return
    raw[i] = value
    with pytest.raises(MembershipError):
        verify_membership(bytes(raw), NET.public_key, ALICE.peer_id, NOW)
