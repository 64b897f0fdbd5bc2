"""Two models in one swarm and a light entry node, across real ``p2pnode`` processes.

A closed network on loopback, started with the commands a user types: ``p2pnode bootstrap``,
``p2pnode invite``, ``p2pnode join --bootstrap INVITE`` (the default model, SmolLM2-135M),
``p2pnode join --bootstrap INVITE --model gemma-3-270m-q4_k_m.gguf`` and ``p2pnode client
--bootstrap INVITE``. The client runs no model: it fetches each model's tokenizer from a node
that serves it, routes requests to the peers, and never imports torch. Every answer must
equal that model's plain-transformers greedy output (the reference of tests/inference), for
completions and chat, streamed and not; every node lists both models; an unknown model gets
404 naming them. (The Gemma GGUF comes from the registry packages ``make setup`` installs.)

Cache-aware routing from a light node: a second SmolLM2 server joins a swarm whose first
server holds a long system prompt; every request with that system prompt entering at the
light node goes to the server holding it and is served from its cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from p2pnode.inference.blockhash import BLOCK_SIZE, block_hashes, model_salt
from p2pnode.inference.models import load_light_model
from p2pnode.inference.textfront import TextFront
from p2pnode.overlay.routing.placement import placement_key, rendezvous_rank
from p2pnode.overlay.routing.router import RouterConfig

from testkit import models, wait_until_blocking

P2PNODE = [sys.executable, "-m", "p2pnode.bootstrap.cli"]
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name one prime number."}]
NEW_TOKENS = 8
# A light node parses a model's tokenizer on that model's first request (overlay/serve/swarm.py).
# Asked for SmolLM2 only it holds ~120 MB: ~100 MB of interpreter and libraries (py-libp2p's
# imports alone ~65 MB) and ~20 MB for SmolLM2's 49k-token tokenizer; Gemma's 262k-token
# tokenizer adds ~75 MB (tokenizers' BPE: the vocabulary both ways and 515k merges), so with
# both parsed it holds ~190 MB (docs/models.md): the bound leaves room for that, not a model.
LIGHT_RSS_LIMIT = 200 * 2**20


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return models.gemma_gguf()


def _ask(api: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(api + path, json=body, timeout=300.0)


def _stream_text(api: str, path: str, body: dict) -> str:
    parts = []
    with httpx.stream("POST", api + path, json={**body, "stream": True}, timeout=300.0) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            parts.append(
                choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            )
    return "".join(parts)


def _answer(api: str, model: str, chat: bool, stream: bool) -> str:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": NEW_TOKENS, "temperature": 0}
    body |= {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    if stream:
        return _stream_text(api, path, body)
    r = _ask(api, path, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def _models(api: str) -> dict[str, dict]:
    data = httpx.get(api + "/v1/models", timeout=5.0).json()["data"]
    return {card["id"]: card["p2pnode"] for card in data}


def _process(api: str) -> dict:
    """The node's own figures: resident memory, heavy modules imported."""
    return httpx.get(api + "/status", timeout=5.0).json()["process"]


def _tokenizer_folders(home: Path) -> list[str]:
    """The tokenizers a light node fetched (an unfinished fetch writes a ``.tmp-`` folder)."""
    folder = home / "tokenizers"
    return (
        sorted(p.name for p in folder.iterdir() if ".tmp-" not in p.name) if folder.exists() else []
    )


def _lists(api: str, models: set[str]) -> bool:
    try:
        return set(_models(api)) == models
    except httpx.HTTPError:  # not answering yet
        return False


