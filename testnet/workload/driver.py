"""Workload driver and collector: MMLU requests to nodes through their public HTTP API only.

Contract:
- ``build_requests(workload, seed, n_nodes) -> list[PlannedRequest]``: the trial's request
  sequence, a pure function of (workload, seed, n_nodes): subject by popularity (``uniform``, or
  ``zipf``: rank k of the listed subjects has weight ``1 / k**s``), question uniform in that
  subject's pool, arrival node uniform, and for ``poisson`` the send time (exponential gaps at
  ``rate_per_s``). Both arms of a trial replay the same sequence.
- ``await drive(apis, requests, workload, ...) -> list[dict]``: sends each request to its
  arrival node's ``POST /v1/completions`` (``apis`` = base URLs, e.g. nodes started by hand in
  several regions), at most ``concurrency`` in flight, within ``max_duration_s`` in all; returns
  exactly one record per planned request, in plan order, including the ones that failed or were
  never sent (``status`` "ok" | "error" | "timeout" | "not_sent"). Record fields: ``i,
  subject, question, arrival_node, served_by (peer id), served_node (index or None),
  forwarded, prompt_tokens, cached_tokens, latency_s, ttft_s (streamed requests only),
  scheduled_s, sent_s, client_wait_s, correct, routing_reason, text (the answer kept),
  route_attempts ([target peer id or "local", outcome] per routing attempt), error``, and
  for answered requests ``client_retries`` (connection errors before the answer, each sent
  again once on a fresh connection: ``CLIENT_RETRIES``).
- ``await node_ids(apis)`` maps each API to its peer id (``GET /status``); with ``model=None``
  each request names the model its arrival node lists first in ``GET /v1/models``.
- ``summarize(records, n_nodes) -> dict``: counts, mean/p50/p90/p95/p99 latency, hit rate
  (cached / prompt tokens over answered requests), load share per node and the busiest node's
  share, forwarded fraction, accuracy, throughput; when records carry ``oracle_cached`` also
  ``hit_rate_ceiling`` (oracle cached / prompt tokens) and ``hit_of_ceiling`` (cached / oracle).
- ``oracle_cached(prompts) -> list[int]``: per prompt (token ids, plan order) the tokens ONE
  unbounded cache that had served every earlier prompt would reuse: the longest common prefix
  with any earlier prompt, at most ``len - 1`` (the last token is always computed). No node
  placement or eviction can reuse more, so its sum bounds the token hit rate of any routing:
  each question's own text after its subject's shared few-shot prefix is a miss the first time.
  ``oracle_cached(prompts, answers)`` also caches each prompt's answer after it (chat turns).
- ``latency_floor_s(records, speeds, max_tokens)``: the mean latency the answered requests would
  have if each ran alone, with no network and no queue, on an engine holding the one unbounded
  cache of ``oracle_cached``: ``overhead + (prompt - oracle) * prefill + completion * decode``
  at the calibrated ``speeds`` (``completion_tokens``, else ``max_tokens``). Prefill and decode
  only lengthen when requests share an engine, so no placement or routing can bring an arm's
  mean below it; over the baseline's mean it is the smallest ratio a trial can show.
- ``write_jsonl(path, records)``; ``on_record`` is called after each record (progress bars).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import trio

from p2pnode.errors import P2PNodeError
from p2pnode.testnet.spec import Workload

STATUS_TIMEOUT_S = 10.0


class DriverError(P2PNodeError, RuntimeError):
    """The workload cannot be driven (a node does not answer /status, bad plan)."""

    reason = "driver_failed"


@dataclass(frozen=True)
class PlannedRequest:
    i: int
    subject: str
    question: int
    prompt: str
    answer: str
    arrival_node: int
    at_s: float | None  # send time from the start (poisson); None: as soon as a slot frees


def subject_list(workload: Workload) -> list[str]:
    from p2pnode.datasets import mmlu

    if isinstance(workload.subjects, int):
        return mmlu.subjects()[: workload.subjects]
    known = set(mmlu.subjects())
    unknown = [s for s in workload.subjects if s not in known]
    if unknown:
        raise DriverError(
            f"unknown MMLU subject(s) {unknown}; see p2pnode.datasets.mmlu.subjects()"
        )
    return list(workload.subjects)


def popularity_weights(workload: Workload, n: int) -> list[float]:
    if workload.popularity == "zipf":
        return [1.0 / (k**workload.zipf_s) for k in range(1, n + 1)]
    return [1.0] * n


def build_requests(workload: Workload, seed: int, n_nodes: int) -> list[PlannedRequest]:
    from p2pnode.datasets import mmlu

    if n_nodes < 1:
        raise DriverError("the workload needs at least one node API")
    rng = random.Random(seed)
    subjects = subject_list(workload)
    pools = {s: list(mmlu.questions([s], workload.per_subject)) for s in subjects}
    weights = popularity_weights(workload, len(subjects))
    t = 0.0
    out = []
    for i in range(workload.requests):
        subject = rng.choices(subjects, weights)[0]
        q = rng.choice(pools[subject])
        node = rng.randrange(n_nodes)
        at: float | None = None
        if workload.arrival == "poisson":
            t += rng.expovariate(workload.rate_per_s)
            at = t
        out.append(PlannedRequest(i, subject, q.index, q.prompt, q.answer, node, at))
    return out


async def node_ids(apis: Sequence[str], client: httpx.AsyncClient | None = None) -> list[str]:
    """Peer id of each API's node, in order (`DriverError` naming the node that fails)."""
    own = client is None
    client = client or httpx.AsyncClient(timeout=STATUS_TIMEOUT_S)
    try:
        ids = []
        for api in apis:
            try:
                response = await client.get(api.rstrip("/") + "/status")
                response.raise_for_status()
                ids.append(str(response.json()["peer_id"]))
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                raise DriverError(f"node API {api} did not give its peer id: {exc!r}") from None
        return ids
    finally:
        if own:
            await client.aclose()


