"""Two models and a light node behind NAT, on namespace hosts (needs root: namespaces).

Four hosts (testnet/netns/namespaces.py), started as users start them, with default flags and
the invite of a closed network: ``p2pnode bootstrap`` on ``boot``; ``p2pnode join --invite``
serving SmolLM2 (the default model) on ``smol`` and Gemma-3-270m (``--model FILE.gguf``) on
``gemma``; ``p2pnode client --bootstrap INVITE`` on ``light``, behind a NAT router. The light node answers
completions and chat for both models, streamed and not, each answer equal to that model's
plain-transformers greedy output; every node with an API for models (not the discovery-only
bootstrap) lists both; an unknown model gets 404
naming them; the light node never imports torch and parses a tokenizer only when its model
is asked for. Every namespace and process is removed at the
end, also on failure.
"""

from __future__ import annotations

import json
import sys

import pytest

from p2pnode.testnet.netns.namespaces import Testbed, require_netns
from p2pnode.testnet.netns.swarm import API, NetnsSwarm

from testkit import models, wait_until_blocking

HOSTS = {"boot": "public", "smol": "public", "gemma": "public", "light": "nat"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name one prime number."}]
NEW_TOKENS = 8
# With one tokenizer parsed and with both (see tests/system/test_swarm_models.py).
LIGHT_RSS_LIMIT = 200 * 2**20

# A POST inside a namespace: the status and the answer's text (a stream's deltas joined).
_POST = """
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode(), headers={"content-type": "application/json"})
try:
    r = urllib.request.urlopen(req, timeout=300)
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "error": json.loads(e.read())["error"]}))
    sys.exit(0)
raw = r.read().decode()
if not json.loads(body).get("stream"):
    c = json.loads(raw)["choices"][0]
    print(json.dumps({"status": 200, "text": c["message"]["content"] if "message" in c else c["text"]}))
    sys.exit(0)
parts = []
for line in raw.splitlines():
    if line.startswith("data: {"):
        c = json.loads(line[6:])["choices"][0]
        parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
print(json.dumps({"status": 200, "text": "".join(parts)}))
"""


@pytest.fixture
def testbed():
    reason = require_netns()
    if reason is not None:
        pytest.skip(reason)
    with Testbed(HOSTS) as bed:
        yield bed


def _post(swarm: NetnsSwarm, host: str, path: str, body: dict) -> dict:
    argv = [sys.executable, "-c", _POST, API + path, json.dumps(body)]
    return json.loads(swarm.testbed.run(host, argv, timeout=330))


def _listed(swarm: NetnsSwarm, host: str) -> dict[str, dict]:
    try:
        return {c["id"]: c["p2pnode"] for c in swarm.get(host, "/v1/models")["data"]}
    except Exception:  # not answering yet (any failure of the call inside the namespace)
        return {}


@pytest.mark.slow
def test_a_light_node_behind_nat_answers_for_two_models(testbed, tmp_path):
    gguf = models.gemma_gguf()
    smol_id, smol_text = models.reference(None, PROMPT, NEW_TOKENS)
    _, smol_chat = models.reference(None, MESSAGES, NEW_TOKENS)
    gemma_id, gemma_text = models.reference(gguf, PROMPT, NEW_TOKENS)

    swarm = NetnsSwarm(testbed, tmp_path)
    swarm.start_bootstrap("boot")  # a closed network, as a user starts one
    swarm.start_join("smol", model="default")
    swarm.start_join("gemma", model=str(gguf))
    swarm.start_client("light")

    def logs() -> str:
        return "\n".join(f"--- {h}\n{swarm.log(h, 1500)}" for h in HOSTS)

    both = {smol_id, gemma_id}
    for host in ("smol", "gemma", "light"):  # the bootstrap is discovery-only: no models
        wait_until_blocking(
            lambda h=host: set(_listed(swarm, h)) == both,
            300,
            f"{host} lists both models",
            step_s=2.0,
            detail=logs,
        )
    listing = _listed(swarm, "light")
    assert listing[smol_id]["nodes"] == 1 and listing[gemma_id]["nodes"] == 1
    assert not listing[smol_id]["local"] and not listing[gemma_id]["local"]
    assert swarm.status("light")["reachability"]["verdict"] != "public"

    # Each server's first request, on its own node: a fresh process pays one-off costs on its
    # first answer, and on this shared 2-core machine one such stall outlasted the forward's
    # idle timeout (2 s) once; the light node's answers below are what the test checks.
    for host, model in (("smol", smol_id), ("gemma", gemma_id)):
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "p2pnode": {"private": True}}
        assert _post(swarm, host, "/v1/completions", body)["status"] == 200

    def check(model: str, path: str, prompt: dict, want: str) -> None:
        for stream in (False, True):
            body = {"model": model, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": stream}
            got = _post(swarm, "light", path, body | prompt)
            assert got == {"status": 200, "text": want}, (model, path, stream, logs())

    check(smol_id, "/v1/completions", {"prompt": PROMPT}, smol_text)
    check(smol_id, "/v1/chat/completions", {"messages": MESSAGES}, smol_chat)
    # Both tokenizers fetched, only SmolLM2's parsed: a tokenizer is parsed on its model's first
    # request (an unfinished fetch writes a ``.tmp-`` folder).
    folder = swarm.home("light") / "tokenizers"
    wait_until_blocking(
        lambda: (
            folder.exists() and len([p for p in folder.iterdir() if ".tmp-" not in p.name]) == 2
        ),
        120,
        "both tokenizers fetched",
    )
    process = swarm.status("light")["process"]
    print(f"light node, SmolLM2's tokenizer parsed: {process['rss_bytes'] / 2**20:.0f} MB resident")
    assert process["rss_bytes"] < LIGHT_RSS_LIMIT, process
    check(gemma_id, "/v1/completions", {"prompt": PROMPT}, gemma_text)

    unknown = _post(swarm, "light", "/v1/completions", {"model": "nope", "prompt": PROMPT})
    assert unknown["status"] == 404 and unknown["error"]["code"] == "model_not_found"
    assert smol_id in unknown["error"]["message"] and gemma_id in unknown["error"]["message"]

    process = swarm.status("light")["process"]
    assert process["heavy_modules"] == [], process
    print(f"light node, both tokenizers parsed: {process['rss_bytes'] / 2**20:.0f} MB resident")
    assert process["rss_bytes"] < LIGHT_RSS_LIMIT, process
