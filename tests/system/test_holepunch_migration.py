"""A stream open on the relayed connection while the hole punch migrates the pair completes
(needs root: namespaces).

Three hosts (testnet/netns/namespaces.py): a public relay, and ``x`` and ``y`` each behind its own
endpoint-independent, port-preserving MASQUERADE router (``nat``: every router drops what
comes in unasked). Each runs an overlay node in its own OS process (the relay relays; ``x``
and ``y`` hold a slot on it and run hole punching with their router's address as their public
IP, what dial-backs report). ``x`` reaches ``y`` through the circuit, opens an echo stream on
that relayed connection at once and echoes 1 KiB frames over it for ``ECHO_S``: the punch
happens meanwhile, every echo must come back intact on that one stream, and once the stream is
closed the relayed connection closes and the direct one stays. Every namespace and process
is removed at the end, also on failure.
"""

from __future__ import annotations

import json
import sys

import pytest

from p2pnode.testnet.netns.namespaces import NAT_MODELS, Testbed, require_netns

from testkit import wait_until_blocking

HOSTS = {"relay": "public", "x": "nat", "y": "nat"}
ECHO_S = 15.0
RESULT_LIMIT_S = 180.0

PEER = r"""
import json, sys, time, trio
from p2pnode.identity import NodeKey
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.net.relay import circuit_addr, open_relay
from p2pnode.overlay.net.holepunch import open_hole_punching
from p2pnode.overlay.wire import read_frame, write_frame

ECHO, LIMIT = "/p2pnode-test/echo/1", 1 << 16
role, seed, public_ip, relay_addr, other = sys.argv[1:6]
echo_s = float(sys.argv[6])

async def echo(stream):
    while (frame := await read_frame(stream, limit=LIMIT)) is not None:
        await write_frame(stream, frame, limit=LIMIT)

async def main():
    key = NodeKey.from_seed(bytes.fromhex(seed))
    listen = ["/ip4/0.0.0.0/tcp/4101"]
    if role == "relay":
        async with open_overlay_node(OverlayConfig(key=key, listen_addrs=listen)) as node:
            async with open_relay(node, hop=True):
                print("ready", node.addrs, flush=True)
                await trio.sleep_forever()
    config = OverlayConfig(key=key, listen_addrs=listen, bootstrap=[relay_addr],
                           discovery_interval=1e5, discovery_max_interval=1e5)
    async with open_overlay_node(config) as node, open_relay(node, relays=[relay_addr]) as relay:
        async with open_hole_punching(node, public_ips=lambda: [public_ip]):
            node.set_stream_handler(ECHO, echo)
            with trio.fail_after(60):
                await relay.wait_reserved()
            print("ready", flush=True)
            if role != "x":
                await trio.sleep_forever()
            with trio.fail_after(60):
                while True:
                    try:
                        await relay.dial(circuit_addr(relay_addr, other))
                        break
                    except Exception as exc:
                        print("retry", repr(exc), flush=True)
                        await trio.sleep(1)
            at_open = node.connection_kind(other)
            stream = await node.open_stream(other, ECHO, timeout=30)
            kinds, good, t0 = [], 0, time.monotonic()
            while time.monotonic() - t0 < echo_s:
                frame = f"{good:06d}".encode() * 170
                await write_frame(stream, frame, limit=LIMIT)
                good += (await read_frame(stream, limit=LIMIT)) == frame
                kinds.append(node.connection_kind(other))
                await trio.sleep(0.1)
            await stream.close()
            sent = len(kinds)
            network = node.host.get_network()
            from p2pnode.overlay.net.patches.dcutr import is_relayed_conn
            from libp2p.peer.id import ID
            with trio.move_on_after(60):
                while any(is_relayed_conn(c) for c in network.connections.get(ID.from_base58(other), [])):
                    await trio.sleep(0.5)
            left = [("relayed" if is_relayed_conn(c) else "direct")
                    for c in network.connections.get(ID.from_base58(other), [])]
            protocols = [[str(s.get_protocol()) for s in c.get_streams()]
                         for c in network.connections.get(ID.from_base58(other), [])]
            print("RESULT " + json.dumps({"at_open": at_open, "sent": sent, "good": good,
                  "kinds": sorted(set(kinds)), "final": node.connection_kind(other),
                  "left": left, "streams": protocols}), flush=True)
            await trio.sleep_forever()

trio.run(main)
"""


@pytest.fixture
def testbed():
    reason = require_netns()
    if reason is not None:
        pytest.skip(reason)
    with Testbed(HOSTS) as bed:
        yield bed


@pytest.mark.slow
def test_a_stream_on_the_relayed_connection_completes_across_the_punch(testbed, tmp_path):
    print({h: NAT_MODELS.get(k, k) for h, k in HOSTS.items()})  # what each host models
    from p2pnode.identity import NodeKey

    seeds = {h: bytes([i + 1]) * 32 for i, h in enumerate(HOSTS)}  # fixed: runs repeat
    ids = {h: NodeKey.from_seed(s).peer_id for h, s in seeds.items()}
    relay_addr = f"/ip4/{testbed.ip('relay')}/tcp/4101/p2p/{ids['relay']}"
    logs = {h: tmp_path / f"{h}.log" for h in HOSTS}

    def start(host: str, other: str) -> None:
        argv = [sys.executable, "-c", PEER, host, seeds[host].hex(), testbed.public_ip(host),
                relay_addr, ids[other], str(ECHO_S)]  # fmt: skip
        testbed.popen(host, argv, logs[host])

    def ready(host: str) -> bool:
        return logs[host].exists() and "ready" in logs[host].read_text()

    tails = lambda: "\n".join(f"--- {h}\n{logs[h].read_text()[-2500:]}" for h in HOSTS)  # noqa: E731
    start("relay", "x")
    wait_until_blocking(lambda: ready("relay"), 60, "relay up", step_s=0.5, detail=tails)
    start("y", "x")
    wait_until_blocking(lambda: ready("y"), 90, "y reserved", step_s=0.5, detail=tails)
    start("x", "y")

    def result() -> dict | None:
        for line in logs["x"].read_text().splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        return None

    wait_until_blocking(
        lambda: result() is not None, RESULT_LIMIT_S, "x's echo result", step_s=1, detail=tails
    )
    out = result()
    assert out is not None
    assert out["at_open"] == "relayed", out  # the stream was opened on the circuit
    assert out["good"] == out["sent"] > 0, out  # every echo on that stream came back intact
    # ... while the punch happened, and the direct connection was never called "direct"
    assert out["kinds"] == ["hole-punched", "relayed"], (out, tails())
    assert out["final"] == "hole-punched" and out["left"] == ["direct"], out
