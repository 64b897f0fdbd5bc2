"""Hole punching across NAT kinds, started as users start it (needs root: namespaces).

Four hosts, each a network namespace (testnet/netns/namespaces.py): a public bootstrap; ``nat1``
behind an endpoint-independent, port-preserving MASQUERADE router; ``cg`` behind two such NATs
(a carrier-grade NAT in front of its home router); ``natr`` behind a port-randomizing
MASQUERADE (``--random-fully``). Every router drops what comes in unasked, as home routers do.
Default flags plus the invite, no model. The two port-preserving hosts meet through a relay
and must be hole-punched (a direct connection, not relayed) within ``PUNCH_LIMIT_S`` of
meeting; the port-randomizing one stays relayed to both and its peers say why. Every
namespace and process is removed at the end, also on failure.
"""

from __future__ import annotations

import time

import pytest

from p2pnode.testnet.netns.namespaces import NAT_MODELS, Testbed, require_netns
from p2pnode.testnet.netns.swarm import NetnsSwarm

from testkit import wait_until_blocking

HOSTS = {"boot": "public", "nat1": "nat", "cg": "nat-cgnat", "natr": "nat-random"}
PUNCH_LIMIT_S = 30.0  # after the two first see each other up (the goal of the design)
MEET_LIMIT_S = 120.0  # formation on a loaded 2-core machine: generous
PUNCHED = ("nat1", "cg")


@pytest.fixture
def testbed():
    reason = require_netns()
    if reason is not None:
        pytest.skip(reason)
    with Testbed(HOSTS) as bed:
        yield bed


def _kinds(swarm: NetnsSwarm, host: str) -> dict[str, dict]:
    return {p["peer_id"]: p for p in swarm.peers(host) if p["state"] == "up"}


@pytest.mark.slow
def test_port_preserving_nats_punch_and_a_port_randomizing_one_stays_relayed(testbed, tmp_path):
    print({h: NAT_MODELS.get(k, k) for h, k in HOSTS.items()})  # what each host models
    swarm = NetnsSwarm(testbed, tmp_path)
    swarm.start_bootstrap("boot")
    for host in HOSTS:
        if host != "boot":
            swarm.start_join(host)
    logs = lambda: "\n".join(f"--- {h}\n{swarm.log(h, 2000)}" for h in HOSTS)  # noqa: E731
    wait_until_blocking(
        lambda: len(swarm.peer_ids()) == len(HOSTS), MEET_LIMIT_S, "every node up", detail=logs
    )
    ids = swarm.peer_ids()
    a, b = PUNCHED

    # When did the two port-preserving hosts meet (see each other up, relayed at first)?
    def met() -> bool:
        return ids[b] in _kinds(swarm, a) and ids[a] in _kinds(swarm, b)

    wait_until_blocking(met, MEET_LIMIT_S, f"{a} and {b} meet", step_s=0.5, detail=logs)
    meeting = time.monotonic()

    def punched() -> bool:
        return (
            _kinds(swarm, a).get(ids[b], {}).get("connection") == "hole-punched"
            and _kinds(swarm, b).get(ids[a], {}).get("connection") == "hole-punched"
        )

    wait_until_blocking(
        punched, PUNCH_LIMIT_S, f"{a} and {b} hole-punched", step_s=0.5, detail=logs
    )
    print(f"hole-punched {time.monotonic() - meeting:.1f} s after meeting (at most)")
    # the relayed connection is gone once idle; the direct one stays
    for host, other in ((a, b), (b, a)):
        table = swarm.cli(host, "peers")
        assert "hole-punched" in table and ids[other] in table, table

    # The port-randomizing host: relayed to both, and each side says why.
    def randomizing_pairs_failed() -> bool:
        for host in PUNCHED:
            entry = _kinds(swarm, host).get(ids["natr"], {})
            if entry.get("connection") != "relayed":
                return False
            if "no simultaneous open" not in (entry.get("relayed_because") or ""):
                return False
        return True

    wait_until_blocking(
        randomizing_pairs_failed,
        MEET_LIMIT_S,
        "natr relayed with the failed punch as the reason",
        step_s=1.0,
        detail=lambda: f"{[_kinds(swarm, h).get(ids['natr']) for h in PUNCHED]}\n{logs()}",
    )
    for host in PUNCHED:
        assert _kinds(swarm, host)[ids["natr"]]["connection"] == "relayed"
        table = swarm.cli(host, "peers")
        assert "relayed" in table and "port-randomizing" in table, table
    status = swarm.status("natr")["holepunch"]
    assert status["counters"].get("punched", 0) == 0, status
