"""Anti-entropy (overlay/cache/antientropy.py) on real overlay nodes on 127.0.0.1: views converge
through deltas and pulls despite lost gossip, and a cache change is published before the next
round."""

from __future__ import annotations

import logging
import random

import pytest
import trio

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import BlockRemoved, BlockStored
from p2pnode.overlay.cache.antientropy import (
    MAX_PULL_TIMEOUT_S,
    PULL_ROUND_TRIPS,
    AntiEntropy,
    AntiEntropyConfig,
    digest_topic,
)
from p2pnode.overlay.cache.digest import DigestBuilder, seal_digest
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node

from testkit import wait_until
from testkit.cluster import overlay_nodes
from testkit.routing import MODEL, hashes_of, load, prompt

logging.getLogger("libp2p").setLevel(logging.ERROR)


class Lossy:
    """Drops a fixed fraction of received gossip (seeded), to prove repair does not need it."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.fraction = fraction
        self.seen = 0
        self.dropped = 0

    def __call__(self, topic: str, data: bytes) -> bool:
        self.seen += 1
        drop = self.rng.random() < self.fraction
        self.dropped += drop
        return drop


async def test_digests_converge_over_gossip_despite_dropped_messages() -> None:
    # Every node drops 60 % of the gossip it receives and full states are never gossiped
    # (full_every is huge): views can only converge through deltas plus direct pulls on gaps.
    config = AntiEntropyConfig(interval_s=0.2, full_every=10**6, pull_min_interval_s=0.3)
    async with overlay_nodes(3) as (keys, nodes), trio.open_nursery() as nursery:
        builders, aes, lossy = [], [], []
        for i, (key, node) in enumerate(zip(keys, nodes, strict=True)):
            b = DigestBuilder(node.peer_id, MODEL, load_fn=lambda i=i: load(queue_depth=i))
            filt = Lossy(0.6, seed=i)
            ae = AntiEntropy(
                node, key, PeerViews(), builders={MODEL: b}, config=config, drop_filter=filt
            )
            await nursery.start(ae.run)
            builders.append(b)
            aes.append(ae)
            lossy.append(filt)
        rng = random.Random(5)
        for round_ in range(8):  # caches change while gossip runs
            for b in builders:
                stored = tuple(rng.getrandbits(64) for _ in range(20))
                b.on_event(BlockStored(stored, None))
                if round_ % 3 == 2:
                    b.on_event(BlockRemoved(stored[:5]))
            await trio.sleep(0.1)

        def converged() -> bool:
            for i, ae in enumerate(aes):
                for j, b in enumerate(builders):
                    if i == j:
                        continue
                    view = ae.views.get(nodes[j].peer_id, MODEL)
                    if (
                        view is None
                        or view.fingerprints != set(b.fingerprints)
                        or view.load.queue_depth != j
                    ):
                        return False
            return True

        await wait_until(converged, limit_s=15, what="every view equal to its peer's builder")
        assert sum(f.dropped for f in lossy) > 10  # the loss really happened
        assert sum(ae.pulls.get("ok", 0) for ae in aes) >= 1  # and was repaired by pulls
        assert all(ae.results.get("gap", 0) >= 1 for ae in aes)
        nursery.cancel_scope.cancel()


async def test_cache_change_is_published_before_the_next_round() -> None:
    # Rounds every 5 s, yet a change must reach the peer well before: it is published within
    # change_poll_s from the token bucket (burst 2: the first round leaves one token).
    config = AntiEntropyConfig(interval_s=5.0, change_poll_s=0.05)
    async with overlay_nodes(2) as (keys, nodes), trio.open_nursery() as nursery:
        builders = [DigestBuilder(n.peer_id, MODEL, load_fn=load) for n in nodes]
        aes = [
            AntiEntropy(n, k, PeerViews(), builders={MODEL: b}, config=config)
            for n, k, b in zip(nodes, keys, builders, strict=True)
        ]
        for ae in aes:
            await nursery.start(ae.run)
        a_id = nodes[0].peer_id
        await wait_until(lambda: aes[1].views.get(a_id, MODEL) is not None, 10, "a first view of a")
        assert not aes[0].has_news()
        hs = hashes_of(prompt(64, seed=41))
        builders[0].on_event(BlockStored(tuple(hs), None))
        assert builders[0].pending and aes[0].has_news()
        t0 = trio.current_time()
        # 2.5 s: half the round interval, ample for one gossip hop on a loaded machine.
        await wait_until(
            lambda: aes[1].views.cached_prefix_tokens(a_id, hs, MODEL) == 64,
            2.5,
            "the change published",
        )
        assert trio.current_time() - t0 < 2.5 and not aes[0].has_news()
        nursery.cancel_scope.cancel()


async def test_a_view_of_a_peer_without_a_link_is_not_pulled() -> None:
    """A pull opens a stream, and to a peer we hold no link to that is a dial: with bounded
    connections those dials grew every node's links past its high mark. Such a view waits
    for the publisher's next full digest; a linked peer is pulled as before."""
    async with overlay_nodes(2) as (keys, nodes), trio.open_nursery() as nursery:
        ae = AntiEntropy(nodes[0], keys[0], PeerViews(), models=[MODEL])
        await nursery.start(ae.run)
        stranger = NodeKey.generate().peer_id
        ae.request_pull(stranger, MODEL)
        assert ae.pulls == {"unconnected": 1}
        linked = nodes[1].peer_id
        await wait_until(lambda: nodes[0].peers.is_up(linked), 10, "the link to the peer up")
        ae.request_pull(linked, MODEL)
        # The linked peer serves no digest for MODEL: the pull is made and fails, not skipped.
        await wait_until(lambda: sum(ae.pulls.values()) >= 2, 10, "the pull to the linked peer")
        assert ae.pulls["unconnected"] == 1
        nursery.cancel_scope.cancel()