async def model_names(apis: Sequence[str], client: httpx.AsyncClient) -> list[str]:
    """The model id each node serves (first of ``GET /v1/models``), in API order."""
    names = []
    for api in apis:
        try:
            response = await client.get(api.rstrip("/") + "/v1/models")
            response.raise_for_status()
            names.append(str(response.json()["data"][0]["id"]))
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise DriverError(f"node API {api} lists no model in /v1/models: {exc!r}") from None
    return names


RECORD_FIELDS = (
    "served_by",
    "served_node",
    "forwarded",
    "prompt_tokens",
    "cached_tokens",
    "latency_s",
    "ttft_s",
    "scheduled_s",
    "sent_s",
    "client_wait_s",
    "correct",
    "routing_reason",
    "oracle_cached",
    "completion_tokens",
    "error",
)


def blank_record(status: str, **fields: Any) -> dict[str, Any]:
    """A request record with every field a summary reads (None when unknown)."""
    return {"status": status, **dict.fromkeys(RECORD_FIELDS), **fields}


def _record(p: PlannedRequest, status: str, **fields: Any) -> dict[str, Any]:
    base = {"i": p.i, "subject": p.subject, "question": p.question, "arrival_node": p.arrival_node}
    return {**base, **blank_record(status, scheduled_s=p.at_s), **fields}


# A connection error before any answer is sent once more on a fresh connection, as OpenAI's
# own client does (it retries twice): on a starved machine httpx's pool hands out a keep-alive
# connection that is already broken ("another task closed this fd"). The record keeps each
# retried error and the latency includes the retry.
CLIENT_RETRIES = 1


async def _send(
    client: httpx.AsyncClient, url: str, body: dict, t0: float, stream: bool, retried: list[str]
) -> tuple[dict, float | None]:
    for attempt in range(CLIENT_RETRIES + 1):
        try:
            if stream:
                return await _send_streamed(client, url, body, t0)
            return await _send_plain(client, url, body)
        except httpx.TimeoutException:
            raise
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            if attempt == CLIENT_RETRIES:
                raise
            retried.append(f"{type(exc).__name__}: {exc}"[:200])
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _send_plain(client: httpx.AsyncClient, url: str, body: dict) -> tuple[dict, None]:
    response = await client.post(url, json=body)
    if response.status_code != 200:
        raise _HttpStatus(response.status_code, response.text[:300])
    return response.json(), None


