"""The edge client over libp2p (speculation/client.py): verifier choice, greedy output and released
sessions, discovery, failover and NoVerifier, spare streams, auto mode.

Real parts only: the default SmolLM2 target (fp32) and its W4A16 draft, real loopback libp2p nodes.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import block_hashes, model_salt
from p2pnode.overlay.cache.antientropy import AntiEntropy, AntiEntropyConfig
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.routing.router import rtt_from_peer_table
from p2pnode.speculation import (
    BadRequest,
    BatchedVerifier,
    EdgeClient,
    Lead,
    NoVerifier,
    P2PVerifierTransport,
    SamplingOptions,
    VerifierAdvert,
    WrongModel,
    open_edge,
    rank_verifiers,
    remote_generate,
    serve_verifier,
    speculative_generate,
    target_generate,
    verify_digest_model,
)
from p2pnode.speculation.testing import inprocess_transport


@asynccontextmanager
async def _verifier_and_edge_nodes(target, overlay_network):
    """A batched verifier served on one loopback overlay node, and a second node to be the edge."""
    verifier = BatchedVerifier(target)
    async with overlay_network(2) as (server, edge), trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        serve_verifier(server, verifier)
        yield verifier, server, edge
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _edge_client(target, draft, overlay_network):
    """An ``EdgeClient`` pinned to one served verifier (see ``_verifier_and_edge_nodes``)."""
    async with _verifier_and_edge_nodes(target, overlay_network) as (_, server, node):
        client = EdgeClient(node, draft, verifiers=[server.peer_id])
        try:
            yield client
        finally:
            await client.aclose()


async def test_edge_picks_the_verifier_holding_the_prefix_over_a_nearer_one(
    target, draft, prompts, overlay_network
) -> None:
    # Two verifiers gossip their digests; V1 has served this prompt twice (so its blocks are
    # advertised), V2 nothing. The edge, following the digests, ranks V1 first even when V2 is
    # a little nearer: V2 would prefill the whole prompt, V1 only the last token.
    eos = target.eos_token_ids
    prompt = prompts[0] * 4  # ~100 tokens: several blocks
    key = verify_digest_model(target.model_id)
    ae_config = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
    async with overlay_network(3) as (n1, n2, edge), trio.open_nursery() as nursery:
        verifiers, edge_views = [], PeerViews()
        for node in (n1, n2):
            v = BatchedVerifier(target, max_wait_ms=5)
            advert = VerifierAdvert(node.peer_id, v, min_uses=2)
            await nursery.start(v.run)
            serve_verifier(node, v)
            ae = AntiEntropy(
                node, node.config.key, PeerViews(), builders={key: advert.builder}, config=ae_config
            )
            await nursery.start(ae.run)
            verifiers.append(v)
        await nursery.start(AntiEntropy(edge, None, edge_views, models=[key], config=ae_config).run)
        for _ in range(2):
            async with inprocess_transport(verifiers[0]) as transport:
                await speculative_generate(draft, transport, prompt, 2, eos_token_ids=eos)
        hashes = block_hashes(prompt, model_salt(target.model_id))
        # The client ranks by the RTTs its liveness probes measured, and an unmeasured one sorts
        # last; with gossip flowing a link is never idle, so its first sample can take up to
        # RTT_REFRESH_INTERVALS ping intervals (10 s).
        measured = rtt_from_peer_table(edge.peers)
        for _ in range(300):  # at most 30 s for both digests and both RTT samples
            held = edge_views.cached_prefix_tokens(n1.peer_id, hashes, key)
            pinged = measured(n1.peer_id) is not None and measured(n2.peer_id) is not None
            if held >= len(prompt) - 16 and edge_views.get(n2.peer_id, key) is not None and pinged:
                break
            await trio.sleep(0.1)
        else:
            raise AssertionError(
                f"the edge never saw both verifiers' digests and RTTs (V1 holds {held}, "
                f"RTTs {measured(n1.peer_id)}, {measured(n2.peer_id)})"
            )
        rtt = {n1.peer_id: 0.015, n2.peer_id: 0.010}.get
        assert rank_verifiers(
            [n2.peer_id, n1.peer_id], prompt, target.model_id, edge_views, rtt
        ) == [
            n1.peer_id,
            n2.peer_id,
        ]
        # Nothing of it cached anywhere (chat prompts would share the template's system
        # prompt): the nearer one.
        other = list(range(1000, 1100))
        assert (
            rank_verifiers([n1.peer_id, n2.peer_id], other, target.model_id, edge_views, rtt)[0]
            == n2.peer_id
        )
        client = EdgeClient(edge, draft, verifiers=[n2.peer_id, n1.peer_id], views=edge_views)
        try:
            result = await client.generate(prompt, 6)
        finally:
            await client.aclose()
        assert result.verifiers == [n1.peer_id]
        assert result.tokens == target_generate(target, prompt, 6, eos_token_ids=eos)
        nursery.cancel_scope.cancel()


async def test_greedy_over_libp2p_equals_target_and_sessions_are_released(
    target, draft, prompts, overlay_network
) -> None:
    eos = target.eos_token_ids
    ref = target_generate(target, prompts[0], 10, eos_token_ids=eos)
    async with _verifier_and_edge_nodes(target, overlay_network) as (verifier, server, edge):
        for depth, lead in ((1, 0), (2, 0), (2, 6)):  # sync, async, async + verifier lead
            transport = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
            got = await speculative_generate(
                draft,
                transport,
                prompts[0],
                10,
                gamma=4,
                depth=depth,
                lead=lead,
                eos_token_ids=eos,
            )
            assert got.tokens == ref, (depth, lead)
        # target-only over the wire: leads of 3, refilled by empty blocks (verify-lead frames)
        verifier.max_lead = 3
        transport = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        got = await remote_generate(transport, prompts[0], 10, eos_token_ids=eos)
        assert got.tokens == ref and 3 <= got.stats.lead_tokens < 10
        verifier.max_lead = 64
        wrong = P2PVerifierTransport(edge, server.peer_id, "other-model@0")
        with pytest.raises(WrongModel):
            await wrong.open(prompts[0], SamplingOptions())
        wrong = P2PVerifierTransport(edge, server.peer_id, "other-model@0")
        with pytest.raises(WrongModel):  # the refusal itself, not wrapped in an ExceptionGroup
            await speculative_generate(draft, wrong, prompts[0], 4, depth=2, lead=4)
        # An edge that leaves while the verifier leads: the verifier's loop must live on.
        quitter = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        await quitter.open(prompts[2], SamplingOptions(), lead=8)
        assert isinstance(await quitter.receive_result(), Lead)
        await quitter.close()
        await trio.sleep(0.3)  # leads of the closing session land on a closed channel
        again = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        assert (await remote_generate(again, prompts[0], 3, eos_token_ids=eos)).tokens == ref[:3]
        # A sampled session over the wire (sparse q rows), then an edge that vanishes mid-session.
        sampled = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        got = await speculative_generate(
            draft, sampled, prompts[2], 6, gamma=3, options=SamplingOptions(1.0, 0.9, 7)
        )
        assert 1 <= len(got.tokens) <= 6 and got.stats.blocks_verified >= 1
        dropped = P2PVerifierTransport(edge, server.peer_id, draft.target_model_id)
        await dropped.open(prompts[2], SamplingOptions())
        assert len(verifier.sessions) == 1
        await dropped.stream.reset()
        with trio.fail_after(10):  # the handler sees the reset and releases the session
            for _ in range(200):
                if not verifier.sessions:
                    break
                await trio.sleep(0.05)
        assert not verifier.sessions


async def _hold_verifier_node(model_id, verifier, stop: trio.Event, *, bootstrap, task_status):
    cfg = OverlayConfig(
        key=NodeKey.generate(), bootstrap=bootstrap, models=[model_id], roles={"verifier"}
    )
    async with open_overlay_node(cfg) as node, trio.open_nursery() as nursery:
        await nursery.start(verifier.run)
        serve_verifier(node, verifier)
        task_status.started(node)
        await stop.wait()
        nursery.cancel_scope.cancel()


async def test_edge_discovers_verifiers_fails_over_then_raises_no_verifier(
    target, draft, prompts
) -> None:
    eos = target.eos_token_ids
    ref = target_generate(target, prompts[0], 12, eos_token_ids=eos)
    v1, v2 = BatchedVerifier(target), BatchedVerifier(target)
    stop1, stop2 = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        n1 = await nursery.start(
            partial(_hold_verifier_node, target.model_id, v1, stop1, bootstrap=[])
        )
        n2 = await nursery.start(
            partial(_hold_verifier_node, target.model_id, v2, stop2, bootstrap=[n1.addrs[0]])
        )
        async with open_edge([n1.addrs[0]], draft=draft, result_timeout_s=10) as edge:
            with trio.fail_after(20):  # DHT provider + node record propagation on loopback
                for _ in range(100):
                    if set(await edge.find_verifiers()) == {n1.peer_id, n2.peer_id}:
                        break
                    await trio.sleep(0.2)
            pinned = EdgeClient(edge.node, draft, verifiers=[n1.peer_id, n2.peer_id])

            async def kill_v1_mid_session() -> None:
                for _ in range(9000):  # bounded: 90 s at most, like the generation below
                    if v1.stats["blocks"] + v1.stats["lead"] >= 2:  # mid-session
                        break
                    await trio.sleep(0.01)
                stop1.set()

            nursery.start_soon(kill_v1_mid_session)
            with trio.fail_after(90):
                r = await pinned.generate(prompts[0], 12, mode="async")
            assert r.tokens == ref  # resumed on v2 from prompt + committed: same greedy output
            assert r.verifiers == [n1.peer_id, n2.peer_id]
            assert v2.stats["blocks"] + v2.stats["lead"] >= 1  # v2 committed the rest
            stop2.set()
            with trio.fail_after(30), pytest.raises(NoVerifier):
                await pinned.generate(prompts[2], 4, mode="sync")
        nursery.cancel_scope.cancel()


async def test_edge_starts_the_next_request_on_a_spare_stream(
    target, draft, prompts, overlay_network, monkeypatch
) -> None:
    # The first request opens its stream (2 round trips of negotiation) and a spare for the next
    # one; the second starts on the spare. A spare the verifier already dropped (its open timeout
    # shortened here to 0.5 s) is replaced by a fresh stream, with the same output.
    from p2pnode.speculation import client as client_mod
    from p2pnode.speculation import protocol

    ref = target_generate(target, prompts[2], 6, eos_token_ids=target.eos_token_ids)
    async with _edge_client(target, draft, overlay_network) as client:
        with trio.fail_after(60):
            first = await client.generate(prompts[2], 6, mode="remote")
            second = await client.generate(prompts[2], 6, mode="async")
            assert first.tokens == second.tokens == ref
            assert (first.warm, second.warm) == (False, True)
            monkeypatch.setattr(protocol, "OPEN_TIMEOUT_S", 0.5)
            monkeypatch.setattr(client_mod, "SPARE_MAX_AGE_S", 100.0)
            await client.generate(prompts[2], 2, mode="sync")  # leaves a spare behind
            await trio.sleep(1.0)  # > 0.5 s: the verifier closes the idle spare
            third = await client.generate(prompts[2], 6, mode="sync")
            assert third.tokens == ref and not third.warm


async def test_auto_mode_tries_both_then_keeps_the_faster(
    target, draft, prompts, overlay_network
) -> None:
    ref = target_generate(target, prompts[2], 5, eos_token_ids=target.eos_token_ids)
    async with _edge_client(target, draft, overlay_network) as client:
        with trio.fail_after(60):
            runs = [await client.generate(prompts[2], 5, mode="auto") for _ in range(3)]
    assert [r.tokens for r in runs] == [ref] * 3
    assert [r.mode for r in runs[:2]] == ["async", "remote"]
    assert runs[2].mode == max(client.mode_rates, key=client.mode_rates.get)
    with pytest.raises(BadRequest, match="auto"):
        await client.generate(prompts[2], 5, mode="fastest")
