"""Churn during a trial: nodes leave and join while the driver sends requests.

Contract:
- The spec's ``[[churn]]`` events (``spec.py``): ``kill`` (SIGKILL), ``leave`` (SIGTERM, clean
  stop), ``join`` (a departed node restarts with its identity, or a NEW node starts).
  ``await run_churn(trial, pool, start, log=...)`` applies them at ``start + at_s`` (trio
  clock) and keeps ``pool`` current; after each departure it measures how long the survivors
  take to stop using the departed peer (``departure_watch``).
- ``NodePool(apis, peer_ids, models)``: the nodes a client may send to. A client learns of a
  departure only by failing to reach the node (``note_unreachable``: avoided for ``AVOID_S``)
  or from the churn task once the process is gone (``set_down``); ``set_up`` adds or revives a
  node once its API answers.
- ``await drive_with_retries(pool, requests, workload, *, max_duration_s, retries, ...)``:
  ``driver.drive`` for a changing node set. A request goes to its planned node while that is
  up, else to a live one picked by the request index. An attempt that ends WITHOUT an answer
  because the node is gone or refused it -- connection refused/reset, the connection closed
  before a response, HTTP 503 -- is sent again to another live node, at most ``retries``
  times. Attempts are sequential and a failed attempt's connection is closed before the next
  one starts, so no request can be answered twice; read timeouts are not retried (the node
  may still answer, and a retry could double its work). One record per planned request, as
  ``driver.drive`` gives, plus ``planned_node``, ``attempts`` ([node, outcome, seconds], one
  per attempt), ``answers`` (answers received: 1 when ok), ``fell_back`` and
  ``forward_failures`` (the serving node's own fallbacks, from its ``p2pnode.routing``);
  ``latency_s`` is what the client waited in all, from its first attempt to the answer.
- ``churn_summary(records, events, watches, applied) -> dict``: lost (planned requests without an
  answer, target 0), duplicates (answered more than once), retried requests, the overlay's
  fallbacks after failed forwards, latency of requests sent within ``WINDOW_S`` after an event
  versus the rest, and the departure watches.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx
import trio

from p2pnode.testnet.spec import ChurnEvent, Workload
from p2pnode.testnet.workload import driver

WINDOW_S = 10.0  # requests sent this long after a churn event count as "during churn"
RETRY_BACKOFF_S = 0.25  # times the attempt number: the overlay needs a moment to notice
WATCH_LIMIT_S = 60.0  # a departure watch gives up after this long (views expire after 30 s)
WATCH_POLL_S = 1.0
AVOID_S = 5.0  # a node that refused a connection gets no request for this long


class ChurnNode(Protocol):
    @property
    def api(self) -> str: ...

    @property
    def peer_id(self) -> str: ...


class ChurnTrial(Protocol):
    """What churn needs of a running trial: its nodes (by index) and how to stop and start
    one (``launch.RunningTrial`` on this machine, ``remote.faults.RemoteChurn`` on hosts)."""

    spec: Any  # TrialSpec
    arm: str

    @property
    def nodes(self) -> Sequence[ChurnNode]: ...

    @property
    def apis(self) -> list[str]: ...

    @property
    def peer_ids(self) -> list[str]: ...

    def start_node(self, i: int) -> bool: ...

    def wait_ready(self, i: int, timeout_s: float = 120.0) -> None: ...

    def leave(self, i: int, *, kill: bool = False) -> None: ...

    def add_new_node(self, i: int) -> object: ...


class NodePool:
    """Nodes a client may send to (index = node number of the trial), see the module doc."""

    def __init__(
        self,
        apis: Sequence[str],
        peer_ids: Sequence[str],
        models: Sequence[str] | None = None,
    ) -> None:
        self.apis = list(apis)
        self.peer_ids = list(peer_ids)
        self.models = list(models) if models else []
        self.up = [True] * len(self.apis)
        self.avoid_until: dict[int, float] = {}  # node -> monotonic time: refused a connection

    def __len__(self) -> int:
        return len(self.apis)

    def live(self) -> list[int]:
        now = time.monotonic()
        return [k for k, up in enumerate(self.up) if up and self.avoid_until.get(k, 0) <= now]

    def set_down(self, k: int) -> None:
        self.up[k] = False

    def note_unreachable(self, k: int) -> None:
        """A connection to node k was refused: avoid it for ``AVOID_S`` (it may be gone, or
        only too busy to accept; the churn task marks it down for good once it is gone)."""
        self.avoid_until[k] = time.monotonic() + AVOID_S

    def set_up(self, k: int, api: str, peer_id: str) -> None:
        if k == len(self.apis):
            self.apis.append(api)
            self.peer_ids.append(peer_id)
            self.up.append(True)
            return
        self.apis[k], self.peer_ids[k], self.up[k] = api, peer_id, True
        self.avoid_until.pop(k, None)

    def model(self, k: int) -> str:
        return self.models[k] if k < len(self.models) else self.models[0]

    def pick(self, planned: int, i: int, tried: Sequence[int]) -> int | None:
        """The planned node while it is up and untried, else a live one chosen by ``i``."""
        live = self.live()
        if planned in live and planned not in tried:
            return planned
        fresh = [k for k in live if k not in tried] or live
        return fresh[(i + len(tried)) % len(fresh)] if fresh else None


class _Retryable(Exception):
    """The attempt got no answer and the node cannot still be producing one for us."""

    def __init__(self, outcome: str, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.unreachable = unreachable


async def _attempt(
    client: httpx.AsyncClient, url: str, body: dict, stream: bool, timeout_s: float
) -> tuple[dict, float | None]:
    t0 = time.perf_counter()
    try:
        with trio.fail_after(timeout_s):
            if stream:
                return await driver._send_streamed(client, url, body, t0)
            return await driver._send_plain(client, url, body)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise _Retryable("refused", f"{type(exc).__name__}: {exc}", unreachable=True) from None
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
        # the node accepted the request and its connection broke before an answer: it died
        raise _Retryable("dropped", f"{type(exc).__name__}: {exc}") from None
    except driver._HttpStatus as exc:
        if str(exc).startswith("HTTP 503"):
            raise _Retryable("503", str(exc)[:300]) from None
        raise


def _overlay_fallbacks(answer: dict[str, Any]) -> tuple[bool | None, list[str]]:
    routing = (answer.get("p2pnode") or {}).get("routing") or {}
    if not isinstance(routing, dict):
        return None, []
    failed = [
        str(a.get("outcome"))
        for a in routing.get("attempts") or []
        if isinstance(a, dict) and a.get("outcome") != "ok"
    ]
    return routing.get("fell_back"), failed


async def drive_with_retries(
    pool: NodePool,
    requests: Sequence[driver.PlannedRequest],
    workload: Workload,
    *,
    max_duration_s: float,
    retries: int = 3,
    stream: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Send the planned requests to a changing set of nodes (module doc)."""
    limits = httpx.Limits(max_connections=workload.concurrency * 2 + 8)
    timeout = httpx.Timeout(workload.request_timeout_s, connect=5.0)
    records: list[dict[str, Any] | None] = [None] * len(requests)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if not pool.models:
            pool.models = await driver.model_names(pool.apis[:1], client)
        slots = trio.Semaphore(workload.concurrency)
        start = trio.current_time()

        async def one(p: driver.PlannedRequest, ready: float, holding: bool) -> None:
            if not holding:
                await slots.acquire()
            try:
                rec = await _with_retries(p)
            finally:
                slots.release()
            rec["client_wait_s"] = round(rec.pop("_first_sent") - ready, 4)
            records[p.i] = rec
            if on_record is not None:
                on_record(rec)

        async def _with_retries(p: driver.PlannedRequest) -> dict[str, Any]:
            tried: list[int] = []
            attempts: list[list[Any]] = []
            first = trio.current_time()
            t0 = time.perf_counter()
            rec: dict[str, Any] | None = None
            for n in range(retries + 1):
                k = pool.pick(p.arrival_node, p.i, tried)
                if k is None:
                    rec = driver._record(p, "error", error="no live node to send to")
                    break
                tried.append(k)
                body = {
                    "model": pool.model(k),
                    "prompt": p.prompt,
                    "max_tokens": workload.max_tokens,
                    "temperature": workload.temperature,
                }
                url = pool.apis[k].rstrip("/") + "/v1/completions"
                a0 = time.perf_counter()
                try:
                    answer, ttft = await _attempt(
                        client, url, body, stream, workload.request_timeout_s + 5
                    )
                except _Retryable as exc:
                    attempts.append([k, exc.outcome, round(time.perf_counter() - a0, 4)])
                    if exc.unreachable:
                        pool.note_unreachable(k)
                    rec = driver._record(p, "error", error=str(exc)[:300])
                    await trio.sleep(RETRY_BACKOFF_S * (n + 1))
                    continue
                except (trio.TooSlowError, httpx.TimeoutException):
                    attempts.append([k, "timeout", round(time.perf_counter() - a0, 4)])
                    rec = driver._record(p, "timeout", error="no answer in time")
                    break
                except (httpx.HTTPError, driver._HttpStatus, ValueError, KeyError) as exc:
                    attempts.append([k, "error", round(time.perf_counter() - a0, 4)])
                    rec = driver._record(p, "error", error=str(exc)[:300])
                    break
                attempts.append([k, "ok", round(time.perf_counter() - a0, 4)])
                ids = list(pool.peer_ids)
                index_of = {pid: j for j, pid in enumerate(ids)}
                sent = replace(p, arrival_node=k)
                rec = driver._answered(sent, answer, ttft, time.perf_counter() - t0, ids, index_of)
                rec["fell_back"], rec["forward_failures"] = _overlay_fallbacks(answer)
                break
            assert rec is not None
            rec["planned_node"] = p.arrival_node
            rec["attempts"] = attempts
            rec["answers"] = sum(a[1] == "ok" for a in attempts)
            rec["sent_s"] = round(first - start, 4)
            rec["_first_sent"] = first
            return rec

        await driver.dispatch(requests, one, slots, start, max_duration_s)
    out = []
    for p, rec in zip(requests, records, strict=True):
        if rec is None:
            rec = driver._record(p, "not_sent", error=f"trial stopped after {max_duration_s:g} s")
            rec.update(planned_node=p.arrival_node, attempts=[], answers=0)
            if on_record is not None:
                on_record(rec)
        out.append(rec)
    return out