async def _send_streamed(
    client: httpx.AsyncClient, url: str, body: dict, t0: float
) -> tuple[dict, float | None]:
    """OpenAI SSE chunks -> a body shaped like the non-streamed one, plus time to first token."""
    ttft = None
    text = ""
    merged: dict[str, Any] = {}
    async with client.stream(
        "POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as response:
        if response.status_code != 200:
            raise _HttpStatus(response.status_code, (await response.aread()).decode()[:300])
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise _HttpStatus(200, json.dumps(chunk["error"])[:300])
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += choice["text"]
            for key in ("usage", "p2pnode"):
                if chunk.get(key):
                    merged[key] = chunk[key]
    merged["choices"] = [{"text": text}]
    return merged, ttft


class _HttpStatus(Exception):
    """A non-200 answer. Control flow of the request loops here and in ``churn.py``, which
    always catch it, so it stays off the ``P2PNodeError`` root."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")


async def dispatch(
    requests: Sequence[PlannedRequest],
    one: Callable[[PlannedRequest, float, bool], Awaitable[None]],
    slots: trio.Semaphore,
    start: float,
    max_duration_s: float,
) -> None:
    """Start ``one(request, ready_time, holding_slot)`` for every request: at its planned time
    (open loop, ``at_s`` set) or, closed loop, once a concurrency slot frees (the slot is then
    held for it). Everything still running after ``max_duration_s`` is cancelled."""
    with trio.move_on_after(max_duration_s):
        async with trio.open_nursery() as nursery:
            for p in requests:
                holding = False
                if p.at_s is not None:
                    await trio.sleep_until(start + p.at_s)
                else:
                    await slots.acquire()
                    holding = True
                nursery.start_soon(one, p, trio.current_time(), holding)


async def drive(
    apis: Sequence[str],
    requests: Sequence[PlannedRequest],
    workload: Workload,
    *,
    max_duration_s: float,
    peer_ids: Sequence[str] | None = None,
    stream: bool = False,
    model: str | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Send the planned requests; one record per request, in plan order (see module doc)."""
    if any(not 0 <= p.arrival_node < len(apis) for p in requests):
        raise DriverError(f"a planned request arrives at a node beyond the {len(apis)} APIs")
    limits = httpx.Limits(max_connections=workload.concurrency * 2 + 8)
    timeout = httpx.Timeout(workload.request_timeout_s, connect=10.0)
    records: list[dict[str, Any] | None] = [None] * len(requests)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        ids = list(peer_ids) if peer_ids is not None else await node_ids(apis, client)
        index_of = {pid: k for k, pid in enumerate(ids)}
        models = [model] * len(apis) if model else await model_names(apis, client)
        # a Semaphore, not a CapacityLimiter: in closed loop the sender takes the slot and the
        # request's task gives it back
        slots = trio.Semaphore(workload.concurrency)
        start = trio.current_time()

        async def one(p: PlannedRequest, ready: float, holding: bool) -> None:
            url = apis[p.arrival_node].rstrip("/") + "/v1/completions"
            body = {
                "model": models[p.arrival_node],
                "prompt": p.prompt,
                "max_tokens": workload.max_tokens,
                "temperature": workload.temperature,
            }
            acquired = holding
            try:
                if not holding:
                    await slots.acquire()
                    acquired = True
                sent = trio.current_time()
                t0 = time.perf_counter()
                retried: list[str] = []
                try:
                    with trio.fail_after(workload.request_timeout_s + 5):
                        answer, ttft = await _send(client, url, body, t0, stream, retried)
                    latency = time.perf_counter() - t0
                    rec = _answered(p, answer, ttft, latency, ids, index_of)
                    rec["client_retries"] = retried
                except (trio.TooSlowError, httpx.TimeoutException):
                    rec = _record(p, "timeout", error="no answer in time")
                except (httpx.HTTPError, _HttpStatus, ValueError, KeyError, TypeError) as exc:
                    rec = _record(p, "error", error=str(exc)[:300])
            finally:
                if acquired:
                    slots.release()
            rec["sent_s"] = round(sent - start, 4)
            rec["client_wait_s"] = round(sent - ready, 4)
            records[p.i] = rec
            if on_record is not None:
                on_record(rec)

        await dispatch(requests, one, slots, start, max_duration_s)
    out = []
    for p, rec in zip(requests, records, strict=True):
        if rec is None:
            rec = _record(p, "not_sent", error=f"trial stopped after {max_duration_s:g} s")
            if on_record is not None:
                on_record(rec)
        out.append(rec)
    return out


def _answered(
    p: PlannedRequest,
    answer: dict[str, Any],
    ttft: float | None,
    latency: float,
    ids: Sequence[str],
    index_of: dict[str, int],
) -> dict[str, Any]:
    info = answer.get("p2pnode") or {}
    usage = answer.get("usage") or {}
    served_by = info.get("served_by")
    served_node = index_of.get(served_by) if isinstance(served_by, str) else None
    text = ""
    choices = answer.get("choices") or []
    if choices:
        text = str(choices[0].get("text", ""))
    routing = info.get("routing") or {}
    tried = routing.get("attempts") if isinstance(routing, dict) else None
    return _record(
        p,
        "ok",
        served_by=served_by,
        served_node=served_node,
        forwarded=(served_by != ids[p.arrival_node]) if served_by else None,
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=info.get("cached_tokens"),
        latency_s=round(latency, 5),
        ttft_s=round(ttft, 5) if ttft is not None else None,
        correct=text.strip()[:1] == p.answer,
        routing_reason=routing.get("reason") if isinstance(routing, dict) else None,
        text=text,
        route_attempts=[[a.get("target"), a.get("outcome")] for a in tried]
        if isinstance(tried, list)
        else None,
    )


# --------------------------------------------------------------------------- summary


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def oracle_cached(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]] | None = None
) -> list[int]:
    """Cached tokens of one unbounded cache that served every earlier prompt (module doc);
    with ``answers`` (per prompt, the tokens generated after it) it also holds each answer
    once its prompt was served, as an engine's cache does: a chat's next turn reuses it."""
    trie: dict[int, dict] = {}
    out = []
    for k, ids in enumerate(prompts):
        node, depth = trie, 0
        for tok in ids:
            child = node.get(tok)
            if child is None:
                break
            node, depth = child, depth + 1
        out.append(max(0, min(depth, len(ids) - 1)))
        served = list(ids) + (list(answers[k]) if answers is not None else [])
        for tok in served[depth:]:
            node = node.setdefault(tok, {})
    return out