@pytest.mark.slow
def test_a_light_client_answers_for_two_models(tmp_path, node_processes, gemma_gguf):
    smol_id, smol_text = models.reference(None, PROMPT, NEW_TOKENS)
    _, smol_chat = models.reference(None, MESSAGES, NEW_TOKENS)
    gemma_id, gemma_text = models.reference(gemma_gguf, PROMPT, NEW_TOKENS)

    boot_home = tmp_path / "boot"
    boot = node_processes.spawn(["bootstrap"], boot_home)
    node_processes.runtime(boot_home, boot)
    out = subprocess.run(
        [*P2PNODE, "invite", "--home", str(boot_home), "--uses", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    invite = out.stdout.strip()
    homes = {n: tmp_path / n for n in ("smol", "gemma", "light")}
    procs = {
        "smol": node_processes.spawn(["join", "--bootstrap", invite], homes["smol"]),
        "gemma": node_processes.spawn(
            ["join", "--bootstrap", invite, "--model", str(gemma_gguf)], homes["gemma"]
        ),
        "light": node_processes.spawn(["client", "--bootstrap", invite], homes["light"]),
    }
    apis = {n: node_processes.runtime(homes[n], p, timeout=300)["api"] for n, p in procs.items()}
    both = {smol_id, gemma_id}

    def logs() -> str:
        return "\n".join(
            f"--- {n}\n{(h / 'node.log').read_text()[-2000:]}" for n, h in homes.items()
        )

    for name, api in apis.items():
        wait_until_blocking(
            lambda a=api: _lists(a, both), 240, f"{name} lists both", step_s=1.0, detail=logs
        )
    listing = _models(apis["light"])
    assert listing[smol_id] == {"model_id": smol_id, "nodes": 1, "local": False}
    assert listing[gemma_id]["nodes"] == 1 and not listing[gemma_id]["local"]
    assert _models(apis["smol"])[smol_id]["local"] and not _models(apis["smol"])[gemma_id]["local"]

    # Each server's first request, on its own node (see tests/system/test_models_netns.py).
    for name, model in (("smol", smol_id), ("gemma", gemma_id)):
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "p2pnode": {"private": True}}
        assert _ask(apis[name], "/v1/completions", body).status_code == 200

    light = apis["light"]
    for stream in (False, True):
        assert _answer(light, smol_id, chat=False, stream=stream) == smol_text
        assert _answer(light, smol_id, chat=True, stream=stream) == smol_chat
    # Both tokenizers fetched into the home, only SmolLM2's parsed (no request for Gemma yet).
    wait_until_blocking(
        lambda: len(_tokenizer_folders(homes["light"])) == 2, 120, "both tokenizers fetched"
    )
    process = _process(light)
    print(f"light node, SmolLM2's tokenizer parsed: {process['rss_bytes'] / 2**20:.0f} MB resident")
    assert process["rss_bytes"] < LIGHT_RSS_LIMIT, process
    for stream in (False, True):
        assert _answer(light, gemma_id, chat=False, stream=stream) == gemma_text
    # A node serving one model answers for the other one through its peer.
    assert _answer(apis["smol"], gemma_id, chat=False, stream=False) == gemma_text
    assert _answer(apis["gemma"], smol_id, chat=True, stream=False) == smol_chat

    r = _ask(light, "/v1/completions", {"model": smol_id, "prompt": PROMPT, "max_tokens": 2})
    assert (
        r.headers["x-p2pnode-served-by"]
        != json.loads((homes["light"] / "runtime.json").read_text())["peer_id"]
    )
    # The Gemma GGUF carries no chat template: a chat for it is refused as on its own node.
    for api in (light, apis["gemma"]):
        r = _ask(api, "/v1/chat/completions", {"model": gemma_id, "messages": MESSAGES})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"], r.text
    r = _ask(light, "/v1/completions", {"model": "no-such-model", "prompt": PROMPT})
    assert r.status_code == 404, r.text
    message = r.json()["error"]["message"]
    assert smol_id in message and gemma_id in message

    # The light node: tokenizers cached in its home, checked against the ids; no torch.
    assert len(_tokenizer_folders(homes["light"])) == 2
    process = _process(light)
    assert process["heavy_modules"] == [], process
    print(f"light node, both tokenizers parsed: {process['rss_bytes'] / 2**20:.0f} MB resident")
    assert process["rss_bytes"] < LIGHT_RSS_LIMIT, process


# A shared system prompt of ~980 SmolLM2 tokens: served from its holder's cache it saves a cold
# prefill of seconds, far more than the learned network cost of a forward can add on a loaded
# machine (capped at 20 round trips plus the request's bytes: overlay/routing/netcost.py).
SYSTEM_BODY = "You answer every question in one word. " * 120
QUESTIONS = ("Name one prime number.", "Name one colour.", "Name one planet.", "Name one ocean.")
SYSTEM_VARIANTS = 64  # two of them homed on the second server: all but certain


def _chat(variant: int, question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Variant {variant}. {SYSTEM_BODY}"},
        {"role": "user", "content": question},
    ]


def _shared_blocks(front: TextFront, variant: int) -> int:
    """Full blocks of prompt tokens that the chats of every question with that system share."""
    a, b = (front.encode_chat(_chat(variant, q)) for q in QUESTIONS[:2])
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // BLOCK_SIZE


def _homed_variants(front: TextFront, home: str, other: str) -> list[int]:
    """The system prompt variants whose placement home (where a prompt that no candidate holds
    is sent: overlay/routing/placement.py) is ``home`` rather than ``other``."""
    salt, blocks = model_salt(front.model_id), RouterConfig().placement_blocks
    homed = []
    for variant in range(SYSTEM_VARIANTS):
        key = placement_key(
            block_hashes(front.encode_chat(_chat(variant, QUESTIONS[0])), salt), blocks
        )
        if rendezvous_rank(key, home) > rendezvous_rank(key, other):
            homed.append(variant)
    return homed


def _chat_answer(api: str, variant: int, question: str) -> httpx.Response:
    # One token: the choice of server and its cache are the subject, and each gap between
    # tokens is a chance for a starved process on this shared machine to outlast the
    # forward's idle timeout (2 s).
    body = {"messages": _chat(variant, question), "max_tokens": 1, "temperature": 0}
    return _ask(api, "/v1/chat/completions", body)


class _Holders:
    """The servers holding one system prompt, and the check that each request goes to one."""

    def __init__(
        self, api: str, variant: int, blocks: int, holders: set[str], idle: Callable[[], None]
    ) -> None:
        self.api, self.variant, self.blocks, self.holders = api, variant, blocks, holders
        self.idle = idle

    def ask(self, question: str, *, cold: bool = False) -> dict:
        self.idle()
        r = _chat_answer(self.api, self.variant, question)
        assert r.status_code == 200, r.text
        info = r.json()["p2pnode"]
        routing = info["routing"]
        assert r.headers["x-p2pnode-served-by"] == info["served_by"]
        assert routing["chosen"] in self.holders, (question, routing, self.holders)
        # A forward that fails midway (a peer starved past its timeout) goes on at another
        # server, which then holds the prompt too: only the router's choice is checked then.
        if not routing["fell_back"]:
            assert info["served_by"] == routing["chosen"], info
            assert cold or info["cached_tokens"] >= self.blocks * BLOCK_SIZE, (question, info)
        self.holders |= {a["target"] for a in routing["attempts"]}
        return info


def _invite(boot_home: Path, uses: int) -> str:
    argv = [*P2PNODE, "invite", "--home", str(boot_home), "--uses", str(uses)]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


@pytest.mark.slow
def test_a_light_client_sends_a_shared_system_prompt_to_its_holder(tmp_path, node_processes):
    front = TextFront(load_light_model(None))  # SmolLM2's tokenizer: prompts and their blocks
    model = front.model_id
    boot_home = tmp_path / "boot"
    node_processes.runtime(boot_home, node_processes.spawn(["bootstrap"], boot_home))
    invite = _invite(boot_home, uses=3)
    homes = {n: tmp_path / n for n in ("first", "second", "light")}
    # The second server's peer id before it starts (`p2pnode id` makes its key, as on any host):
    # the system prompt is picked so that, held by nobody, it would be placed on the second.
    out = subprocess.run(
        [*P2PNODE, "id", "--home", str(homes["second"])],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    second = out.stdout.split("peer id: ", 1)[1].split()[0]
    procs = {
        "first": node_processes.spawn(["join", "--bootstrap", invite], homes["first"]),
        "light": node_processes.spawn(["client", "--bootstrap", invite], homes["light"]),
    }
    apis = {n: node_processes.runtime(homes[n], p, timeout=300)["api"] for n, p in procs.items()}
    first = json.loads((homes["first"] / "runtime.json").read_text())["peer_id"]
    light = apis["light"]

    def logs() -> str:
        return "\n".join(
            f"--- {n}\n{(h / 'node.log').read_text()[-3000:]}"
            for n, h in homes.items()
            if (h / "node.log").exists()
        )

    def views() -> dict[str, dict]:
        return httpx.get(light + "/status", timeout=5.0).json()["routing"]["views"]

    wait_until_blocking(
        lambda: _lists(light, {model}), 240, "the light node lists SmolLM2", step_s=1.0, detail=logs
    )
    # Each server's first request, on its own node (see tests/system/test_models_netns.py).
    warm = {"prompt": "Hello", "max_tokens": 2, "p2pnode": {"private": True}}
    assert _ask(apis["first"], "/v1/completions", warm).status_code == 200

    # Where a prompt that nobody holds goes is its rendezvous home among the servers
    # (placement), so a prompt homed on the second server shows that its holder's cache, not
    # placement, draws it to the first.
    held, fresh = _homed_variants(front, home=second, other=first)[:2]
    blocks = _shared_blocks(front, held)
    # The system prompt, twice through the light node while the first server is the only one:
    # it is cached there and advertised in its digests (a block is advertised once two requests
    # used it: advertise_min_uses). With no other server to fall back to, a forward that a
    # starved process lets time out fails: such a request is sent again.
    for question in QUESTIONS[:2]:
        wait_until_blocking(
            lambda q=question: _chat_answer(light, held, q).status_code == 200,
            300,
            f"the first server answers {question!r} through the light node",
            step_s=1.0,
            detail=logs,
        )

    procs["second"] = node_processes.spawn(["join", "--bootstrap", invite], homes["second"])
    api_second = node_processes.runtime(homes["second"], procs["second"], timeout=300)["api"]
    assert _ask(api_second, "/v1/completions", warm).status_code == 200

    def both_in_view() -> bool:
        try:
            seen = views()
        except httpx.HTTPError:
            return False
        holder_blocks = seen.get(first, {}).get("blocks", 0)
        return seen.get(second, {}).get("model") == model and holder_blocks >= blocks

    wait_until_blocking(
        both_in_view,
        300,
        "the light node's views: the second server, and the first holding the system prompt",
        step_s=1.0,
        detail=lambda: f"{views()}\n{logs()}",
    )

    def idle() -> None:
        """Every request is sent once the light node's views show both servers idle: the
        cache decides between equals. (A digest issued while a forward was running still
        shows its work queued for up to a gossip round after it finished.)"""

        def both_idle() -> bool:
            seen = views()
            loads = [seen.get(p, {}) for p in (first, second)]
            return all(v.get("queue_depth") == 0 and v.get("est_wait_s") == 0 for v in loads)

        wait_until_blocking(
            both_idle, 120, "both servers idle in the light node's views", step_s=0.25
        )

    # Nothing but routed requests changes the servers' caches here: the light node is the only
    # origin of forwarded answers and, running no model, audits none (a node that runs the
    # model scores a sample of its peers' answers on a third peer, or itself, which leaves the
    # prompt in that cache too). So the first server holds the prompt and the second does not.
    prompt = _Holders(light, held, blocks, {first}, idle)
    for question in QUESTIONS:
        prompt.ask(question)

    # A second system prompt, new to both: its first request goes where placement sends it,
    # and every later one follows it there.
    other = _Holders(light, fresh, _shared_blocks(front, fresh), {first, second}, idle)
    placed = other.ask(QUESTIONS[0], cold=True)["routing"]["attempts"]
    other.holders = {a["target"] for a in placed}
    for question in QUESTIONS[1:]:
        other.ask(question)
    # Both prompts again, interleaved: each still goes to its holder.
    for question in QUESTIONS[:2]:
        prompt.ask(question)
        other.ask(question)
    print(f"holders: first prompt {prompt.holders}, second prompt {other.holders}")