async def test_a_peer_that_comes_up_without_a_view_is_pulled_at_once() -> None:
    """A new link to a peer whose gossip has not reached us: waiting for its next round (with
    many publishers, many seconds) left views missing while links churned. Here gossip from
    the peer never arrives and its rounds are a minute apart: only the pull on up helps."""
    config = AntiEntropyConfig(interval_s=60.0)
    async with overlay_nodes(2, models=[MODEL]) as (keys, nodes), trio.open_nursery() as nursery:
        a, b = nodes
        # a's signed record names the model it serves: only those are pulled on up.
        await wait_until(lambda: b.peers.get(a.peer_id).record is not None, 10, "a's record")
        builder = DigestBuilder(a.peer_id, MODEL, load_fn=load)
        builder.on_event(BlockStored(tuple(hashes_of(prompt(64, seed=3))), None))
        publisher = AntiEntropy(a, keys[0], PeerViews(), builders={MODEL: builder}, config=config)
        await nursery.start(publisher.run)
        deaf = AntiEntropy(
            b, keys[1], PeerViews(), models=[MODEL], config=config, drop_filter=lambda *_: True
        )
        await nursery.start(deaf.run)
        assert deaf.views.get(a.peer_id, MODEL) is None
        b.peers.mark_down(a.peer_id, "test: the link went away")
        b.peers.observe(a.peer_id)  # and came back (a new link)
        await wait_until(
            lambda: deaf.views.get(a.peer_id, MODEL) is not None, 10, "a view of the peer"
        )
        assert deaf.pulls.get("on_up") == 1 and deaf.pulls.get("ok") == 1
        view = deaf.views.get(a.peer_id, MODEL)
        assert view is not None and view.fingerprints == set(builder.fingerprints)
        nursery.cancel_scope.cancel()


