"""``run_node(settings, extensions=[...])``: what a caller adds runs on the node's real service.

Real parts: ``run_node`` with the emulated engine on loopback, and the trials' ``Adversary``
extension (``testnet/run/node.py``) as a trial node passes it.
"""

from __future__ import annotations

from functools import partial

import trio

from p2pnode.bootstrap.config import settings_from
from p2pnode.bootstrap.extension import NodeExtension
from p2pnode.bootstrap.node import run_node
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.testnet.adversary.trial import LyingEngine
from p2pnode.testnet.run.node import Adversary


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[RoutedService, trio.Nursery]] = []

    def service_started(self, service: RoutedService, nursery: trio.Nursery) -> None:
        self.calls.append((service, nursery))


async def test_extensions_run_once_the_service_runs_in_the_order_given(tmp_path) -> None:
    settings = settings_from(
        {"home": str(tmp_path), "listen": ["/ip4/127.0.0.1/tcp/0"], "api_port": 0,
         "backend": "emulated"}
    )  # fmt: skip
    recorder = Recorder()
    liar = Adversary("random-text")
    extensions: list[NodeExtension] = [recorder, liar]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run_node, settings, extensions=extensions))
            nursery.cancel_scope.cancel()
    [(service, node_nursery)] = recorder.calls
    assert isinstance(service, RoutedService) and isinstance(node_nursery, trio.Nursery)
    # the adversary came after the recorder and replaced the engine its peers are served from
    assert isinstance(service.server.engine, LyingEngine)


async def test_a_node_without_extensions_serves_honestly(tmp_path) -> None:
    settings = settings_from(
        {"home": str(tmp_path), "listen": ["/ip4/127.0.0.1/tcp/0"], "api_port": 0,
         "backend": "emulated"}
    )  # fmt: skip
    recorder = Recorder()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run_node, settings, extensions=[recorder]))
            nursery.cancel_scope.cancel()
    [(service, _)] = recorder.calls
    assert not isinstance(service.server.engine, LyingEngine)