class EngineSpeeds(Protocol):
    """Per-token speeds of one engine (``inference.costmodel.Calibration`` is one)."""

    @property
    def prefill_s_per_token(self) -> float: ...
    @property
    def decode_s_per_token(self) -> float: ...
    @property
    def overhead_s(self) -> float: ...


def latency_floor_s(
    records: Sequence[dict[str, Any]], speeds: EngineSpeeds, max_tokens: int
) -> float | None:
    """Mean latency of the answered requests alone at the oracle cache (module contract);
    None when some answered record has no ``oracle_cached`` (no tokenizer loaded)."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok or any(r.get("oracle_cached") is None for r in ok):
        return None
    total = 0.0
    for r in ok:
        new = r["prompt_tokens"] - r["oracle_cached"]
        out = r.get("completion_tokens")
        out = max_tokens if out is None else out
        total += (
            speeds.overhead_s + new * speeds.prefill_s_per_token + out * speeds.decode_s_per_token
        )
    return round(total / len(ok), 4)


def summarize(records: Sequence[dict[str, Any]], n_nodes: int) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "ok"]
    lat = [r["latency_s"] for r in ok]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    has_oracle = bool(ok) and all(r.get("oracle_cached") is not None for r in ok)
    oracle = sum(r["oracle_cached"] for r in ok) if has_oracle else None
    served = [0] * n_nodes
    unknown_server = 0
    for r in ok:
        if r["served_node"] is None:
            unknown_server += 1
        else:
            served[r["served_node"]] += 1
    shares = [s / len(ok) if ok else 0.0 for s in served]
    known_fwd = [r for r in ok if r["forwarded"] is not None]
    span = max((r["sent_s"] + r["latency_s"] for r in ok), default=0.0)
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1

    def rnd(x: float | None, nd: int = 4) -> float | None:
        return round(x, nd) if x is not None else None

    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    return {
        "requests": len(records),
        "answered": len(ok),
        "statuses": statuses,
        "client_retried": sum(1 for r in ok if r.get("client_retries")),
        "latency_s": {
            "mean": rnd(sum(lat) / len(lat)) if lat else None,
            "p50": rnd(percentile(lat, 50)),
            "p90": rnd(percentile(lat, 90)),
            "p95": rnd(percentile(lat, 95)),
            "p99": rnd(percentile(lat, 99)),
            "max": rnd(max(lat, default=None)),
        },
        "ttft_s": {"mean": rnd(sum(ttft) / len(ttft)) if ttft else None},
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": rnd(cached / prompt) if prompt else None,
        "hit_rate_ceiling": rnd(oracle / prompt) if oracle is not None and prompt else None,
        "hit_of_ceiling": rnd(cached / oracle) if oracle else None,
        "served_per_node": served,
        "load_share": [rnd(s) for s in shares],
        "max_share": rnd(max(shares, default=0.0)),
        "unknown_server": unknown_server,
        "forwarded_fraction": (
            rnd(sum(bool(r["forwarded"]) for r in known_fwd) / len(known_fwd))
            if known_fwd
            else None
        ),
        "accuracy": rnd(sum(bool(r["correct"]) for r in ok) / len(ok)) if ok else None,
        "throughput_rps": rnd(len(ok) / span) if span > 0 else None,
        "client_wait_s_mean": rnd(sum(r["client_wait_s"] or 0 for r in ok) / len(ok))
        if ok
        else None,
    }


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
