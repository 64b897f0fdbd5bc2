"""Chat workload: sessions that share system prompts and grow their history turn by turn.

Contract:
- ``build_sessions(workload, seed, n_nodes) -> list[PlannedSession]``: a pure function of its
  arguments. Session ``s`` arrives at a uniform random node at a Poisson time (``rate_per_s``
  sessions a second), takes one of ``system_prompts`` system prompts by ``popularity``
  (``datasets/chat.py``), and asks ``turns`` user questions (the QA sets, each used once
  per trial) with exponential think times (mean ``think_time_s``) between an answer and the
  next question. Both arms replay the same sessions.
- ``await drive_chat(apis, sessions, workload, ...) -> list[dict]``: every session talks to its
  arrival node's ``POST /v1/chat/completions`` (the history: system prompt, earlier questions
  and the answers the node gave), at most ``concurrency`` requests in flight, within
  ``max_duration_s``. One record per planned turn, in plan order (``i = session * turns +
  turn``), with the MMLU driver's fields plus ``session, turn, system_prompt,
  history_cached`` (turn > 0: the serving node reused at least the previous turn's prompt, less
  one block for the template's boundary) and ``prompt_ids`` (dropped before records are
  written; the trial runner uses them for the hit rate ceiling, in the order turns were sent).
  A turn whose predecessor failed is ``not_sent``: its history does not exist.
- ``chat_summary(records) -> dict``: per-turn mean latency and the share of later turns whose
  history was cached, plus the serving nodes per system prompt (how many copies of each shared
  prefix the swarm kept).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from p2pnode.datasets import chat as chatdata
from p2pnode.inference.blockhash import BLOCK_SIZE
from p2pnode.testnet.spec import Workload
from p2pnode.testnet.workload.driver import DriverError, blank_record, node_ids, popularity_weights


@dataclass(frozen=True)
class PlannedSession:
    index: int
    system_prompt: int
    questions: tuple[str, ...]
    think_s: tuple[float, ...]  # before each turn after the first
    arrival_node: int
    at_s: float


def build_sessions(workload: Workload, seed: int, n_nodes: int) -> list[PlannedSession]:
    if n_nodes < 1:
        raise DriverError("the workload needs at least one node API")
    rng = random.Random(seed)
    questions = list(chatdata.user_questions())
    need = workload.sessions * workload.turns
    if need > len(questions):
        raise DriverError(f"{need} chat turns but the QA sets hold {len(questions)} questions")
    rng.shuffle(questions)
    weights = popularity_weights(workload, workload.system_prompts)
    t = 0.0
    out = []
    for s in range(workload.sessions):
        t += rng.expovariate(workload.rate_per_s)
        qs = tuple(questions[s * workload.turns : (s + 1) * workload.turns])
        think = tuple(
            rng.expovariate(1.0 / workload.think_time_s) if workload.think_time_s > 0 else 0.0
            for _ in range(workload.turns - 1)
        )
        sp = rng.choices(range(workload.system_prompts), weights)[0]
        out.append(PlannedSession(s, sp, qs, think, rng.randrange(n_nodes), t))
    return out


def _record(
    session: PlannedSession, turn: int, turns: int, status: str, **fields: Any
) -> dict[str, Any]:
    base = {
        "i": session.index * turns + turn,
        "session": session.index,
        "turn": turn,
        "system_prompt": session.system_prompt,
        "subject": f"system-{session.system_prompt}",
        "question": turn,
        "arrival_node": session.arrival_node,
        "history_cached": None,
    }
    return {**base, **blank_record(status), **fields}


async def drive_chat(
    apis: Sequence[str],
    sessions: Sequence[PlannedSession],
    workload: Workload,
    *,
    max_duration_s: float,
    peer_ids: Sequence[str] | None = None,
    model: str | None = None,
    tokenize: Callable[[list[dict[str, str]]], list[int]] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the sessions (see module doc); ``tokenize(messages)`` gives each turn's prompt ids
    as the nodes encode them (for the hit rate ceiling), when given."""
    if any(not 0 <= s.arrival_node < len(apis) for s in sessions):
        raise DriverError(f"a planned session arrives at a node beyond the {len(apis)} APIs")
    turns = workload.turns
    records: list[dict[str, Any] | None] = [None] * (len(sessions) * turns)
    limits = httpx.Limits(max_connections=workload.concurrency * 2 + 8)
    timeout = httpx.Timeout(workload.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        ids = list(peer_ids) if peer_ids is not None else await node_ids(apis, client)
        index_of = {pid: k for k, pid in enumerate(ids)}
        slots = trio.CapacityLimiter(workload.concurrency)
        start = trio.current_time()

        async def run_session(s: PlannedSession) -> None:
            await trio.sleep_until(start + s.at_s)
            url = apis[s.arrival_node].rstrip("/") + "/v1/chat/completions"
            messages = [{"role": "system", "content": system[s.system_prompt]}]
            prev_prompt = 0
            for turn, question in enumerate(s.questions):
                if turn:
                    await trio.sleep(s.think_s[turn - 1])
                messages.append({"role": "user", "content": question})
                rec, answer = await one_turn(s, turn, url, messages, prev_prompt)
                rec["prompt_ids"] = tokenize(messages) if tokenize is not None else None
                rec["sent_order"] = trio.current_time()
                records[rec["i"]] = rec
                if on_record is not None:
                    on_record(rec)
                if answer is None:
                    return
                messages.append({"role": "assistant", "content": answer})
                prev_prompt = rec["prompt_tokens"] or 0

        async def one_turn(
            s: PlannedSession, turn: int, url: str, messages: list[dict[str, str]], prev: int
        ) -> tuple[dict[str, Any], str | None]:
            body: dict[str, Any] = {
                "model": model or "",
                "messages": messages,
                "temperature": workload.temperature,
                "max_tokens": workload.max_tokens,
            }
            if not body["model"]:
                del body["model"]
            async with slots:
                sent = trio.current_time()
                t0 = time.perf_counter()
                try:
                    with trio.fail_after(workload.request_timeout_s + 5):
                        response = await client.post(url, json=body)
                    latency = time.perf_counter() - t0
                    if response.status_code != 200:
                        raise DriverError(f"HTTP {response.status_code}: {response.text[:300]}")
                    answer = response.json()
                except (trio.TooSlowError, httpx.TimeoutException):
                    return _record(s, turn, turns, "timeout", error="no answer in time"), None
                except (httpx.HTTPError, DriverError, ValueError) as exc:
                    return _record(s, turn, turns, "error", error=str(exc)[:300]), None
            info = answer.get("p2pnode") or {}
            usage = answer.get("usage") or {}
            served_by = info.get("served_by")
            cached = info.get("cached_tokens")
            text = str(((answer.get("choices") or [{}])[0].get("message") or {}).get("content", ""))
            routing = info.get("routing") or {}
            rec = _record(
                s,
                turn,
                turns,
                "ok",
                served_by=served_by,
                served_node=index_of.get(served_by) if isinstance(served_by, str) else None,
                forwarded=(served_by != ids[s.arrival_node]) if served_by else None,
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=usage.get("completion_tokens"),
                cached_tokens=cached,
                latency_s=round(latency, 5),
                sent_s=round(sent - start, 4),
                scheduled_s=round(s.at_s, 4),
                client_wait_s=0.0,
                routing_reason=routing.get("reason") if isinstance(routing, dict) else None,
                history_cached=(None if turn == 0 else (cached or 0) >= max(0, prev - BLOCK_SIZE)),
            )
            return rec, text

        system = chatdata.system_prompts(workload.system_prompts)
        with trio.move_on_after(max_duration_s):
            async with trio.open_nursery() as nursery:
                for s in sessions:
                    nursery.start_soon(run_session, s)
    out = []
    for k, rec in enumerate(records):
        if rec is None:
            s = sessions[k // turns]
            rec = _record(s, k % turns, turns, "not_sent", error="its session ended earlier")
            rec["prompt_ids"] = None
            if on_record is not None:
                on_record(rec)
        out.append(rec)
    return out


def chat_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == "ok"]
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        by_turn.setdefault(r["turn"], []).append(r["latency_s"])
    later = [r for r in ok if r["turn"] > 0]
    homes: dict[int, set[str]] = {}
    for r in ok:
        if r["served_by"]:
            homes.setdefault(r["system_prompt"], set()).add(r["served_by"])
    return {
        "turns": len(records),
        "answered_turns": len(ok),
        "latency_s_by_turn": {t: round(sum(v) / len(v), 4) for t, v in sorted(by_turn.items())},
        "history_cached_share": (
            round(sum(bool(r["history_cached"]) for r in later) / len(later), 4) if later else None
        ),
        "serving_nodes_per_system_prompt": {k: len(v) for k, v in sorted(homes.items())},
    }
