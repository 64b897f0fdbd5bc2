"""Privacy, stated and kept: what digests may show (overlay/cache/privacy.py), private requests that
never leave the node (two real nodes, real model, real HTTP API), and the API's bearer token and
bind rule (bootstrap/auth.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2pnode.bootstrap.api import build_app, serve_api
from p2pnode.bootstrap.cli import main
from p2pnode.bootstrap.config import ConfigError, settings_from
from p2pnode.identity import NodeKey
from p2pnode.inference.blockhash import BLOCK_SIZE, BlockRemoved, BlockStored, block_hashes
from p2pnode.inference.engine import open_engine
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.cache.digest import DigestBuilder, fingerprint
from p2pnode.overlay.cache.privacy import AdvertiseGate
from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import AuditConfig

from testkit import wait_until

logging.getLogger("libp2p").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- the gate


def _gate(min_uses: int) -> tuple[AdvertiseGate, DigestBuilder]:
    builder = DigestBuilder("me", "model@x")
    return AdvertiseGate(builder, min_uses), builder


def test_a_block_used_once_is_not_advertised_and_twice_is() -> None:
    gate, builder = _gate(2)
    once, twice = [11, 12], [21, 22]
    gate.note_request(once)
    gate.note_request(twice)
    gate.on_event(BlockStored((11, 12), None))
    gate.on_event(BlockStored((21, 22), None))
    assert len(builder) == 0 and gate.withheld == 4
    gate.note_request(twice)
    assert builder._hashes == {21, 22} and gate.advertised == 2
    gate.on_event(BlockRemoved((21, 11)))
    assert builder._hashes == {22}


def test_private_blocks_are_never_advertised_whatever_their_use() -> None:
    gate, builder = _gate(1)  # even where every cached block is shown
    gate.on_event(BlockStored((1,), None))  # a public system prompt, shown at once
    with gate.private():
        gate.on_event(BlockStored((2, 3), 1))  # the private question and answer, quarantined
        gate.on_event(BlockStored((9,), None))  # a concurrent public request's block
        assert builder._hashes == {1}
        gate.mark_private([1, 2, 3])
    assert builder._hashes == {1, 9}  # the public block stays; the quarantine is released
    for _ in range(3):
        gate.note_request([1, 2, 3])
    gate.on_event(BlockStored((4,), 3))  # a later block on the private prefix
    assert builder._hashes == {1, 9} and all(gate.is_private(h) for h in (2, 3, 4))


# --------------------------------------------------------------------------- API key, bind


def test_non_loopback_api_without_a_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="--api-key"):
        settings_from({"api_host": "0.0.0.0"})
    assert settings_from({"api_host": "0.0.0.0", "api_key": "s3cret"}).api_key == "s3cret"
    assert settings_from({"api_host": "0.0.0.0", "api_insecure": True}).api_insecure
    assert settings_from({"api_host": "::1"}).api_host == "::1"
    peer = NodeKey.generate().peer_id
    result = CliRunner().invoke(
        main,
        ["join", "--api-host", "192.0.2.7", "--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{peer}"],
        env={"P2PNODE_API_KEY": ""},
    )
    assert result.exit_code == 2 and "--api-insecure" in result.output, result.output


async def test_requests_without_the_bearer_token_get_401() -> None:
    app = build_app(lambda: {"ok": True}, api_key="s3cret")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_api, app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for path in ("/status", "/metrics", "/v1/models"):
                r = await http.get(path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            wrong = await http.get("/status", headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401
            ok = await http.get("/status", headers={"authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json() == {"ok": True}
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert (await client.models.list()).data == []  # the OpenAI client sends the header
        await client.close()
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- private requests


@contextlib.asynccontextmanager
async def two_nodes(loaded: Any) -> AsyncIterator[list[tuple[Any, RoutedService, Any, str]]]:
    ae = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
    async with contextlib.AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        out: list[tuple[Any, RoutedService, Any, str]] = []
        for i in range(2):
            key = NodeKey.generate()
            engine = await stack.enter_async_context(
                open_engine(loaded, calibrate_cost=False, torch_threads=1)
            )
            config = OverlayConfig(
                key=key, bootstrap=[out[0][0].addrs[0]] if i else [], models=[engine.model_id]
            )
            node = await stack.enter_async_context(open_overlay_node(config))
            registry = CollectorRegistry()
            svc = RoutedService(
                node,
                key,
                engine,
                registry=registry,
                antientropy_config=ae,
                advertise_min_uses=2,
                audit_config=AuditConfig(probation_answers=0),  # privacy here, not probation
            )
            svc.router.rtt_s = lambda _peer: 0.002
            await nursery.start(svc.run)
            url = await nursery.start(
                serve_api, build_app(node.status, service=svc, registry=registry), "127.0.0.1", 0
            )
            out.append((node, svc, registry, url))
        yield out


async def test_a_private_request_never_crosses_the_wire_nor_enters_a_digest(loaded) -> None:
    async with two_nodes(loaded) as ((_na, a, reg_a, url_a), (_nb, b, _rb, _ub)):
        system = [{"role": "system", "content": "You are a terse assistant. " * 40}]
        sys_ids = b.engine.encode_chat(system)
        for _ in range(2):  # used twice on B: its blocks are advertised
            await b.engine.generate(sys_ids, {"max_tokens": 1})
            b._note_use(sys_ids)
        full = len(sys_ids) // BLOCK_SIZE * BLOCK_SIZE
        hs = block_hashes(sys_ids, a.salt)
        await wait_until(
            lambda: a.views.cached_prefix_tokens(b.node.peer_id, hs, a.model_id) >= full,
            20,
            "B's shared prefix in A's view",
        )
        messages = system + [{"role": "user", "content": "My secret PIN is 4711. Repeat it."}]
        prompt = a.engine.encode_chat(messages)
        assert a.decide(prompt, {"max_tokens": 4}).chosen == b.node.peer_id  # public: forwarded
        client = openai.AsyncOpenAI(base_url=f"{url_a}/v1", api_key="x", max_retries=0)
        with trio.fail_after(120):
            for _ in range(3):  # three uses: over any threshold, still never advertised
                raw = await client.chat.completions.with_raw_response.create(
                    model=a.model_id,
                    messages=messages,
                    max_tokens=4,
                    temperature=0,
                    extra_body={"p2pnode": {"private": True}},
                )
                info = raw.parse().model_extra["p2pnode"]
                assert info["served_locally"] is True and info["routing"]["reason"] == "private"
        await client.close()
        assert b.server.received == 0  # nothing reached B's forward handler
        attempts = [
            s.value
            for f in text_string_to_metric_families(generate_latest(reg_a).decode())
            for s in f.samples
            if s.name == "p2pnode_forward_attempts_total"
        ]
        assert sum(attempts) == 0  # nor did A try to send it anywhere
        private = block_hashes(prompt, a.salt)[full // BLOCK_SIZE :]
        assert private and a.engine.cached_prefix_len(prompt) >= len(prompt) - BLOCK_SIZE
        assert not {fingerprint(h) for h in private} & a.builder.fingerprints
        # Gossip from A after the private requests: a public prefix A uses twice from now on
        # must reach B's view of A; that view must still lack every private block.
        public = a.engine.encode_chat([{"role": "system", "content": "You list birds. " * 40}])
        for _ in range(2):
            await a.engine.generate(public, {"max_tokens": 1})
            a._note_use(public)
        public_full = len(public) // BLOCK_SIZE * BLOCK_SIZE
        public_hashes = block_hashes(public, a.salt)
        await wait_until(
            lambda: (
                b.views.cached_prefix_tokens(a.node.peer_id, public_hashes, b.model_id)
                >= public_full
            ),
            20,
            "A's later public prefix in B's view",
        )
        seen = b.views.get(a.node.peer_id, b.model_id)
        assert seen is not None and not {fingerprint(h) for h in private} & seen.fingerprints