async def test_a_new_links_hello_carries_each_sides_view_and_no_pull_runs() -> None:
    """Both nodes serve the model and run anti-entropy before they meet: the hello of their
    first link swaps their full digests, so each holds the other's view with no gossip (rounds
    a minute apart, all gossip dropped) and no pull (their records name no model, so the pull
    on up has nothing to fetch: the hello is the only way in)."""
    config = AntiEntropyConfig(interval_s=60.0)
    deaf = lambda *_: True  # noqa: E731
    keys = [NodeKey.generate() for _ in range(2)]
    async with (
        open_overlay_node(OverlayConfig(key=keys[0])) as first,
        open_overlay_node(OverlayConfig(key=keys[1])) as second,
        trio.open_nursery() as nursery,
    ):
        nodes = [first, second]
        builders = [DigestBuilder(n.peer_id, MODEL, load_fn=load) for n in nodes]
        for seed, builder in enumerate(builders):
            builder.on_event(BlockStored(tuple(hashes_of(prompt(64, seed=seed))), None))
        aes = [
            AntiEntropy(n, k, PeerViews(), builders={MODEL: b}, config=config, drop_filter=deaf)
            for n, k, b in zip(nodes, keys, builders, strict=True)
        ]
        for ae in aes:
            await nursery.start(ae.run)
        a, b = nodes
        await b.connect(a.addrs[0])
        for ae, peer, builder in ((aes[0], b, builders[1]), (aes[1], a, builders[0])):
            await wait_until(
                lambda ae=ae, peer=peer: ae.views.get(peer.peer_id, MODEL) is not None,
                10,
                "the peer's view from the hello",
            )
            view = ae.views.get(peer.peer_id, MODEL)
            assert view is not None and view.fingerprints == set(builder.fingerprints)
            assert ae.hello == {"sent": 1, "applied": 1}
            assert ae.pulls == {}
        nursery.cancel_scope.cancel()


async def test_views_outlive_rounds_slower_than_the_configured_expiry() -> None:
    # A large swarm stretches each origin's round to publishers / topic budget seconds: here
    # 2 publishers at 0.5 msg/s make 4 s rounds against a 1 s horizon. Views must stay in
    # place between rounds instead of vanishing from the router for most of each round.
    config = AntiEntropyConfig(interval_s=0.5, topic_budget_msgs_per_s=0.5)
    async with overlay_nodes(2) as (keys, nodes), trio.open_nursery() as nursery:
        aes = []
        for n, k in zip(nodes, keys, strict=True):
            b = DigestBuilder(n.peer_id, MODEL, load_fn=load)
            ae = AntiEntropy(
                n, k, PeerViews(expire_after_s=1.0), builders={MODEL: b}, config=config
            )
            await nursery.start(ae.run)
            aes.append(ae)
        a_id = nodes[0].peer_id
        await wait_until(lambda: aes[1].views.get(a_id, MODEL) is not None, 15, "a first view of a")
        await wait_until(lambda: aes[1].effective_interval(MODEL) >= 4.0, 15, "4 s rounds")
        missing = 0
        for _ in range(40):  # 10 s: two to three of a's rounds
            missing += a_id not in aes[1].views.peers(MODEL)
            await trio.sleep(0.25)
        assert missing == 0, f"b lacked its view of a in {missing} of 40 samples"
        assert aes[1].views.expire_after_s >= 4.0 * 6
        st = aes[1].status()  # as GET /status shows it
        assert st["publishers_heard"] == {MODEL: 1} and st["interval_s"] == 4.0, st
        assert st["results"].get("applied", 0) >= 1 and st["rounds"] >= 1
        nursery.cancel_scope.cancel()


async def test_a_digest_too_old_to_apply_still_counts_its_publisher() -> None:
    # On a swarm too busy to deliver digests in time, dropping the late ones from the count of
    # publishers shortened every round and sent more digests into the congestion.
    async with overlay_nodes(1) as (keys, (node,)):
        ae = AntiEntropy(node, keys[0], PeerViews(), models=[MODEL])
        other = NodeKey.generate()
        late = seal_digest(other, DigestBuilder(other.peer_id, MODEL, load_fn=load).full(), now=1.0)
        assert ae.ingest(late, model=MODEL, source="gossip", expected_peer=other.peer_id) is None
        assert ae.drops == {"expired": 1}
        assert ae.status()["publishers_heard"] == {MODEL: 1}
        assert ae.views.get(other.peer_id, MODEL) is None  # nothing of it applied


