"""Preflight of a trial on an inventory: what is checked before and once the nodes join.

Contract:
- ``check_hosts(client, inventory, local)`` probes every host at once over SSH
  (``probe.py``) -> ``{name: HostCheck}``: reachable or the SSH error, clock offset against
  this controller (of ``CLOCK_EXCHANGES`` clock reads in the open session, the one with the
  shortest round trip: its clock minus the round trip's midpoint), that round trip,
  version, code fingerprint and commit, hardware; ``problem`` says why a host cannot take part
  (unreachable, other code than ``local``, the controller's own ``probe.describe()``).
- ``rtt_matrix(peers, names)`` -> ``{host: {peer host: ms}}`` from each node's ``/peers``
  (the nodes' own ping protocol), ``reachability(statuses)`` -> each node's verdict.
- ``table(preflight)`` renders what ``Preflight.to_json()`` holds as markdown (printed, and
  saved as ``preflight.md`` beside ``preflight.json``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from p2pnode.testnet.remote.inventory import Host, Inventory
from p2pnode.testnet.remote.ssh import SshClient, python_command

PROBE_TIMEOUT_S = 60.0
CLOCK_EXCHANGES = 5
CLOCK_WARN_S = 1.0  # latencies are timed on the controller; offsets only skew log times


@dataclass
class HostCheck:
    host: str
    region: str
    role: str
    reachable: bool = False
    clock_offset_ms: float | None = None
    ssh_rtt_ms: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    problem: str = ""  # why the host cannot take part ("" when it can)
    warnings: list[str] = field(default_factory=list)


def _clock(proc: subprocess.Popen, exchanges: int) -> tuple[float, float]:
    """(offset, round trip) in seconds of the exchange with the shortest round trip, as NTP
    picks: its midpoint is closest to when the host read its clock."""
    best: tuple[float, float] | None = None
    for _ in range(exchanges):
        t0 = time.time()
        proc.stdin.write("t\n")
        proc.stdin.flush()
        remote = float(proc.stdout.readline())
        t1 = time.time()
        if best is None or t1 - t0 < best[1]:
            best = (remote - (t0 + t1) / 2, t1 - t0)
    assert best is not None
    return best


def _check(client: SshClient, host: Host, local: Mapping[str, Any]) -> HostCheck:
    check = HostCheck(host.name, host.region, host.role)
    proc = client.pipe(host, python_command(host, "p2pnode.testnet.remote.probe", []))
    timer = threading.Timer(PROBE_TIMEOUT_S, proc.kill)  # a hung host must not hang the run
    timer.start()
    try:
        first = proc.stdout.readline()
        if not first:
            err = proc.stderr.read().strip()[-1500:]
            check.problem = f"unreachable: SSH exited {proc.wait()}: {err}"
            return check
        check.reachable = True
        try:
            info = json.loads(first)
            offset, rtt = _clock(proc, CLOCK_EXCHANGES)
        except (ValueError, OSError) as exc:
            check.problem = f"the probe failed: {exc}: {first[-300:]!r}"
            return check
    finally:
        timer.cancel()
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    check.info = info
    check.ssh_rtt_ms = round(rtt * 1e3, 1)
    check.clock_offset_ms = round(offset * 1e3, 1)
    if abs(offset) > CLOCK_WARN_S:
        check.warnings.append(f"clock {offset:+.1f} s off (run NTP)")
    if (info.get("version"), info.get("fingerprint")) != (local["version"], local["fingerprint"]):
        check.problem = (
            f"runs other code: version {info.get('version')} fingerprint "
            f"{info.get('fingerprint')} (the controller: {local['version']} "
            f"{local['fingerprint']})"
        )
    return check


def check_hosts(
    client: SshClient, inventory: Inventory, local: Mapping[str, Any]
) -> dict[str, HostCheck]:
    with ThreadPoolExecutor(max_workers=min(16, len(inventory.hosts))) as pool:
        checks = pool.map(lambda h: _check(client, h, local), inventory.hosts)
        return {c.host: c for c in checks}


def rtt_matrix(
    peers: Mapping[str, Sequence[Mapping[str, Any]] | None], names: Mapping[str, str]
) -> dict[str, dict[str, float | None] | None]:
    """``peers``: host -> its ``/peers`` (None when it did not answer); ``names``: peer id ->
    host. Each row holds every other host: the node's RTT to it, None where it has none; the
    row itself is None when the node did not answer."""
    hosts = list(peers)
    out: dict[str, dict[str, float | None] | None] = {}
    for host in hosts:
        if peers[host] is None:  # the node did not answer: no row
            out[host] = None
            continue
        row: dict[str, float | None] = {other: None for other in hosts if other != host}
        for p in peers[host]:
            other = names.get(str(p.get("peer_id")))
            rtt = p.get("rtt_ms")
            if other in row and isinstance(rtt, int | float):
                row[other] = round(float(rtt), 1)
        out[host] = row
    return out


def reachability(statuses: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """Each node's own verdict from the dial-backs of its peers (``/status``)."""
    out = {}
    for host, status in statuses.items():
        r = (status or {}).get("reachability")
        if isinstance(r, Mapping):
            r = r.get("verdict", json.dumps(r, sort_keys=True))
        out[host] = str(r) if r is not None else "unknown"
    return out


