"""Audits on a third peer (overlay/serve/audits.py), real model, real libp2p hosts on loopback.

Three members of a closed network share one loaded model: the origin O (advertised slow, so it
forwards), the server S and the auditor A. S and A hold the prompt's prefix, O does not, so the
cheapest audit of S's answer is A's pass on its cached prefix. Every answer is audited (rate 1)
so the test does not depend on the sampled rate.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest

from p2pnode.identity import open_envelope
from p2pnode.inference.engine import open_engine
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.serve.audits import (
    VERDICT_KIND,
    AuditRequest,
    RemoteAuditFailed,
    request_audit,
)
from p2pnode.overlay.serve.forward import ForwardConfig
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import AuditConfig
from p2pnode.overlay.trust.challenge import ChallengeConfig
from p2pnode.testnet.adversary.trial import make_adversary

from testkit import wait_until

logging.getLogger("libp2p").setLevel(logging.ERROR)

AE_CONFIG = AntiEntropyConfig(interval_s=0.2, pull_min_interval_s=0.3)
FORWARD_CONFIG = ForwardConfig(accept_slack_s=20, first_token_slack_s=30, idle_min_s=20)
SPEEDS = {"origin": 2.0, "server": 1 / 40, "auditor": 1 / 10}


@contextlib.asynccontextmanager
async def members(loaded: Any, overlay_network: Any) -> AsyncIterator[dict[str, Any]]:
    async with (
        overlay_network(3, ping_timeout=5.0, health_ping_timeout=10.0) as nodes,
        contextlib.AsyncExitStack() as stack,
    ):
        await wait_until(lambda: all(len(x.peers.up_peers()) == 2 for x in nodes), 30, "a mesh")
        ids = {x.peer_id for x in nodes}
        engines = []
        for role in SPEEDS:  # every engine before the services' nursery: scopes must nest
            engine = await stack.enter_async_context(
                open_engine(loaded, calibrate_cost=False, torch_threads=1)
            )
            c = engine.cost
            c.prefill_s_per_token, c.decode_s_per_token = 1 / 200, SPEEDS[role]
            c.overhead_s, c.alpha = 0.02, 0.0
            engines.append(engine)
        async with trio.open_nursery() as nursery:
            out: dict[str, Any] = {}
            for role, node, engine in zip(SPEEDS, nodes, engines, strict=True):
                registry = CollectorRegistry()
                svc = RoutedService(
                    node,
                    node.config.key,
                    engine,
                    antientropy_config=AE_CONFIG,
                    forward_config=FORWARD_CONFIG,
                    challenge_config=ChallengeConfig(enabled=False),
                    audit_config=AuditConfig(trusted_rate=1.0),
                    registry=registry,
                    is_member=ids.__contains__,
                )
                svc.router.rtt_s = lambda _peer: 0.002
                await nursery.start(svc.run)
                out[role], out[f"{role}_registry"] = svc, registry
            yield out
            nursery.cancel_scope.cancel()


async def test_a_member_holding_the_prefix_audits_and_a_lie_it_finds_is_confirmed(
    loaded, overlay_network
) -> None:
    async with members(loaded, overlay_network) as s:
        o, server, auditor = s["origin"], s["server"], s["auditor"]
        text = "You are a careful assistant who answers in one short sentence. " * 12
        prefix = loaded.tokenizer.encode(text)
        for svc in (server, auditor):  # both hold the prefix; the origin does not
            await svc.engine.generate(prefix + [13], {"max_tokens": 1})
        sid, aid = server.node.peer_id, auditor.node.peer_id
        await wait_until(
            lambda: (
                all(o.views.get(p, o.model_id) for p in (sid, aid))
                and o.views.get(sid, o.model_id).fingerprints
                and o.views.get(aid, o.model_id).fingerprints
            ),
            30,
            "the origin's views of both prefixes",
        )
        with trio.fail_after(300):
            first = await o.generate(prefix + [42, 13], {"max_tokens": 8})
            assert first.served_by == sid, first.attempts
            await wait_until(lambda: o.auditor.counts["passed"] == 1, 60, "the first audit")
            assert o.auditor.by_auditor == {"self": 0, "peer": 1}, o.auditor.others.counts
            assert auditor.audit_server.served == 1 and server.audit_server.served == 0
            assert o.trust.usable(sid) and o.trust.usable(aid)

            make_adversary(server, "wrong-output", rate=1.0)  # it turns
            await o.generate(prefix + [43, 13], {"max_tokens": 8})
            await wait_until(lambda: not o.trust.usable(sid), 60, "the liar's demotion")
        # The auditor found it; nobody else holds the prefix, so the origin confirmed it
        # with its own pass before demoting the server. The auditor keeps its trust.
        assert o.auditor.counts["failed"] == 1 and o.auditor.by_auditor["peer"] == 2
        assert o.trust.usable(aid) and o.trust.score(aid) == 1.0
        assert (
            'p2pnode_audits_by_auditor_total{auditor="peer"} 2.0'
            in generate_latest(s["origin_registry"]).decode()
        )


async def test_a_verdict_is_signed_by_the_auditor_and_bound_to_the_request(
    loaded, overlay_network
) -> None:
    async with members(loaded, overlay_network) as s:
        o, auditor = s["origin"], s["auditor"]
        prompt = loaded.tokenizer.encode("Audit me, please.")
        answer = (await o.engine.generate(prompt, {"max_tokens": 4})).tokens
        req = AuditRequest(model_id=o.model_id, prompt=prompt, answer=answer, nonce=b"n" * 16)
        verdict = await request_audit(o.node, auditor.node.peer_id, req, 60)
        assert verdict.passed and verdict.checked == len(answer)
        # Another model id: refused with a reason, no verdict.
        other = AuditRequest(model_id="another-model", prompt=prompt, answer=answer)
        try:
            await request_audit(o.node, auditor.node.peer_id, other, 60)
        except RemoteAuditFailed as exc:
            assert "no_model" in str(exc)
        else:
            raise AssertionError("a verdict for a model the auditor does not serve")
        # The envelope names its signer: a verdict opened as another kind fails.
        reply = await auditor.audit_server._answer(req)
        opened = open_envelope(reply.verdict, VERDICT_KIND)
        assert opened.peer_id == auditor.node.peer_id and opened.payload["passed"]
