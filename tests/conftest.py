"""Shared fixtures (the helpers without a fixture are in the ``testkit`` package).

- ``loaded``: the real default model (SmolLM2-135M, fp32), loaded once per run and shared by
  every test that asks for it. Engines and verifiers only read its weights; a test that needs
  other weights (a noisy copy, another dtype) makes its own copy or load and never changes this
  one.
- ``overlay_network(n, ...)`` starts n real overlay nodes on 127.0.0.1. The fixture returns an
  async context manager factory (not the nodes themselves): trio nurseries must be entered and
  exited in the same task, which a pytest-trio fixture task is not.
- ``node_processes``: real ``p2pnode`` CLI processes (``NodeProcesses``), every one of them
  stopped when the test ends, also when it fails.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from p2pnode.identity import NodeKey
from p2pnode.inference.models import LoadedModel, load_model
from p2pnode.overlay.net.node import OverlayConfig, OverlayNode, open_overlay_node

# `make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder`).
# Tests that start several model-serving processes or network namespaces run one at a time, in
# one group: two such sets at once would starve each other's nodes of the two cores (and trials
# on namespace hosts share one driver subnet). That group goes first, being the longest; every
# other module is a group of its own, so its module fixtures are made once.
HEAVY = (
    "tests/system/test_holepunch_migration.py",
    "tests/system/test_holepunch_netns.py",
    "tests/system/test_inventory_ssh.py",
    "tests/system/test_models_netns.py",
    "tests/system/test_swarm_models.py",
    "tests/system/test_swarm_netns.py",
    "tests/testnet/test_testnet.py::test_smoke_trial_on_namespace_hosts",
    "tests/testnet/test_testnet.py::test_adversarial_trial_catches_every_liar",
    "tests/overlay/test_relay.py",
    "tests/overlay/test_reachability.py",
    "tests/overlay/test_dcutr_patch.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy = [item.nodeid.startswith(HEAVY) for item in items]
    for item, is_heavy in zip(items, heavy, strict=True):
        group = "heavy" if is_heavy else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
    # Stable: the heavy group first, everything else in its collected order.
    order = sorted(range(len(items)), key=lambda i: not heavy[i])
    items[:] = [items[i] for i in order]


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    return load_model(None)


@contextlib.asynccontextmanager
async def _overlay_network(
    n: int, *, chain: bool = False, models: dict[int, list[str]] | None = None, **config: Any
) -> AsyncIterator[list[OverlayNode]]:
    """n nodes; node i>0 bootstraps from node 0, or from node i-1 when `chain`."""
    models = models or {}
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[OverlayNode] = []
        for i in range(n):
            bootstrap = [] if i == 0 else [nodes[i - 1 if chain else 0].addrs[0]]
            cfg = OverlayConfig(
                key=NodeKey.generate(), bootstrap=bootstrap, models=models.get(i, []), **config
            )
            nodes.append(await stack.enter_async_context(open_overlay_node(cfg)))
        yield nodes


@pytest.fixture
def overlay_network() -> Callable[..., contextlib.AbstractAsyncContextManager[list[OverlayNode]]]:
    return _overlay_network


P2PNODE = [sys.executable, "-m", "p2pnode.bootstrap.cli"]


class NodeProcesses:
    """``p2pnode`` CLI processes of one test, each logging to ``<home>/node.log``."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(
        self, args: list[str], home: Path, *, listen: str = "/ip4/127.0.0.1/tcp/0"
    ) -> subprocess.Popen:
        """``p2pnode ARGS --home HOME --api-port 0 --listen LISTEN``, started now."""
        home.mkdir(parents=True, exist_ok=True)
        log = open(home / "node.log", "wb")  # noqa: SIM115 - the process holds it until it exits
        cmd = [*P2PNODE, *args, "--home", str(home), "--api-port", "0", "--listen", listen]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child has its own copy
        self.procs.append(proc)
        return proc

    @staticmethod
    def runtime(home: Path, proc: subprocess.Popen, timeout: float = 60.0) -> dict[str, Any]:
        """The node's ``runtime.json`` once it wrote it; fails with its log if it exits or
        takes longer than ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"node exited early:\n{(home / 'node.log').read_text()}")
            try:
                return json.loads((home / "runtime.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.1)
        raise AssertionError(f"node not up within {timeout} s:\n{(home / 'node.log').read_text()}")

    def stop(self) -> None:
        """SIGTERM (after SIGCONT, for a stopped one) to every process, SIGKILL after 15 s."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


@pytest.fixture
def node_processes() -> Iterator[NodeProcesses]:
    procs = NodeProcesses()
    try:
        yield procs
    finally:
        procs.stop()