# --------------------------------------------------------------------------- the churn task


@dataclass
class DepartureWatch:
    """How long the surviving nodes kept using a peer that left (from the churn event)."""

    node: int
    peer_id: str
    action: str
    at_s: float
    down_everywhere_s: float | None = None  # every survivor sees it down (or forgot it)
    views_gone_s: float | None = None  # no survivor holds a cache view of it any more
    stuck: list[str] = field(default_factory=list)  # survivors still using it at the limit


async def _statuses(client: httpx.AsyncClient, apis: list[str]) -> list[dict | None]:
    out: list[dict | None] = [None] * len(apis)

    async def one(j: int) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            out[j] = (await client.get(apis[j] + "/status", timeout=5.0)).json()

    async with trio.open_nursery() as nursery:
        for j in range(len(apis)):
            nursery.start_soon(one, j)
    return out


async def _watch_departure(pool: NodePool, watch: DepartureWatch, t_event: float) -> None:
    """Poll the survivors' ``/status`` until none sees ``watch.peer_id`` up or holds its view."""
    async with httpx.AsyncClient() as client:
        deadline = trio.current_time() + WATCH_LIMIT_S  # from when the node is gone
        while trio.current_time() < deadline:
            # the departed node may have rejoined (same peer id): then stop watching
            if pool.up[watch.node] and pool.peer_ids[watch.node] == watch.peer_id:
                return
            survivors = [k for k in pool.live() if k != watch.node]
            statuses = await _statuses(client, [pool.apis[k] for k in survivors])
            up_at, views_at = [], []
            for k, st in zip(survivors, statuses, strict=True):
                if st is None:
                    continue
                states = {p.get("peer_id"): p.get("state") for p in st.get("peers", [])}
                if states.get(watch.peer_id) == "up":
                    up_at.append(f"node{k}")
                if watch.peer_id in ((st.get("routing") or {}).get("views") or {}):
                    views_at.append(f"node{k}")
            now = round(trio.current_time() - t_event, 2)
            if not up_at and watch.down_everywhere_s is None:
                watch.down_everywhere_s = now
            if not views_at and watch.views_gone_s is None:
                watch.views_gone_s = now
            if watch.down_everywhere_s is not None and watch.views_gone_s is not None:
                return
            watch.stuck = sorted(set(up_at) | set(views_at))
            await trio.sleep(WATCH_POLL_S)


