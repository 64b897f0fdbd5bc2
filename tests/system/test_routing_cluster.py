"""Routing on a real 4-node loopback cluster (libp2p on 127.0.0.1) with the real default model.

Every test starts four overlay nodes, each with a real-model engine (the four engines share one
loaded model's weights: the engine never writes them) and a ``RoutedService``. The engines' cost
models are pinned to the same nominal speeds (1 torch thread) and frozen, so routing decisions
depend on caches, queues and RTT, not on the CPU noise of a shared machine; the answers are the
real model's. Link RTTs are emulated the same way (``EmulatedLinks``: a 2 ms LAN plus what a
test injects), since in one process a ping measures event-loop lag more than the network.
Waits are bounded (``trio.fail_after``) and generous for a loaded machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from p2pnode.bootstrap.api import DEFAULT_CHAT_MAX_TOKENS
from p2pnode.identity import NodeKey, plaincbor
from p2pnode.inference.blockhash import BLOCK_SIZE, block_hashes
from p2pnode.inference.engine import open_engine
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig, digest_topic
from p2pnode.overlay.cache.digest import Digest, fingerprint, seal_digest
from p2pnode.overlay.routing.router import LOCAL
from p2pnode.overlay.serve.forward import ForwardConfig
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import AuditConfig

from testkit import wait_until

logging.getLogger("libp2p").setLevel(logging.ERROR)
# No probation hold and no sampled audits: an audit may run on a third peer and leave the
# prompt in its cache, which would make where a later request goes a matter of chance.
# Audits are tested in tests/overlay/test_audit.py and test_third_peer_audit.py.
TRUSTED = AuditConfig(probation_answers=0, trusted_rate=0.0, max_gap=1_000_000)

# Nominal single-thread SmolLM2-135M speeds (measured here: ~6 ms/token prefill, ~0.11 s/token
# decode with 1 thread). Pinned (alpha 0 freezes the EWMA) and equal on every node.
LAN_RTT_S = 0.002
PREFILL_S = 1 / 200
DECODE_S = 1 / 10
OVERHEAD_S = 0.02
AE_CONFIG = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
# Forward timeouts scale with the pinned estimates; a loaded 2-core machine can run 10x slower
# than those, so the slack is large. Fallback on a dead peer does not wait for any timeout:
# the stream reset is seen at once.
FORWARD_CONFIG = ForwardConfig(accept_slack_s=20, first_token_slack_s=30, idle_min_s=20)

SYSTEM = (
    "You are the help desk of Miller & Sons, a small hardware store on Harbour Street. Answer "
    "in one short sentence, politely, and only about tools, paint, garden supplies, timber, "
    "deliveries and opening hours (weekdays 8 to 6, Saturday 9 to 1, closed on Sunday)."
)
QUESTIONS = (
    "List five fruits, one per line.",
    "Name three colours of paint you sell.",
    "When do you open on Saturday?",
    "Do you deliver garden soil?",
    "Which hammer is best for a beginner?",
)


# --------------------------------------------------------------------------- test harness


class Gate:
    """``drop_filter`` that discards every received gossip message while closed."""

    def __init__(self) -> None:
        self.closed = False
        self.dropped = 0

    def __call__(self, topic: str, data: bytes) -> bool:
        self.dropped += self.closed
        return self.closed


class EmulatedPeers:
    """The node's peer table, but each link's RTT is the emulated one (see ``EmulatedLinks``)."""

    def __init__(self, table: Any, extra_s: dict[str, float]) -> None:
        self._table = table
        self._extra_s = extra_s

    def get(self, peer_id: str) -> Any:
        entry = self._table.get(peer_id)
        if entry is None:
            return None
        rtt_ms = 1000 * (LAN_RTT_S + self._extra_s.get(peer_id, 0.0))
        return dataclasses.replace(entry, rtt_ms=rtt_ms)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)


class EmulatedLinks:
    """The overlay node as one service sees it, on emulated links: a 2 ms LAN plus an injected
    extra round trip per peer (``extra_s``).

    In one process on 2 busy cores a ping's RTT mostly measures event-loop lag (0.02-0.3 s seen
    here), not a network, so the router is given the emulated RTT, as the engines are given
    pinned speeds. Opening a stream to a peer with an extra delay really waits that long (the
    round trip of stream setup on such a link). Our own emulation, not ``testnet/netns/wan.py``.
    """

    def __init__(self, node: Any) -> None:
        self._node = node
        self.extra_s: dict[str, float] = {}
        self.peers = EmulatedPeers(node.peers, self.extra_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def open_stream(self, peer_id: str, protocol: str, **kw: Any) -> Any:
        await trio.sleep(self.extra_s.get(peer_id, 0.0))
        return await self._node.open_stream(peer_id, protocol, **kw)


@dataclasses.dataclass
class Cluster:
    nodes: list[Any]
    services: list[RoutedService]
    links: list[EmulatedLinks]
    gates: list[Gate]


@contextlib.asynccontextmanager
async def cluster(
    loaded: Any, overlay_network: Any, *, pushback_high: int = 8
) -> AsyncIterator[Cluster]:
    # Pings answer late when 4 nodes and 4 real-model engines share one loop on 2 busy cores:
    # a 1 s ping timeout marks healthy peers suspect, and libp2p's health monitor (2 s by
    # default) drops healthy links, which fails a routing test for no routing reason. A killed
    # peer is still seen at once: its connection drops.
    async with (
        overlay_network(4, ping_timeout=5.0, health_ping_timeout=10.0) as nodes,
        contextlib.AsyncExitStack() as stack,
    ):

        def meshed() -> bool:
            return all(
                len(n.peers.up_peers()) == 3
                and all(n.peers.get(p).rtt_ms is not None for p in n.peers.up_peers())
                for n in nodes
            )

        # Connections come from bootstrap + DHT discovery; RTTs from the 1 s ping loop.
        await wait_until(meshed, 30, "full mesh with measured RTTs")
        engines = []
        for _ in nodes:  # every engine before the services' nursery: scopes must nest
            engine = await stack.enter_async_context(
                open_engine(
                    loaded,
                    backend="hf",
                    calibrate_cost=False,
                    torch_threads=1,
                    cache_budget_tokens=4096,
                )
            )
            cost = engine.cost
            cost.prefill_s_per_token, cost.decode_s_per_token = PREFILL_S, DECODE_S
            cost.overhead_s, cost.alpha = OVERHEAD_S, 0.0
            engines.append(engine)
        async with trio.open_nursery() as nursery:
            c = Cluster(nodes, [], [], [])
            for node, engine in zip(nodes, engines, strict=True):
                link, gate = EmulatedLinks(node), Gate()
                svc = RoutedService(
                    link,
                    node.config.key,
                    engine,
                    antientropy_config=AE_CONFIG,
                    forward_config=FORWARD_CONFIG,
                    pushback_high=pushback_high,
                    registry=CollectorRegistry(),
                    # Peers start trusted: these tests stream tokens as they arrive, and a peer on
                    # probation has its answer held for audit (tested in tests/overlay/test_audit.py).
                    audit_config=TRUSTED,
                    drop_filter=gate,
                )
                await nursery.start(svc.run)
                c.services.append(svc)
                c.links.append(link)
                c.gates.append(gate)
            yield c
            nursery.cancel_scope.cancel()
        # Let digests already in flight land before the nodes stop: a node whose pubsub has
        # closed while its host still reads gossip raises "Nursery is closed to new arrivals"
        # from inside libp2p (a teardown-order issue of overlay/net/node.py, reported).
        await trio.sleep(1.0)


def chat(svc: RoutedService, question: str, system: str = SYSTEM) -> list[int]:
    return svc.engine.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def view_tokens(a: RoutedService, b: RoutedService, prompt: list[int]) -> int:
    """How many tokens of ``prompt`` A's view says B holds."""
    return a.views.cached_prefix_tokens(b.node.peer_id, block_hashes(prompt, a.salt), a.model_id)


