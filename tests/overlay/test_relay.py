"""NAT traversal: a node in a network namespace with no inbound route joins the
overlay and is reached through a circuit relay v2 relay.

Topology (needs root and `ip netns`; skipped otherwise): the test's network namespace holds the
relay R (listening on the veth address H and on loopback) and a public node A (loopback only,
bootstrapped through R). The NAT'd node B is a real `p2pnode join` process inside namespace NS,
reaching H over a veth pair. Policy routing lets only traffic from H reach B's address: B can
dial out to R, but nothing can dial B (a direct dial fails with "no route to host"). B
(`p2pnode join --relay R`) reserves a slot on R and advertises its circuit address in its node
record; A, given only B's peer id, opens an overlay stream to it: the direct dial fails, the dial
falls back to the circuit, our ping protocol echoes over the relayed connection, and B (the
real model) serves an inference request forwarded over it. Namespace,
veth, rule and routes are removed after the test, also when it fails.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from p2pnode.identity import NodeKey
from p2pnode.overlay._errors import BadMultiaddr, OverlayError
from p2pnode.overlay.net.node import PING_LENGTH, PING_PROTOCOL, OverlayConfig, open_overlay_node
from p2pnode.overlay.net.relay import circuit_addr, is_circuit_addr, open_relay
from p2pnode.overlay.serve.forward import ForwardRequest, forward_request
from p2pnode.speculation.edge import target_generate

from testkit import wait_until

PROMPT = [1, 504, 3458, 282, 2821]
# Unique per test process, so parallel runs and leftovers of a killed run do not collide.
_TAG = os.getpid() % 200 + 20
NS = f"p2pr{os.getpid()}"
VETH_H, VETH_N = f"p2prh{os.getpid() % 10**9}"[:15], f"p2prn{os.getpid() % 10**9}"[:15]
HOST_IP, NS_IP = f"10.213.{_TAG}.1", f"10.213.{_TAG}.2"
TABLE = str(1000 + _TAG)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def _teardown_netns() -> None:
    """Remove everything the fixture may have made; each step tolerates 'not there'."""
    _ip("rule", "del", "from", HOST_IP, "lookup", TABLE, check=False)
    _ip("route", "flush", "table", TABLE, check=False)
    _ip("route", "del", "unreachable", f"{NS_IP}/32", check=False)
    _ip("link", "del", VETH_H, check=False)  # deletes its peer in the namespace too
    _ip("netns", "del", NS, check=False)


@pytest.fixture
def nat_namespace():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs the `ip` tool (iproute2) for network namespaces")
    _teardown_netns()
    try:
        try:
            _ip("netns", "add", NS)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"`ip netns add` is not permitted here: {exc.stderr.strip()}")
        steps = [
            ("link", "add", VETH_H, "type", "veth", "peer", "name", VETH_N),
            ("link", "set", VETH_N, "netns", NS),
            ("addr", "add", f"{HOST_IP}/32", "dev", VETH_H),
            ("link", "set", VETH_H, "up"),
            ("-n", NS, "addr", "add", f"{NS_IP}/32", "dev", VETH_N),
            ("-n", NS, "link", "set", VETH_N, "up"),
            ("-n", NS, "link", "set", "lo", "up"),
            ("-n", NS, "route", "add", f"{HOST_IP}/32", "dev", VETH_N),
            # outbound only: replies to B leave from H (the relay's address) via table TABLE;
            # anything else addressed to B hits an unreachable route at once
            ("rule", "add", "from", HOST_IP, "lookup", TABLE),
            ("route", "add", f"{NS_IP}/32", "dev", VETH_H, "table", TABLE),
            ("route", "add", "unreachable", f"{NS_IP}/32"),
        ]
        for step in steps:
            try:
                _ip(*step)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"cannot build the NAT namespace (ip {' '.join(step)}): {exc.stderr}")
        yield NS
    finally:
        _teardown_netns()


def _start_nat_node(tmp_path: Path, relay_addr: str) -> tuple[subprocess.Popen, Path]:
    home = tmp_path / "natnode"
    log = (tmp_path / "natnode.log").open("wb")
    cmd = [
        "ip", "netns", "exec", NS,
        sys.executable, "-m", "p2pnode.bootstrap.cli", "join",
        "--home", str(home),
        "--listen", f"/ip4/{NS_IP}/tcp/0",
        "--bootstrap", relay_addr,
        "--relay", relay_addr,
        "--model", "default",
        "--torch-threads", "1",
        "--api-port", "0",
        "--log-level", "info",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return proc, home


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-3000:] if log and log.exists() else ""


def _listen_port(home: Path) -> int:
    addrs = json.loads((home / "runtime.json").read_text())["addrs"]
    return int(next(a for a in addrs if NS_IP in a).split("/tcp/")[1].split("/")[0])


def _peer_id_of(home: Path) -> str:
    return json.loads((home / "runtime.json").read_text())["peer_id"]


@pytest.mark.slow
async def test_node_without_inbound_route_is_reached_through_relay(nat_namespace, tmp_path, loaded):
    relay_key, public_key = NodeKey.generate(), NodeKey.generate()
    relay_cfg = OverlayConfig(
        key=relay_key, listen_addrs=[f"/ip4/{HOST_IP}/tcp/0", "/ip4/127.0.0.1/tcp/0"]
    )
    proc = None
    log = tmp_path / "natnode.log"
    try:
        async with (
            open_overlay_node(relay_cfg) as relay_node,
            open_relay(relay_node, hop=True) as relay_service,
        ):
            relay_addr = next(a for a in relay_node.addrs if HOST_IP in a)
            local_relay_addr = next(a for a in relay_node.addrs if "/127.0.0.1/" in a)
            proc, home = _start_nat_node(tmp_path, relay_addr)
            # B starts: imports, the model (~2 s once converted), libp2p; slow on 2 busy cores
            await wait_until(
                lambda: (home / "runtime.json").exists(),
                90,
                "B writes its runtime.json",
                step_s=0.2,
                detail=lambda: _tail(log),
            )
            nat_id = _peer_id_of(home)
            async with (
                open_overlay_node(
                    OverlayConfig(key=public_key, bootstrap=[local_relay_addr])
                ) as public,
                open_relay(public),
            ):
                # 1. B's listen address has no inbound route: a direct TCP dial fails at once
                with pytest.raises(OSError) as refused:
                    socket.create_connection((NS_IP, _listen_port(home)), timeout=3).close()
                assert refused.value.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH), refused
                # 2. A knows only B's peer id (as from gossip): the overlay's open_stream looks
                #    B up, the direct dial fails, the dial falls back to B's circuit address
                #    (from B's signed node record) and the stream runs over the relay
                await wait_until(
                    lambda: bool(_reserved(relay_service, nat_id)),
                    30,
                    "B holds a slot on the relay",
                    step_s=0.2,
                    detail=lambda: _tail(log),
                )
                await _first_echo(public, nat_id, log)
                conns = public.host.get_network().get_connections(_id(nat_id))
                addrs = [str(a) for c in conns for a in c.get_transport_addresses()]
                assert any(is_circuit_addr(a) for a in addrs), addrs
                # 3. our ping protocol echoes over the relayed connection
                rtt = await _echo(public, nat_id)
                print(f"relayed ping RTT {1000 * rtt:.1f} ms; addrs {addrs}")
                # 4. B advertises its circuit address (what A dialed) in its node record
                record = await public.get_node_record(nat_id)
                assert record is not None
                assert circuit_addr(relay_addr, nat_id) in record.addrs, record.addrs
                # 5. A's liveness pings run over the relay too
                await wait_until(
                    lambda: _rtt(public, nat_id) is not None,
                    10,
                    "a ping RTT to B",
                    step_s=0.2,
                    detail=lambda: _tail(log),
                )
                # 6. inference over the relay: B serves a forwarded request with the real model,
                #    token for token the target's greedy output
                ref = target_generate(loaded, PROMPT, 4)
                request = ForwardRequest(model_id=record.models[0], prompt=PROMPT, max_tokens=4)
                out = await forward_request(
                    public,
                    nat_id,
                    request,
                    accept_timeout_s=30,
                    first_token_timeout_s=60,  # B's first request on 2 busy cores
                    idle_timeout_s=30,
                )
                assert out.tokens == ref, (out.tokens, ref, _tail(log))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


async def _first_echo(node, peer_id: str, log: Path) -> None:
    """The first relayed dial, up to 3 tries, 2 s apart: it failed once in a CI run (of ~10
    runs of this test here) with a hop-stream read error logged by py-libp2p's relay, cause not
    pinned down. Callers of a relayed peer retry or fall back too (router, edge failover)."""
    for attempt in range(3):
        try:
            await _echo(node, peer_id)
            return
        except OverlayError as exc:
            if attempt == 2:
                raise AssertionError(f"relayed dial failed 3 times: {exc}\n{_tail(log)}") from exc
            await trio.sleep(2)


async def _echo(node, peer_id: str) -> float:
    """One round trip of our ping protocol to ``peer_id``; returns its seconds."""
    stream = await node.open_stream(peer_id, PING_PROTOCOL, timeout=20)
    payload = os.urandom(PING_LENGTH)
    t0 = time.perf_counter()
    await stream.write(payload)
    echoed = b""
    with trio.fail_after(10):
        while len(echoed) < PING_LENGTH:
            chunk = await stream.read(PING_LENGTH - len(echoed))
            assert chunk, "stream closed before the echo"
            echoed += chunk
    await stream.close()
    assert echoed == payload
    return time.perf_counter() - t0


def test_circuit_addresses_and_bad_relay_addresses():
    relay = "/ip4/10.0.0.1/tcp/4101/p2p/12D3KooWLDSqyhV1aS8jicrHXtfHtVuynj42Y1Jpp7FHtpAN2mnH"
    addr = circuit_addr(relay, "12D3KooWNwoCW4Cq8q2RypPQpnyeKk1LkoZH67RhdeqUB3KMHNNF")
    assert is_circuit_addr(addr) and not is_circuit_addr(relay)
    assert addr.endswith("/p2p-circuit/p2p/12D3KooWNwoCW4Cq8q2RypPQpnyeKk1LkoZH67RhdeqUB3KMHNNF")


async def test_relayed_stream_on_loopback_without_root():
    """The same path without namespaces (runs everywhere): B reserves on R, A dials B's
    circuit address explicitly, an overlay stream runs over it; bad relay addresses fail."""
    keys = [NodeKey.generate() for _ in range(3)]
    async with (
        open_overlay_node(OverlayConfig(key=keys[0])) as r,
        open_relay(r, hop=True),
        open_overlay_node(OverlayConfig(key=keys[1], bootstrap=r.addrs)) as b,
        open_relay(b, relays=r.addrs) as b_relay,
        open_overlay_node(OverlayConfig(key=keys[2])) as a,
        open_relay(a) as a_relay,
    ):
        with trio.fail_after(20):
            await b_relay.wait_reserved()
        assert b_relay.circuit_addrs == [circuit_addr(r.addrs[0], b.peer_id)]
        assert any(is_circuit_addr(x) for x in b.addrs)  # advertised
        assert await a_relay.dial(b_relay.circuit_addrs[0]) == b.peer_id
        assert await _echo(a, b.peer_id) < 10
        with pytest.raises(BadMultiaddr):
            async with open_relay(a, relays=["/ip4/1.2.3.4/tcp/1"]):
                pass  # no /p2p/<id>: refused before anything runs
        with pytest.raises(OverlayError):
            await a_relay.dial(r.addrs[0])  # not a circuit


def _reserved(relay_service, peer_id: str) -> bool:
    return relay_service.protocol.resource_manager.has_reservation(_id(peer_id))


def _rtt(node, peer_id: str) -> float | None:
    entry = node.peers.get(peer_id)
    return entry.rtt_ms if entry is not None else None


def _id(peer_id: str):
    from libp2p.peer.id import ID

    return ID.from_base58(peer_id)