async def test_a_digest_that_expired_on_the_way_is_dropped_by_pubsub_and_counts_its_publisher() -> (
    None
):
    """Gossiped too late: pubsub drops it before delivery and forwarding
    (overlay/net/patches/safepubsub.py); it still counts as dropped ``expired`` and its
    publisher as heard."""
    async with overlay_nodes(2) as (keys, (a, b)), trio.open_nursery() as nursery:
        ae = AntiEntropy(b, keys[1], PeerViews(), models=[MODEL])
        await nursery.start(ae.run)
        await a.pubsub.subscribe(digest_topic(MODEL))  # no expiry at a: an old release
        builder = DigestBuilder(a.peer_id, MODEL, load_fn=load)
        late = seal_digest(keys[0], builder.full(), now=1.0)
        with trio.fail_after(30):
            while not ae.drops.get("expired"):  # until the two meshed
                await a.pubsub.publish(digest_topic(MODEL), late)
                await trio.sleep(0.2)  # noqa: ASYNC110
        assert b.pubsub.counters["gossip_expired_in"] >= 1
        assert ae.status()["publishers_heard"] == {MODEL: 1}
        assert ae.views.get(a.peer_id, MODEL) is None
        nursery.cancel_scope.cancel()


async def test_a_pull_waits_as_many_round_trips_as_the_peer_takes() -> None:
    """The pull limit follows the peer's measured round trips (a loaded swarm's are seconds),
    never below the configured floor nor above the ceiling."""
    async with overlay_nodes(1) as (keys, (node,)):
        ae = AntiEntropy(node, keys[0], PeerViews(), models=[MODEL])
        peer = NodeKey.generate().peer_id
        assert ae.pull_timeout(peer) == ae.config.pull_timeout_s  # nothing measured
        node.peers.record_rtt(peer, 0.01)
        assert ae.pull_timeout(peer) == ae.config.pull_timeout_s
        node.peers.record_rtt(peer, 2.4)
        rto = node.peers.rto(peer, 0.0, 1e9)
        assert rto > 2.4
        assert ae.pull_timeout(peer) == pytest.approx(PULL_ROUND_TRIPS * rto)
        for _ in range(8):
            node.peers.record_rtt(peer, 100.0)
        assert ae.pull_timeout(peer) == pytest.approx(MAX_PULL_TIMEOUT_S)


async def test_an_unchanged_node_publishes_every_few_rounds_and_a_change_at_once() -> None:
    """Heartbeats of an idle swarm were most of an idle node's CPU: a node whose cache and
    load are as last published skips quiet_rounds rounds in a row, its peers keep its view
    without pulling it as silent, and new load figures go out at the next round."""
    config = AntiEntropyConfig(interval_s=0.2, quiet_rounds=3)
    current = {"load": load()}
    async with overlay_nodes(2) as (keys, nodes), trio.open_nursery() as nursery:
        a_builder = DigestBuilder(nodes[0].peer_id, MODEL, load_fn=lambda: current["load"])
        a = AntiEntropy(nodes[0], keys[0], PeerViews(), builders={MODEL: a_builder}, config=config)
        b = AntiEntropy(nodes[1], keys[1], PeerViews(), models=[MODEL], config=config)
        await nursery.start(a.run)
        await nursery.start(b.run)
        a_id = nodes[0].peer_id
        await wait_until(lambda: b.views.get(a_id, MODEL) is not None, 10, "a first view of a")
        await wait_until(lambda: a.quiet_skipped >= 12, 30, "a dozen quiet rounds")
        # After each round it published, an unchanged node skips exactly quiet_rounds.
        assert a.quiet_skipped <= 3 * a.round, (a.quiet_skipped, a.round)
        assert a.round <= 2 + a.quiet_skipped // 3, (a.quiet_skipped, a.round)
        assert b.views.get(a_id, MODEL) is not None and b.pulls.get("ok", 0) == 0, b.pulls
        skipped = a.quiet_skipped
        current["load"] = load(queue_depth=5)
        await wait_until(
            lambda: b.views.get(a_id, MODEL).load.queue_depth == 5, 10, "the new load at b"
        )
        assert a.quiet_skipped == skipped  # a changed figure is never held back
        nursery.cancel_scope.cancel()