@dataclass
class Preflight:
    controller: dict[str, Any]
    hosts: dict[str, HostCheck]
    dropped: list[str] = field(default_factory=list)
    rtt_ms: dict[str, dict[str, float | None] | None] = field(default_factory=dict)
    reachability: dict[str, str] = field(default_factory=dict)

    def failed(self) -> dict[str, str]:
        return {n: c.problem for n, c in self.hosts.items() if c.problem}

    def to_json(self) -> dict[str, Any]:
        return {
            "controller": self.controller,
            "hosts": {n: asdict(c) for n, c in self.hosts.items()},
            "dropped": self.dropped,
            "rtt_ms": self.rtt_ms,
            "reachability": self.reachability,
        }


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def table(pf: Mapping[str, Any]) -> str:
    c = pf["controller"]
    lines = [
        f"Controller: p2pnode {c['version']} (code {c['fingerprint']}, commit "
        f"{_cell(c.get('commit'))}) on {c['hostname']}",
        "",
        "| host | region | role | SSH | clock offset ms | SSH RTT ms | code | python | cpus "
        "| reachability | problem |",
        "|---|---|---|---|---:|---:|---|---|---:|---|---|",
    ]
    for name, h in pf["hosts"].items():
        info = h["info"]
        code = f"{info.get('version')} {info.get('fingerprint')}" if info else "-"
        lines.append(
            f"| {name} | {h['region']} | {h['role']} | {'ok' if h['reachable'] else 'FAILED'} "
            f"| {_cell(h['clock_offset_ms'])} | {_cell(h['ssh_rtt_ms'])} | {code} "
            f"| {_cell(info.get('python'))} | {_cell(info.get('cpus'))} "
            f"| {_cell(pf['reachability'].get(name))} "
            f"| {_cell('; '.join([h['problem'], *h['warnings']]).strip('; '))} |"
        )
    if pf["dropped"]:
        lines += ["", f"Dropped (--allow-missing): {', '.join(pf['dropped'])}"]
    rtt = pf["rtt_ms"]
    if rtt:
        hosts = list(rtt)
        lines += ["", "RTT between the nodes once joined (ms, each node's own pings; row: from)"]
        lines += ["", "| from \\ to | " + " | ".join(hosts) + " |"]
        lines.append("|---|" + "---:|" * len(hosts))
        for a in hosts:
            row = rtt[a] or {}
            cells = ["" if a == b else _cell(row.get(b) if rtt[a] else "no answer") for b in hosts]
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
