"""Bearer-token authentication of the node's HTTP API, and the rule for where it may listen.

Contract:
- ``BearerAuth(app, api_key=...)`` is an ASGI middleware (Starlette's ``add_middleware``): every
  HTTP request must carry ``Authorization: Bearer <api_key>`` (compared in constant time) or
  it gets 401 with an OpenAI-style error body and ``www-authenticate: Bearer``; OpenAI clients
  send the header from their ``api_key`` argument. Lifespan events pass through.
- ``check_bind(host, api_key, insecure)`` raises ``ValueError`` with what to do when the API
  would listen on a non-loopback address without a key (anyone who can reach the port could
  spend this node's compute and read its status), unless ``insecure`` says that is intended.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

API_KEY_ENV = "P2PNODE_API_KEY"


class BearerAuth:
    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        if not api_key:
            raise ValueError("BearerAuth needs a non-empty api_key")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {
                "error": {
                    "message": "missing or wrong API key: send 'Authorization: Bearer <key>' "
                    f"(the node's --api-key, {API_KEY_ENV} or api_key in its config)",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, api_key: str, insecure: bool) -> None:
    if api_key or insecure or is_loopback(host):
        return
    raise ValueError(
        f"the HTTP API would listen on {host} without a key: set --api-key (or "
        f"{API_KEY_ENV}, or api_key in the config), bind it to 127.0.0.1, or pass "
        "--api-insecure if anyone who reaches that address may use this node"
    )