async def wait_view(a: RoutedService, b: RoutedService, prompt: list[int], tokens: int) -> None:
    await wait_until(
        lambda: view_tokens(a, b, prompt) >= tokens, 15, f"A's view of B holding {tokens} tokens"
    )


def explain(res: Any) -> str:
    return json.dumps({"decision": res.decision.to_log(), "attempts": str(res.attempts)})


def common_blocks(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n // BLOCK_SIZE * BLOCK_SIZE


# --------------------------------------------------------------------------- tests


async def test_prefix_cached_on_b_is_served_by_b_with_the_local_answer(
    loaded: Any, overlay_network: Any
) -> None:
    async with cluster(loaded, overlay_network) as c:
        a, b, cc, d = c.services
        earlier, request = chat(b, QUESTIONS[0]), chat(a, QUESTIONS[1])
        shared = common_blocks(earlier, request)
        assert shared >= 48 and len(request) <= 90  # short prompts, >= 4 shared blocks
        await b.engine.generate(earlier, {"max_tokens": 2})  # B served a chat with this system
        await wait_view(a, b, request, shared)
        res = await a.generate(request, {"max_tokens": 8})
        assert res.served_by == b.node.peer_id and not res.served_locally, explain(res)
        assert res.decision.reason == "remote_faster" and [x.outcome for x in res.attempts] == [
            "ok"
        ]
        assert res.cached_tokens >= shared  # B's real cached prefix, reported back
        assert b.server.served == 1 and cc.server.received == d.server.received == 0
        local = await a.engine.generate(request, {"max_tokens": 8})
        assert local.cached_tokens == 0  # A computed it all itself: a true reference
        assert res.tokens == local.tokens and len(res.tokens) >= 2


async def test_chat_without_max_tokens_goes_to_the_peer_holding_its_system_prompt(
    loaded: Any, overlay_network: Any
) -> None:
    # No max_tokens: the default limit (1,024 tokens, ~100 s of decode at the pinned speed)
    # is paid wherever the request runs, so it must not drown the prefill a cached 300-token
    # system prompt saves.
    long_system = " ".join([SYSTEM] * 4)
    async with cluster(loaded, overlay_network) as c:
        a, b, _, _ = c.services
        earlier = chat(b, QUESTIONS[0], system=long_system)
        request = chat(a, QUESTIONS[1], system=long_system)
        shared = common_blocks(earlier, request)
        assert shared >= 256, shared  # the ~300-token system prompt, in whole shared blocks
        await b.engine.generate(earlier, {"max_tokens": 2})
        await wait_view(a, b, request, shared)
        # What the API passes for a chat call without max_tokens (its chat default).
        decision = a.decide(request, {"max_tokens": DEFAULT_CHAT_MAX_TOKENS})
        assert decision.chosen == b.node.peer_id and decision.reason == "remote_faster", json.dumps(
            decision.to_log()
        )
        assert decision.margin_s < 0.5  # 5 % of queue + prefill, not of the 100 s decode


async def test_large_injected_rtt_keeps_the_request_local(
    loaded: Any, overlay_network: Any
) -> None:
    async with cluster(loaded, overlay_network) as c:
        a, b = c.services[:2]
        earlier, request = chat(b, QUESTIONS[0]), chat(a, QUESTIONS[2])
        shared = common_blocks(earlier, request)
        await b.engine.generate(earlier, {"max_tokens": 1})
        await wait_view(a, b, request, shared)
        params = {"max_tokens": 6}
        assert a.decide(request, params).chosen == b.node.peer_id  # loopback RTT: forward
        # 0.6 s more round trip on A's link to B: B's cache saves shared * 5 ms ~ 0.3 s only.
        c.links[0].extra_s[b.node.peer_id] = 0.6
        res = await a.generate(request, params)
        assert res.served_locally and res.decision.reason == "remote_saving_below_margin"
        est = res.decision.estimate_for(b.node.peer_id)
        assert est is not None and est.rtt_s >= 0.6 and est.cached_tokens >= shared
        assert b.server.received == 0
        reference = await b.engine.generate(request, params)  # B's answer, from its cache
        assert reference.cached_tokens >= shared and res.tokens == reference.tokens


async def test_stale_view_still_gives_the_right_answer(loaded: Any, overlay_network: Any) -> None:
    async with cluster(loaded, overlay_network) as c:
        a, b = c.services[:2]
        earlier, request = chat(b, QUESTIONS[0]), chat(a, QUESTIONS[3])
        shared = common_blocks(earlier, request)
        await b.engine.generate(earlier, {"max_tokens": 1})
        await wait_view(a, b, request, shared)
        c.gates[0].closed = True  # A hears no more digests: its view of B goes stale
        b.engine.tree.clear()  # B evicts everything
        assert view_tokens(a, b, request) >= shared and b.engine.cached_prefix_len(request) == 0
        res = await a.generate(request, {"max_tokens": 6})
        assert res.served_by == b.node.peer_id, explain(res)  # routed on the stale view...
        assert res.decision.estimate_for(b.node.peer_id).cached_tokens >= shared
        assert res.cached_tokens == 0  # ...B recomputed and says so
        assert a.router.confidence(b.node.peer_id) < 1.0  # A trusts B's digests less now
        reference = await c.services[2].engine.generate(request, {"max_tokens": 6})
        assert res.tokens == reference.tokens


async def die(service: RoutedService) -> None:
    """``service``'s node goes away as a killed process does: every connection closed.

    ``host.close()`` alone is not that here: with the libp2p build installed in this session its
    swarm forgot its connections but left them open at the transport, so the peer kept echoing
    pings and stayed "up" for its neighbours (a killed process's sockets always close; the
    real-process kill is tested in tests/system/test_cli_processes.py).
    """
    network = service.node.host.get_network()
    for peer in list(network.connections):
        await network.close_peer(peer)
    await service.node.host.close()


async def test_peer_killed_mid_stream_completes_through_fallback(
    loaded: Any, overlay_network: Any
) -> None:
    async with cluster(loaded, overlay_network) as c:
        a, b, cc, _ = c.services
        request = chat(a, QUESTIONS[0])
        assert len(request) >= 66
        # B holds 4 blocks of the prompt, C 3: B is the first choice, C the next best.
        await b.engine.generate(request[:64], {"max_tokens": 1})
        await cc.engine.generate(request[:48], {"max_tokens": 1})
        await wait_view(a, b, request, 64)
        await wait_view(a, cc, request, 48)
        params = {"max_tokens": 10}
        assert a.decide(request, params).attempts == (b.node.peer_id, cc.node.peer_id, LOCAL)
        received: list[int] = []
        async with trio.open_nursery() as killer:

            def on_token(t: int) -> None:
                received.append(t)
                if len(received) == 3:  # B dies with the stream open
                    killer.start_soon(die, b)

            res = await a.generate(request, params, on_token=on_token)
        assert [x.target for x in res.attempts] == [b.node.peer_id, cc.node.peer_id]
        assert res.attempts[0].outcome != "ok" and 3 <= res.attempts[0].tokens < 10
        assert res.attempts[1].outcome == "ok" and res.served_by == cc.node.peer_id
        reference = await a.engine.generate(request, params)
        assert res.tokens == received == reference.tokens  # complete, nothing repeated or lost

        # A's peer table sees B down: the router skips it from now on.
        def b_skipped() -> bool:
            d = a.decide(request, params)
            est = d.estimate_for(b.node.peer_id)
            return est is not None and est.skipped == "down" and b.node.peer_id not in d.attempts

        await wait_until(b_skipped, 15, "B skipped as down")


async def test_peer_in_push_back_receives_nothing_new(loaded: Any, overlay_network: Any) -> None:
    # Push-back at one request in the queue, so one long request makes B push back.
    async with cluster(loaded, overlay_network, pushback_high=1) as c:
        a, b, cc, d = c.services
        earlier = chat(b, QUESTIONS[0])
        requests = [chat(a, q) for q in QUESTIONS[1:4]]
        shared = common_blocks(earlier, requests[0])
        await b.engine.generate(earlier, {"max_tokens": 1})
        for origin in (a, cc, d):
            await wait_view(origin, b, requests[0], shared)
        busy = b.engine.stream(chat(b, "Tell a long story about a shed."), {"max_tokens": 400})

        def b_load(viewer: RoutedService) -> bool | None:
            view = viewer.views.get(b.node.peer_id, viewer.model_id)
            return None if view is None else view.load.push_back

        await wait_until(
            lambda: all(b_load(x) is True for x in (a, cc, d)), 20, "B's push-back seen"
        )
        before = b.server.received
        # Three origins that hold nothing of the prompt, so B's cache would be worth a forward.
        for k, (origin, request) in enumerate(zip([a, cc, d], requests, strict=True)):
            res = await origin.generate(request, {"max_tokens": 3})
            est = res.decision.estimate_for(b.node.peer_id)
            assert est is not None and est.skipped == "push_back", explain(res)
            if k == 0:
                # Without push-back B would have won: its estimate beats local by the margin.
                # (The prefix then gets a second home, so later origins may find it there.)
                assert est.total_s + res.decision.margin_s < res.decision.local_total_s
            assert res.served_by != b.node.peer_id
        assert b.server.received == before  # not one request stream reached B
        await busy.aclose()
        await wait_until(lambda: b_load(d) is False, 20, "B's push-back cleared")
        est = d.decide(chat(d, QUESTIONS[4]), {"max_tokens": 2}).estimate_for(b.node.peer_id)
        assert est is not None and est.skipped is None  # B is a candidate again


async def test_forged_digests_are_ignored(loaded: Any, overlay_network: Any) -> None:
    async with cluster(loaded, overlay_network) as c:
        a, b, _, d = c.services
        genuine = chat(b, QUESTIONS[0])
        await b.engine.generate(genuine, {"max_tokens": 1})
        await wait_view(a, b, genuine, common_blocks(genuine, genuine))
        b_version = a.views.version_of(b.node.peer_id, a.model_id)
        forged_prompt = chat(a, QUESTIONS[4], system="Forged system prompt. " * 6)
        forged_fps = frozenset(fingerprint(h) for h in block_hashes(forged_prompt, a.salt))
        outsider = NodeKey.generate()
        assert b.builder is not None
        real = b.builder.full()
        claim = dataclasses.replace(
            real, epoch=real.epoch + 1, version=1, added=real.added | forged_fps
        )
        genuine_b = seal_digest(b.node.config.key, real)
        by_outsider = seal_digest(outsider, claim)
        env = plaincbor.decode(by_outsider)
        posing_as_b = plaincbor.encode({**env, "signer": b.node.config.key.public_key})
        b_env = plaincbor.decode(genuine_b)
        kind, stamp, payload = plaincbor.decode(b_env["body"])
        edited = {**payload, "a": packed_set(claim)}
        tampered = plaincbor.encode({**b_env, "body": plaincbor.encode([kind, stamp, edited])})
        forgeries = {
            "bad_signature": [posing_as_b, tampered],  # B's key claimed, or B's body edited
            "wrong_signer": [by_outsider, genuine_b],  # not signed by the publisher (D)
            # Garbage: not an envelope. (Oversized digests are refused before decoding, see
            # tests/overlay/test_digest.py; gossipsub cannot even carry 240 KiB, it breaks the
            # stream.)
            "malformed": [b"\xff\x00 not a digest", plaincbor.encode({"v": 1})],
        }
        topic = digest_topic(a.model_id)
        for reason, batch in forgeries.items():
            for data in batch:
                await publish_until_dropped(d, a, topic, data, reason)
        assert view_tokens(a, b, forged_prompt) == 0
        assert a.views.version_of(b.node.peer_id, a.model_id)[0] == b_version[0]  # same epoch
        assert a.views.get(outsider.peer_id, a.model_id) is None
        decision = a.decide(forged_prompt, {"max_tokens": 4})
        # Nobody holds it: a miss, placed at its rendezvous home, not drawn to the forger.
        assert decision.reason == "placement_home", json.dumps(decision.to_log())
        assert all(x.cached_tokens == 0 for x in decision.candidates)


async def publish_until_dropped(
    publisher: RoutedService, receiver: RoutedService, topic: str, data: bytes, reason: str
) -> None:
    """Publish ``data`` until ``receiver`` counts one more drop for ``reason``.

    Gossipsub delivers at most once, not exactly once: under load a copy can be lost on the
    way (a reset stream, a full send queue), so a lost copy is published again (a new
    sequence number, so not a duplicate). Each forgery is sent alone, so the drop it causes
    is its own and under its own reason."""
    drops = receiver.antientropy.drops
    before = drops.get(reason, 0)
    for _attempt in range(4):
        await publisher.node.pubsub.publish(topic, data)
        with contextlib.suppress(AssertionError):
            await wait_until(lambda: drops.get(reason, 0) > before, 8, f"{reason} dropped")
            return
    raise AssertionError(f"{reason} forgery never dropped in 4 publications, drops={drops}")


def packed_set(digest: Digest) -> list[Any]:
    """The packed fingerprint set of ``digest.added``, as in a digest payload."""
    from p2pnode.overlay.cache.digest import encode_fingerprints

    return list(encode_fingerprints(digest.added, digest.fp_bits))
