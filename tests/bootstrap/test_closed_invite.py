"""Closed-network invites (bootstrap/invite.py), ``--bootstrap INVITE`` in the settings and the
CLI's invite lifetimes."""

from __future__ import annotations

import time

import click
import pytest

from p2pnode.bootstrap import cli
from p2pnode.bootstrap.config import BadInvite, ConfigError, settings_from
from p2pnode.bootstrap.invite import InviteError, make_invite, parse_invite
from p2pnode.identity import NodeKey
from p2pnode.identity.membership import Issuer, issue_grant
from p2pnode.overlay.net.node import VERSION

NET = NodeKey.from_seed(b"N" * 32)
BOOT = NodeKey.from_seed(b"B" * 32)
ADDR = f"/ip4/127.0.0.1/tcp/4101/p2p/{BOOT.peer_id}"


def closed_invite(ttl: float = 3600.0, now: float | None = None) -> str:
    now = time.time() if now is None else now
    grant = issue_grant(Issuer(NET), BOOT.peer_id, max_uses=3, ttl=ttl, now=now)
    return make_invite("main", VERSION, [ADDR], network_key=NET.public_key, grant=grant.raw)


def test_a_closed_invite_carries_the_grant_and_the_network_key():
    invite = parse_invite(closed_invite())
    assert invite.closed and invite.network_key == NET.public_key
    assert invite.bootstrap == (ADDR,)
    assert not parse_invite(make_invite("main", VERSION, [ADDR])).closed  # open: no secret


def test_an_expired_or_forged_invite_is_refused_at_once():
    with pytest.raises(InviteError, match="expired"):
        parse_invite(closed_invite(ttl=1.0, now=time.time() - 10))
    other = NodeKey.from_seed(b"O" * 32)
    grant = issue_grant(Issuer(other), BOOT.peer_id, now=time.time())
    forged = make_invite("main", VERSION, [ADDR], network_key=NET.public_key, grant=grant.raw)
    with pytest.raises(InviteError):
        parse_invite(forged)


def test_bootstrap_takes_an_invite_or_a_multiaddr(tmp_path):
    text = closed_invite()
    settings = settings_from({"bootstrap": [text], "home": str(tmp_path)})
    assert settings.invite == text and settings.bootstrap == [ADDR]
    with pytest.raises(ConfigError, match="one invite"):
        settings_from({"bootstrap": [text, closed_invite()], "home": str(tmp_path)})
    with pytest.raises(BadInvite, match="expired"):
        settings_from({"invite": closed_invite(ttl=1.0, now=time.time() - 10)})


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800)]
)
def test_invite_lifetimes(text, seconds):
    assert cli._duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "-1h", "soon", "400d"])
def test_bad_invite_lifetimes(text):
    with pytest.raises(click.BadParameter):
        cli._duration(text)