async def run_churn(
    trial: ChurnTrial,
    pool: NodePool,
    start: float,
    *,
    watches: list[DepartureWatch] | None = None,
    applied: list[dict[str, Any]] | None = None,
    nursery: trio.Nursery | None = None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> None:
    """Apply ``trial.spec.churn`` at ``start + at_s`` (trio clock); see the module doc.

    Each event runs in its own task, so a slow start (a join waits for the node's API) never
    delays later events; events on the same node keep their order. Departure watches run in
    ``nursery`` when given (so they may outlive the events), else here.
    """
    locks: dict[int, trio.Lock] = {}

    async def apply(event: ChurnEvent, lock: trio.Lock, watch_nursery: trio.Nursery) -> None:
        async with lock:
            t_event = trio.current_time()
            done = {"at_s": event.at_s, "action": event.action, "node": event.node}
            if applied is not None:
                applied.append(done)
            if event.action == "join":
                trial.start_node(event.node)  # here: stopping the trial then stops it too
                # a slow start must not hold the trial open after its last request
                await trio.to_thread.run_sync(trial.wait_ready, event.node, abandon_on_cancel=True)
                node = trial.nodes[event.node]
                pool.set_up(event.node, node.api, node.peer_id)
                took = trio.current_time() - t_event
                done["done_after_s"] = round(took, 2)
                log(f"  [{trial.arm}] node{event.node} serves after {took:.1f} s")
                return
            peer_id = pool.peer_ids[event.node]
            kill = event.action == "kill"
            await trio.to_thread.run_sync(lambda: trial.leave(event.node, kill=kill))
            pool.set_down(event.node)
            done["done_after_s"] = round(trio.current_time() - t_event, 2)
            log(
                f"  [{trial.arm}] node{event.node} gone after {trio.current_time() - t_event:.1f} s"
            )
            if watches is not None:
                watch = DepartureWatch(event.node, peer_id, event.action, event.at_s)
                watches.append(watch)
                watch_nursery.start_soon(_watch_departure, pool, watch, t_event)

    async with trio.open_nursery() as own:
        for event in trial.spec.churn:
            await trio.sleep_until(start + event.at_s)
            now = trio.current_time() - start
            log(f"  [{trial.arm}] churn at {now:.1f} s: node{event.node} {event.action}")
            if event.action == "join" and event.node == len(trial.nodes):
                trial.add_new_node(event.node)  # here, in order: indices are handed out in turn
            lock = locks.setdefault(event.node, trio.Lock())
            own.start_soon(apply, event, lock, nursery or own)


# --------------------------------------------------------------------------- summary


def churn_summary(
    records: Sequence[dict[str, Any]],
    events: Sequence[ChurnEvent],
    watches: Sequence[DepartureWatch] = (),
    applied: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Lost/duplicate/retry counts and the latency impact of churn (module doc)."""
    ok = [r for r in records if r["status"] == "ok"]
    times = [e.at_s for e in events]

    def near(r: dict[str, Any]) -> bool:
        sent = r.get("sent_s")
        return sent is not None and any(t <= sent <= t + WINDOW_S for t in times)

    def lat(rs: list[dict[str, Any]]) -> dict[str, Any]:
        xs = [r["latency_s"] for r in rs]
        mean = sum(xs) / len(xs) if xs else None
        p95 = driver.percentile(xs, 95)
        return {
            "n": len(xs),
            "mean": round(mean, 4) if mean is not None else None,
            "p95": round(p95, 4) if p95 is not None else None,
        }

    retried = [r for r in records if len(r.get("attempts") or []) > 1]
    outcomes: dict[str, int] = {}
    for r in records:
        for _, outcome, _ in (r.get("attempts") or [])[:-1]:
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    fwd_fail: dict[str, int] = {}
    for r in ok:
        for outcome in r.get("forward_failures") or []:
            fwd_fail[outcome] = fwd_fail.get(outcome, 0) + 1
    return {
        "events": [[e.at_s, e.action, e.node] for e in events],
        "applied": list(applied),  # done_after_s: gone / serving that long after the event
        "lost": len(records) - len(ok),
        "lost_ids": [r["i"] for r in records if r["status"] != "ok"][:20],
        "duplicates": sum((r.get("answers") or 0) > 1 for r in records),
        "retried": len(retried),
        "retry_causes": outcomes,
        "retried_latency_s": lat([r for r in retried if r["status"] == "ok"]),
        "overlay_fallbacks": sum(bool(r.get("fell_back")) for r in ok),
        "forward_failures": fwd_fail,
        "latency_near_churn_s": lat([r for r in ok if near(r)]),
        "latency_away_from_churn_s": lat([r for r in ok if not near(r)]),
        "departures": [vars(w) for w in watches],
    }


def max_nodes(spec: Any) -> int:
    """Node indices a churn trial can reach (initial nodes and every new one)."""
    return spec.node_count + len(spec.churn_new_nodes())


__all__ = [
    "ChurnTrial",
    "DepartureWatch",
    "NodePool",
    "WINDOW_S",
    "churn_summary",
    "drive_with_retries",
    "max_nodes",
    "run_churn",
]
