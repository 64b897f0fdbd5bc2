"""Per-peer resource limits (overlay/limits.py): the limiter's arithmetic, then real libp2p nodes
on loopback: a peer flooding forward requests is refused with our clear error while another
peer is served, pulls and gossip over their budgets are refused, and a peer opening too many
speculation sessions gets ``PeerLimited``.

The forward server runs the emulated engine backend (fake tokens at pinned cost-model speeds,
real radix tree) so a request holds its stream for a known time; the verifier runs the real
default model. Limits are set tight (and named in each test) so a flood of a few dozen requests
shows them in seconds; the defaults are checked to be above what honest nodes do.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from p2pnode.identity import NodeKey
from p2pnode.inference.engine import open_engine
from p2pnode.overlay.cache.antientropy import AntiEntropy, AntiEntropyConfig, PullFailed
from p2pnode.overlay.cache.digest import Digest, DigestError, LoadInfo, open_digest, seal_digest
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.limits import (
    Budget,
    LimitExceeded,
    LimitsConfig,
    PeerLimiter,
)
from p2pnode.overlay.serve.forward import ForwardFailed, ForwardRequest, forward_request
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.speculation import BatchedVerifier, Block, PeerLimited, SamplingOptions
from p2pnode.speculation.protocol import P2PVerifierTransport, serve_verifier

from testkit import FakeClock

logging.getLogger("libp2p").setLevel(logging.ERROR)
# As in tests/system/test_routing_cluster.py: on 2 busy cores a 1 s ping timeout marks healthy peers suspect
# and libp2p's health monitor (2 s) drops healthy links, failing a test for no limits reason.
CALM = {"ping_timeout": 5.0, "health_ping_timeout": 10.0}


# --------------------------------------------------------------------------- the limiter


def test_token_bucket_refuses_past_the_burst_and_refills_at_the_rate() -> None:
    clock = FakeClock(0.0)
    lim = PeerLimiter(LimitsConfig(forward=Budget(rate_per_s=2, burst=3)), clock=clock)
    for _ in range(3):
        lim.charge("A", "forward")
    with pytest.raises(LimitExceeded) as info:
        lim.charge("A", "forward")
    assert info.value.kind == "rate" and info.value.scope == "forward"
    assert info.value.retry_after_s == pytest.approx(0.5)
    assert "retry after 0.50 s" in str(info.value)
    lim.charge("B", "forward")  # another peer has its own bucket
    clock.now = 0.5  # one token back at 2/s
    lim.charge("A", "forward")
    with pytest.raises(LimitExceeded):
        lim.charge("A", "forward")
    clock.now = 100.0  # refills to the burst, not beyond
    for _ in range(3):
        lim.charge("A", "forward")
    with pytest.raises(LimitExceeded):
        lim.charge("A", "forward")
    with pytest.raises(LimitExceeded, match="burst"):  # a single request over the burst
        lim.charge("C", "forward", cost=4)
    assert lim.refused == {"forward:rate": 4}


def test_concurrency_per_peer_and_in_total_is_released_on_exit() -> None:
    cfg = LimitsConfig(forward=Budget(100, 100, max_concurrent=2, max_concurrent_total=3))
    lim = PeerLimiter(cfg)
    with contextlib.ExitStack() as stack:
        stack.enter_context(lim.admit("A", "forward"))
        stack.enter_context(lim.admit("A", "forward"))
        with pytest.raises(LimitExceeded, match="2 open, at most 2") as info:
            stack.enter_context(lim.admit("A", "forward"))
        assert info.value.kind == "streams"
        stack.enter_context(lim.admit("B", "forward"))
        with pytest.raises(LimitExceeded, match="all peers hold 3"):  # many identities
            stack.enter_context(lim.admit("C", "forward"))
        assert lim.usage("A")["active"] == {"forward": 2}
    assert lim.usage("A")["active"] == {"forward": 0}
    with lim.admit("C", "forward"):
        pass
    with pytest.raises(ValueError, match="unknown limit scope"):
        lim.charge("A", "nonsense")


async def test_sessions_and_bytes_in_flight_are_capped_and_released() -> None:
    lim = PeerLimiter(LimitsConfig(max_sessions_per_peer=1, max_bytes_in_flight=10))
    with lim.session("A"):
        with pytest.raises(LimitExceeded, match="sessions"):
            lim.session("A").__enter__()
        with lim.session("B"):
            pass
    with lim.session("A"):
        pass
    send, recv = trio.testing.memory_stream_pair()
    await send.send_all(b"x" * 12)
    with lim.metered("A", recv) as metered:
        assert await metered.receive_some(6) == b"x" * 6
        assert lim.usage("A")["bytes"] == 6
        with pytest.raises(LimitExceeded) as info:
            await metered.receive_some(6)
        assert info.value.kind == "bytes"
        metered.release()  # the request was answered
        assert lim.usage("A")["bytes"] == 0
        await send.send_all(b"y" * 4)
        assert await metered.receive_some(4) == b"yyyy"
    assert lim.usage("A")["bytes"] == 0


def test_idle_peers_are_forgotten_past_the_cap_but_busy_ones_are_kept() -> None:
    lim = PeerLimiter(LimitsConfig(max_tracked_peers=3))
    with lim.session("busy"):
        for i in range(10):
            lim.charge(f"p{i}", "forward")
        assert len(lim) == 3 and lim.usage("busy")["sessions"] == 1


def test_defaults_sit_above_honest_traffic() -> None:
    cfg = LimitsConfig()
    # Anti-entropy publishes one digest per interval (>= 0.2 s in the tests) plus a burst of 2,
    # and a full one of at most 64 KiB every 10th round.
    assert cfg.digest_gossip.rate_per_s >= 5 and cfg.digest_gossip.burst >= 3
    assert cfg.digest_gossip_bytes.burst >= cfg.max_digest_bytes
    # Pulls: one per pull_min_interval_s (0.3 s in the tests) per (peer, model).
    assert cfg.digest_pull.rate_per_s >= 1 / 0.3
    assert cfg.max_digest_fingerprints >= 240 * 1024 // 2  # an honest 32-bit full digest


# --------------------------------------------------------------------------- real nodes


@contextlib.asynccontextmanager
async def _emulated_engine(loaded: Any) -> Any:
    async with open_engine(
        loaded, backend="emulated", calibrate_cost=False, torch_threads=1
    ) as engine:
        # Pinned emulated speeds: a 10-token request holds its stream ~0.2 s, long enough for a
        # flood to pile up on the concurrency limit, short enough to keep the test quick.
        cost = engine.cost
        cost.prefill_s_per_token, cost.decode_s_per_token = 0.0001, 0.02
        cost.overhead_s, cost.alpha = 0.001, 0.0
        yield engine


async def _serve(node: Any, engine: Any, limiter: PeerLimiter, nursery: trio.Nursery) -> Any:
    svc = RoutedService(
        node,
        node.config.key,
        engine,
        antientropy_config=AntiEntropyConfig(interval_s=0.2),
        registry=CollectorRegistry(),
        limiter=limiter,
    )
    await nursery.start(svc.run)
    return svc


async def _forward(node: Any, peer: str, model_id: str, prompt: list[int]) -> list[int] | str:
    request = ForwardRequest(model_id=model_id, prompt=prompt, max_tokens=10)
    try:
        out = await forward_request(
            node,
            peer,
            request,
            accept_timeout_s=20,  # generous: 2 shared cores
            first_token_timeout_s=20,
            idle_timeout_s=20,
        )
    except ForwardFailed as exc:
        return f"{exc.reason}: {exc}"
    return out.tokens


async def test_forward_flood_is_throttled_while_another_peer_is_served(
    loaded: Any, overlay_network: Any
) -> None:
    # Tight limits for a short test: 2 streams per peer, 5 requests/s with a burst of 5.
    limiter = PeerLimiter(
        LimitsConfig(
            forward=Budget(rate_per_s=5, burst=5, max_concurrent=2, max_concurrent_total=16),
            digest_pull=Budget(rate_per_s=0.5, burst=2, max_concurrent=1),
        )
    )
    async with (
        overlay_network(3, **CALM) as (server, flooder, honest),
        _emulated_engine(loaded) as engine,  # before the nursery: trio scopes must nest
        trio.open_nursery() as nursery,
    ):
        svc = await _serve(server, engine, limiter, nursery)
        model, prompt = svc.model_id, list(range(100, 140))
        flood: list[Any] = []
        good: list[Any] = []

        async def flood_one(i: int) -> None:
            flood.append(await _forward(flooder, server.peer_id, model, prompt + [i]))

        async def honest_requests() -> None:
            for i in range(3):
                await trio.sleep(0.1)
                good.append(await _forward(honest, server.peer_id, model, prompt + [500 + i]))

        started = trio.current_time()
        with trio.fail_after(45):
            async with trio.open_nursery() as burst:
                for i in range(30):
                    burst.start_soon(flood_one, i)
                burst.start_soon(honest_requests)
        elapsed = trio.current_time() - started

        limited = [r for r in flood if isinstance(r, str)]
        served = [r for r in flood if isinstance(r, list)]
        assert all(r.startswith("limited: ") and "over its" in r for r in limited), limited[:3]
        # The bucket's invariant: at most the burst (5) plus 5/s of refill got through, however
        # slowly a loaded machine opened the 30 streams (~1.5 s when quiet: >= 17 refused).
        assert 1 <= len(served) <= 5 + 5 * elapsed, (len(served), elapsed)
        assert len(limited) == 30 - len(served) and len(limited) >= 10
        assert all(len(r) == 10 for r in served)
        assert good and all(isinstance(r, list) and len(r) == 10 for r in good), good
        assert svc.server.refused.get("limited", 0) == len(limited)
        assert limiter.usage(flooder.peer_id) == {
            "active": {"forward": 0},
            "sessions": 0,
            "bytes": 0,
        }
        assert svc.engine.queue_depth == 0  # nothing refused ever reached the engine

        # Digest pulls past the budget (burst 2) are refused with a clear PullFailed.
        puller = AntiEntropy(flooder, flooder.config.key, PeerViews(), models=[model])
        outcomes = []
        for _ in range(4):
            try:
                await puller.pull(server.peer_id, model)
                outcomes.append("ok")
            except PullFailed as exc:
                outcomes.append(str(exc))
        assert outcomes[:2] == ["ok", "ok"], outcomes
        assert all("refused the pull: limited:" in o for o in outcomes[2:]), outcomes
        nursery.cancel_scope.cancel()


def _digest(key: NodeKey, version: int, added: range, base: int | None) -> bytes:
    d = Digest(
        peer_id=key.peer_id,
        model_id="m@0",
        epoch=1,
        version=version,
        base_version=base,
        fp_bits=32,
        added=frozenset(added),
        removed=frozenset(),
        cleared=False,
        load=LoadInfo(),
    )
    return seal_digest(key, d)


async def test_gossip_rate_digest_size_and_view_growth_are_bounded(overlay_network: Any) -> None:
    cfg = LimitsConfig(
        digest_gossip=Budget(rate_per_s=1, burst=3),
        max_digest_fingerprints=1000,
        max_view_fingerprints=1500,
    )
    key = NodeKey.generate()
    async with overlay_network(1, **CALM) as (node,):
        ae = AntiEntropy(
            node, node.config.key, PeerViews(), models=["m@0"], limiter=PeerLimiter(cfg)
        )

        def ingest(data: bytes) -> Any:
            return ae.ingest(data, model="m@0", source="gossip", expected_peer=key.peer_id)

        assert ingest(_digest(key, 1, range(0, 800), None)).value == "applied"
        assert ingest(_digest(key, 2, range(800, 1600), 1)) is None  # view would hold 1600
        assert ae.drops == {"oversized": 1}
        big = _digest(key, 3, range(5000, 6001), None)  # 1001 fingerprints in one set
        with pytest.raises(DigestError, match="1001 > 1000"):
            open_digest(big, max_fingerprints=1000)
        assert ingest(big) is None and ae.drops["oversized"] == 2
        # The burst of 3 is spent: a valid digest is now dropped before its signature is read.
        assert ingest(_digest(key, 4, range(0, 10), None)) is None
        assert ae.drops["rate_limited"] == 1
        assert ae.views.get(key.peer_id, "m@0").version == 1  # the view was never corrupted


async def test_too_many_speculation_sessions_are_refused_per_peer(
    loaded: Any, overlay_network: Any
) -> None:
    limiter = PeerLimiter(
        LimitsConfig(
            max_sessions_per_peer=2,
            verify_block=Budget(rate_per_s=0.5, burst=2),
            verify_lead=Budget(rate_per_s=0.5, burst=2),
        )
    )
    verifier = BatchedVerifier(loaded, max_sessions=8)
    opts = SamplingOptions()
    async with overlay_network(3, **CALM) as (server, edge, other), trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        serve_verifier(server, verifier, limiter=limiter)

        def transport(node: Any) -> P2PVerifierTransport:
            return P2PVerifierTransport(node, server.peer_id, loaded.model_id, result_timeout_s=30)

        with trio.fail_after(90):  # ~6 s when the machine is quiet
            first, second, third = transport(edge), transport(edge), transport(edge)
            await first.open([1, 2, 3], opts)
            await second.open([4, 5, 6], opts)
            with pytest.raises(PeerLimited, match="sessions limit"):
                await third.open([7, 8, 9], opts)
            assert len(verifier.sessions) == 2  # the refused open never prefilled anything
            elsewhere = transport(other)  # another peer is not affected
            await elsewhere.open([1, 2, 3], opts)
            await second.close()
            for _ in range(100):  # the handler releases the session once it sees the close
                if limiter.usage(edge.peer_id)["sessions"] < 2:
                    break
                await trio.sleep(0.05)
            again = transport(edge)
            await again.open([7, 8, 9], opts)

            # Blocks past the per-peer block budget (burst 2) end the session with PeerLimited.
            n = first.opened.committed_len
            await first.send_block(Block(0, n, 3, ()))
            r = await first.receive_result()
            await first.send_block(Block(1, r.committed_len, r.next_token, ()))
            r = await first.receive_result()
            await first.send_block(Block(2, r.committed_len, r.next_token, ()))
            with pytest.raises(PeerLimited, match="verify_block"):
                await first.receive_result()
            # Tokens the verifier decodes on its own count too: 2 leads, then PeerLimited.
            await elsewhere.close()
            leader = transport(other)
            assert await leader.open([1, 2, 3], opts, lead=8) == 8
            got = [await leader.receive_result() for _ in range(2)]
            assert [type(g).__name__ for g in got] == ["Lead", "Lead"]
            with pytest.raises(PeerLimited, match="verify_lead"):
                await leader.receive_result()
            for t in (first, leader, again):
                await t.close()
        nursery.cancel_scope.cancel()


async def test_ping_streams_and_echoes_are_limited_per_peer(overlay_network: Any) -> None:
    # A peer may hold 2 ping streams at once and get 100 echoes/s (burst 200): liveness uses one
    # stream and pings only after a silence. Three streams at once: at least one is reset (the
    # node's own liveness stream may hold a slot too). 400 pings written at once on a stream
    # that answered: the echoes stop near the burst and the stream is reset.
    from p2pnode.overlay._errors import PeerUnreachable
    from p2pnode.overlay.net.node import PING_LENGTH, PING_PROTOCOL

    async def echoes(stream: Any, n: int) -> int:
        got = b""
        with trio.move_on_after(10), contextlib.suppress(Exception):
            await stream.write(b"p" * PING_LENGTH * n)
            while len(got) < PING_LENGTH * n:
                chunk = await stream.read(PING_LENGTH * n - len(got))
                if not chunk:
                    break
                got += chunk
        return len(got) // PING_LENGTH

    async with overlay_network(2, **CALM) as (server, client):
        streams = []
        for _ in range(3):  # a refused stream may already fail to open (reset in negotiation)
            with contextlib.suppress(PeerUnreachable):
                streams.append(await client.open_stream(server.peer_id, PING_PROTOCOL))
        answered = [s for s in streams if await echoes(s, 1) == 1]
        assert 1 <= len(answered) <= 2
        flood = await echoes(answered[0], 400)
        assert 150 <= flood < 399, flood  # burst 200 minus the probe, plus ~100/s refill
        assert server.limiter.refused.get("ping:streams", 0) >= 1
        assert server.limiter.refused.get("ping_echo:rate", 0) >= 1
