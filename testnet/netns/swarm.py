"""A p2pnode swarm on a namespace testbed, started the way users start it.

The first host runs ``p2pnode bootstrap`` with default flags, ``p2pnode invite`` gives the
invite, every other host runs ``p2pnode join --invite <it>`` (plus ``--model none`` unless it
serves the model): no listen or announce address is set by hand, so discovery, addresses,
dial-backs and relays are all the product's own.

Contract:
- ``NetnsSwarm(testbed, workdir)``; ``start_bootstrap(host, open_network=False)`` -> invite string;
  ``start_join(host, model="none", extra=())``; ``start_client(host)``;
  ``wait_full_view(limit_s)`` -> seconds until
  every node sees every other one up (``TimeoutError`` with each node's view otherwise);
  ``peers(host)`` / ``status(host)`` read the node's HTTP API inside its namespace;
  ``request(host, path, body)`` POSTs JSON there -> (headers, body); ``cli(host, *args)``
  runs the ``p2pnode`` command inside the host; ``log(host)`` is the tail of its log.
- Processes and namespaces belong to the testbed: ``testbed.close()`` removes them.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from p2pnode.testnet.netns.namespaces import Testbed, TestbedError

__all__ = ["API", "NetnsSwarm"]

API = "http://127.0.0.1:8731"  # the default API address; every namespace has its own
_HTTP = (
    "import json, sys, urllib.request\n"
    "url, body = sys.argv[1], sys.argv[2]\n"
    "req = urllib.request.Request(url, data=body.encode() or None,\n"
    "    headers={'content-type': 'application/json'})\n"
    "try:\n"
    "    r = urllib.request.urlopen(req, timeout=float(sys.argv[3]))\n"
    "    print(json.dumps({'status': r.status, 'headers': dict(r.headers),"
    " 'body': r.read().decode()}))\n"
    "except urllib.error.HTTPError as e:\n"
    "    print(json.dumps({'status': e.code, 'headers': dict(e.headers),"
    " 'body': e.read().decode()}))\n"
)


def p2pnode_command() -> list[str]:
    """The ``p2pnode`` script of this environment (what a user types), else the module."""
    script = Path(sys.executable).with_name("p2pnode")
    if script.exists():
        return [str(script)]
    found = shutil.which("p2pnode")
    return [found] if found else [sys.executable, "-m", "p2pnode.bootstrap.cli"]


class NetnsSwarm:
    def __init__(self, testbed: Testbed, workdir: Path) -> None:
        self.testbed = testbed
        self.workdir = workdir
        self.nodes: dict[str, Path] = {}  # host -> home
        self.invite = ""

    def home(self, host: str) -> Path:
        return self.workdir / host / "home"

    def log_path(self, host: str) -> Path:
        return self.workdir / host / "node.log"

    def log(self, host: str, chars: int = 3000) -> str:
        path = self.log_path(host)
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _start(self, host: str, args: Sequence[str]) -> None:
        (self.workdir / host).mkdir(parents=True, exist_ok=True)
        argv = [*p2pnode_command(), *args, "--home", str(self.home(host))]
        self.testbed.popen(host, argv, self.log_path(host))
        self.nodes[host] = self.home(host)

    def _wait_api(self, host: str, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                self.get(host, "/status", timeout=3)
                return
            except (TestbedError, json.JSONDecodeError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"{host}: no API within {limit_s} s\n{self.log(host)}")

    def start_bootstrap(
        self, host: str, limit_s: float = 60.0, *, open_network: bool = False
    ) -> str:
        """A closed network by default, as a user's ``p2pnode bootstrap`` starts one: every
        joiner redeems the invite through the NATs before it may speak any other protocol."""
        self._start(host, ["bootstrap", "--open"] if open_network else ["bootstrap"])
        self._wait_api(host, limit_s)
        self.invite = self.cli(host, "invite").strip()
        return self.invite

    def start_join(self, host: str, model: str = "none", extra: Sequence[str] = ()) -> None:
        if not self.invite:
            raise RuntimeError("start_bootstrap first: joins need its invite")
        args = ["join", "--invite", self.invite]
        if model != "default":
            args += ["--model", model]
        self._start(host, [*args, *extra])

    def start_client(self, host: str) -> None:
        """``p2pnode client --bootstrap <invite>``: a light entry node (no model)."""
        if not self.invite:
            raise RuntimeError("start_bootstrap first: clients need its invite")
        self._start(host, ["client", "--bootstrap", self.invite])

    # -- reading the nodes --------------------------------------------------------------

    def cli(self, host: str, *args: str, timeout: float = 60.0) -> str:
        argv = [*p2pnode_command(), *args, "--home", str(self.home(host))]
        return self.testbed.run(host, argv, timeout=timeout)

    def _http(self, host: str, path: str, body: str, timeout: float) -> dict[str, Any]:
        argv = [sys.executable, "-c", _HTTP, API + path, body, str(timeout)]
        return json.loads(self.testbed.run(host, argv, timeout=timeout + 10))

    def get(self, host: str, path: str, timeout: float = 10.0) -> Any:
        reply = self._http(host, path, "", timeout)
        if reply["status"] != 200:
            raise TestbedError(f"GET {path} on {host}: {reply['status']} {reply['body'][:300]}")
        return json.loads(reply["body"])

    def request(
        self, host: str, path: str, body: dict[str, Any], timeout: float = 120.0
    ) -> tuple[dict[str, str], Any]:
        reply = self._http(host, path, json.dumps(body), timeout)
        if reply["status"] != 200:
            raise TestbedError(f"POST {path} on {host}: {reply['status']} {reply['body'][:500]}")
        headers = {k.lower(): v for k, v in reply["headers"].items()}
        return headers, json.loads(reply["body"])

    def status(self, host: str) -> dict[str, Any]:
        return self.get(host, "/status")

    def peers(self, host: str) -> list[dict[str, Any]]:
        return self.get(host, "/peers")

    def peer_ids(self) -> dict[str, str]:
        return {h: json.loads((home / "runtime.json").read_text())["peer_id"]
                for h, home in self.nodes.items() if (home / "runtime.json").exists()}  # fmt: skip

    def views(self) -> dict[str, set[str]]:
        """host -> peer ids it sees up (hosts whose API does not answer yet: empty)."""
        out: dict[str, set[str]] = {}
        for host in self.nodes:
            try:
                out[host] = {p["peer_id"] for p in self.peers(host) if p.get("state") == "up"}
            except (TestbedError, json.JSONDecodeError, OSError):
                out[host] = set()
        return out

    def wait_full_view(
        self,
        limit_s: float,
        *,
        poll_s: float = 1.0,
        progress: Callable[[float, int, int], None] | None = None,
    ) -> float:
        """Seconds until every node sees all others up (from this call)."""
        start = time.monotonic()
        while True:
            ids = self.peer_ids()
            views = self.views()
            want = len(self.nodes) - 1
            full = sum(
                1
                for host, seen in views.items()
                if host in ids and len(seen & (set(ids.values()) - {ids[host]})) >= want
            )
            elapsed = time.monotonic() - start
            if progress is not None:
                progress(elapsed, full, len(self.nodes))
            if len(ids) == len(self.nodes) and full == len(self.nodes):
                return elapsed
            if elapsed > limit_s:
                names = {pid: h for h, pid in ids.items()}
                seen = {h: sorted(names.get(p, p[:12]) for p in v) for h, v in views.items()}
                raise TimeoutError(f"no full view within {limit_s} s: {seen}")
            time.sleep(poll_s)
