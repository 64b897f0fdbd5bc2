"""The workload driver (testnet/workload/driver.py): its client against a real HTTP server on loopback that
drops connections (a broken connection before any answer is sent once more, and only once), and
the latency floor its summaries carry (a pure function)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest
import trio

from p2pnode.testnet.workload import driver

ANSWER = json.dumps({"choices": [{"text": " B"}]}).encode()


async def _server(drops: int, nursery: trio.Nursery) -> tuple[str, list[int]]:
    """An HTTP/1.1 server that closes its first ``drops`` connections after reading the
    request, then answers; returns its URL and a list that counts connections."""
    seen = [0]

    async def handle(conn: trio.SocketStream) -> None:
        seen[0] += 1
        k = seen[0]
        async with conn:
            data = b""
            with trio.move_on_after(5):
                while b"\r\n\r\n" not in data:
                    chunk = await conn.receive_some(65536)
                    if not chunk:
                        return
                    data += chunk
            if k <= drops:
                return  # closed without a byte of answer
            head = (
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                f"content-length: {len(ANSWER)}\r\nconnection: close\r\n\r\n"
            )
            await conn.send_all(head.encode() + ANSWER)

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/completions", seen


async def test_a_dropped_connection_is_sent_once_more_and_the_retry_is_recorded() -> None:
    async with trio.open_nursery() as nursery:
        url, seen = await _server(drops=1, nursery=nursery)
        retried: list[str] = []
        async with httpx.AsyncClient(timeout=5.0) as client:
            answer, ttft = await driver._send(client, url, {"prompt": "x"}, 0.0, False, retried)
        assert answer["choices"][0]["text"] == " B" and ttft is None
        assert seen[0] == 2 and len(retried) == 1
        nursery.cancel_scope.cancel()


async def test_a_connection_dropped_twice_is_an_error_not_a_third_send() -> None:
    async with trio.open_nursery() as nursery:
        url, seen = await _server(drops=5, nursery=nursery)
        retried: list[str] = []
        async with httpx.AsyncClient(timeout=5.0) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                await driver._send(client, url, {"prompt": "x"}, 0.0, False, retried)
        assert seen[0] == 1 + driver.CLIENT_RETRIES and len(retried) == driver.CLIENT_RETRIES
        nursery.cancel_scope.cancel()


@dataclass(frozen=True)
class Speeds:
    prefill_s_per_token: float = 0.001
    decode_s_per_token: float = 0.02
    overhead_s: float = 0.01


def _answered(prompt: int, oracle: int | None, completion: int | None) -> dict:
    return {
        "status": "ok",
        "prompt_tokens": prompt,
        "oracle_cached": oracle,
        "completion_tokens": completion,
    }


def test_the_latency_floor_is_each_answered_request_alone_at_the_oracle_cache() -> None:
    records = [
        _answered(100, 0, 4),  # a miss: 100 prefilled, 4 decoded
        _answered(100, 90, None),  # no completion count: max_tokens (2) decoded
        {"status": "timeout", "prompt_tokens": 500, "oracle_cached": 0},  # not answered
    ]
    alone = [0.01 + 100 * 0.001 + 4 * 0.02, 0.01 + 10 * 0.001 + 2 * 0.02]
    assert driver.latency_floor_s(records, Speeds(), max_tokens=2) == round(sum(alone) / 2, 4)


def test_no_latency_floor_without_the_oracle_or_an_answer() -> None:
    assert driver.latency_floor_s([_answered(100, None, 4)], Speeds(), max_tokens=1) is None
    assert driver.latency_floor_s([], Speeds(), max_tokens=1) is None
