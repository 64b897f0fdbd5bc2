"""Python API for edge apps: speculative generation against verifiers found through the overlay.

Contract:
- ``async with open_edge(bootstrap=[MULTIADDR, ...]) as edge:`` joins the overlay as role
  "edge" (or uses ``node=`` an overlay node you already run), loads the W4A16 draft (building it
  once if needed, see ``draft.load_draft``) and serves the draft's target model id.
- ``await edge.find_verifiers()`` -> peer ids that provide the model in the DHT AND whose signed
  node record has the "verifier" role, lowest ping RTT first (unknown RTT last). ``verifiers=``
  given to ``open_edge`` fixes the list and order instead (tests, pinned deployments).
- ``await edge.generate(prompt_or_messages, max_tokens=64, temperature=0.0, mode="async")`` ->
  ``EdgeResult`` (text, token ids, acceptance, tokens/s, verifiers used). A ``str`` prompt is
  wrapped in the chat template as one user turn; a list of ``{"role", "content"}`` dicts is
  used as is; a list of ints is sent as token ids. ``mode="sync"`` drafts, waits, verifies;
  ``"async"`` keeps 2 blocks of 4 drafts in flight and lets the verifier decode on its own
  (lead, up to 8 tokens) while a rejection's correction travels (see
  ``edge.speculative_generate``; ``gamma=`` overrides the per-mode block size);
  ``"remote"`` is target-only remote generation (the verifier streams the target's tokens, no
  draft): the fastest choice where the draft is barely cheaper than the target. ``"auto"``
  measures: its first requests try "async" then "remote", later ones use the faster (tokens/s,
  smoothed per mode in ``edge.mode_rates``) and retry the other every ``AUTO_EXPLORE``-th time;
  ``EdgeResult.mode`` says which ran.
- ``edge.stream(...)``: same arguments, an async iterator of text pieces as tokens are committed.
- Failover: when a verifier dies, hangs past ``result_timeout_s`` or refuses mid-session, the
  edge opens a new session on the next verifier from prompt + the tokens already committed, so a
  greedy output is the same as without the failure. With no verifier left it raises
  ``NoVerifier`` (the message lists what each one answered). Caller mistakes (``BadRequest``,
  ``BadBlock``, ``SessionLimit``) are raised at once, not retried.
- ``await edge.audit(result)``: a second opinion on a greedy result; a verifier that answered
  plausibly but wrongly is blamed once a third one confirms it (``speculation._audit``). A
  sampled result takes ``scorer=`` (the target's ``Scorer``): its likelihood under the target
  must be plausible (a z-test with a stated false-alarm rate, ``speculation._audit``).
- Trust: a verifier whose verdict is impossible (``BadVerdict``: see
  ``overlay.trust.verdict_problem``) is failed over like a dead one and loses trust in
  ``edge.trust`` (a ``TrustBook``); a demoted verifier is left out of ``find_verifiers`` until
  its trust recovers.

One file of ~500 lines: failover, the "auto" mode choice and spare streams all act on one
request in ``EdgeClient.generate``; ``open_edge`` and ``run_edge_cli`` are its thin doors.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import trio

from p2pnode.inference.scoring import Scorer
from p2pnode.overlay.cache.antientropy import AntiEntropy
from p2pnode.overlay.cache.views import PeerViews
from p2pnode.overlay.routing.router import rtt_from_peer_table
from p2pnode.overlay.serve.failover import Continuation
from p2pnode.overlay.trust.book import TrustBook
from p2pnode.speculation._audit import audit_result, audit_sampled
from p2pnode.speculation._blocks import SamplingOptions
from p2pnode.speculation._errors import BadBlock, BadRequest, BadVerdict, NoVerifier, SessionLimit
from p2pnode.speculation._flight import DraftHistory, finished, trim
from p2pnode.speculation.advert import rank_verifiers, verify_digest_model
from p2pnode.speculation.draft import DraftModel, load_draft
from p2pnode.speculation.edge import (
    DraftPrefix,
    SpecResult,
    SpecStats,
    remote_generate,
    speculative_generate,
)
from p2pnode.speculation.protocol import (
    OPEN_TIMEOUT_S,
    P2PVerifierTransport,
    drop_stream,
    open_spare,
)

log = logging.getLogger(__name__)
# mode -> (blocks in flight, draft tokens per block, verifier lead). Async: with the verifier's
# lead filling the round trip after each rejection, 2 blocks of 4 measured best at 0-100 ms RTT
# (bench/speculation_processes.py; without lead, 3 blocks of 2 were best, as a block built on a
# guess survives with probability alpha^(gamma+1)); on its tuning prompts (--prompt-set tune)
# 3x4, 3x2, 2x3 and 4x2 came within run-to-run noise of it. Sync pays a round trip per block:
# gamma 4.
MODES = {"sync": (1, 4, 0), "async": (2, 4, 8), "remote": (0, 0, 0)}
AUTO_MODES = ("async", "remote")
AUTO_EXPLORE = 8  # every 8th "auto" request retries the slower mode (load and peers change)
# A spare stream is used only while the verifier still waits for its open (OPEN_TIMEOUT_S).
SPARE_MAX_AGE_S = OPEN_TIMEOUT_S * 2 / 3
_CALLER_ERRORS = (BadRequest, BadBlock, SessionLimit)


@dataclass
class EdgeResult:
    text: str
    tokens: list[int]
    stats: SpecStats = field(default_factory=SpecStats)
    verifiers: list[str] = field(default_factory=list)  # in the order they were used
    seconds: float = 0.0
    warm: bool = False  # the first session started on a spare stream (no stream negotiation)
    mode: str = ""  # the mode that ran ("auto" resolved)
    prompt_ids: list[int] = field(default_factory=list)
    greedy: bool = True
    temperature: float = 0.0  # the sampling it was asked for (a sampled audit tests against it)
    top_p: float = 1.0
    starts: list[int] = field(default_factory=list)  # tokens index where each verifier began

    def producer_of(self, index: int) -> str:
        """The verifier that committed ``tokens[index]`` (failover splits a result)."""
        owner = self.verifiers[0]
        for start, peer in zip(self.starts, self.verifiers, strict=True):
            if start <= index:
                owner = peer
        return owner

    @property
    def failovers(self) -> int:
        return max(len(self.verifiers) - 1, 0)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.stats.acceptance


class EdgeClient:
    def __init__(
        self,
        node,
        draft: DraftModel,
        *,
        verifiers: Sequence[str] | None = None,
        gamma: int | None = None,
        result_timeout_s: float = 30.0,
        trust: TrustBook | None = None,
        views: PeerViews | None = None,
    ) -> None:
        self.node = node
        # Verifiers' digests (speculation/advert.py), when this edge follows them: the choice
        # weighs what each verifier has cached and its queue against its RTT.
        self.views = views
        # Trust hook (overlay/trust/book.py): impossible verdicts count against a verifier; demoted
        # verifiers are left out of find_verifiers until their trust recovers.
        self.trust = trust if trust is not None else TrustBook()
        self.draft = draft
        self.model_id = draft.target_model_id
        self.tokenizer = draft.tokenizer
        self.gamma = gamma
        self.result_timeout_s = result_timeout_s
        self._fixed = list(verifiers) if verifiers is not None else None
        self._spares: dict[str, tuple[object, float]] = {}  # peer -> (stream, opened at)
        self.mode_rates: dict[str, float] = {}  # "auto": smoothed tokens/s per mode
        self._auto_runs = 0
        # Per verifier: whether drafting pays depends on its round trip and its speed.
        self.histories: dict[str, DraftHistory] = {}
        self.draft_prefix = DraftPrefix()  # the last prompt's draft KV (a shared system prompt)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = (eos,) if isinstance(eos, int) else ()

    def rank(self, peers: list[str], prompt_ids: list[int]) -> list[str]:
        """``peers`` best first for this prompt: by RTT + queue + uncached prefill when the
        verifiers' digests are followed, else by RTT."""
        if self.views is None:
            return peers
        return rank_verifiers(
            peers, prompt_ids, self.model_id, self.views, rtt_from_peer_table(self.node.peers)
        )

    async def find_verifiers(self) -> list[str]:
        if self._fixed is not None:
            return [
                p
                for p in self._fixed
                if self.node.peers.state(p) != "down" and self.trust.usable(p)
            ]
        providers: list[str] = []
        with trio.move_on_after(10):  # a slow DHT walk must not stall the request forever
            providers = await self.node.find_providers(self.model_id)
        found = []
        for pid in dict.fromkeys(providers):
            if pid == self.node.peer_id:
                continue
            entry = self.node.peers.get(pid)
            record = entry.record if entry is not None else None
            if record is None:
                with trio.move_on_after(5):
                    record = await self.node.get_node_record(pid)
            if record is not None and "verifier" in record.roles and self.trust.usable(pid):
                rtt = entry.rtt_ms if entry is not None and entry.rtt_ms is not None else math.inf
                found.append((rtt, pid))
        return [pid for _, pid in sorted(found)]

    def encode(self, prompt: str | list[dict] | list[int]) -> list[int]:
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if not prompt or not all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt
        ):
            raise BadRequest("prompt must be text, a list of {role, content} messages or token ids")
        enc = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"])

    async def generate(
        self,
        prompt: str | list[dict] | list[int],
        max_tokens: int = 64,
        temperature: float = 0.0,
        *,
        top_p: float = 1.0,
        seed: int | None = None,
        mode: str = "async",
        _sink: trio.MemorySendChannel | None = None,
    ) -> EdgeResult:
        if mode not in MODES and mode != "auto":
            raise BadRequest(f"mode must be one of {sorted([*MODES, 'auto'])}, got {mode!r}")
        auto, mode = mode == "auto", self._pick_mode() if mode == "auto" else mode
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        options = SamplingOptions(temperature, top_p, seed)
        ids = self.encode(prompt)
        answer = Continuation(ids, max_tokens)
        result = EdgeResult(
            "",
            [],
            verifiers=answer.targets,
            prompt_ids=ids,
            greedy=options.greedy,
            temperature=float(temperature),
            top_p=float(top_p),
            mode=mode,
            starts=answer.starts,
        )
        started = time.perf_counter()

        def on_commit(new: list[int]) -> None:
            answer.add(new)
            if _sink is not None:
                _sink.send_nowait(list(new))

        while not finished(answer.delivered, max_tokens, self.eos_token_ids):
            peer = await self._next_verifier(answer)
            answer.begin(peer)
            transport = P2PVerifierTransport(
                self.node,
                peer,
                self.model_id,
                result_timeout_s=self.result_timeout_s,
                spare=await self._take_spare(peer),
            )
            failure: Exception | None = None
            async with trio.open_nursery() as side:
                side.start_soon(self._refill_spare, peer)  # for the next request to this peer
                try:
                    r = await self._session(
                        transport, mode, answer.context, answer.remaining, options, on_commit
                    )
                except Exception as exc:  # handled below, outside the nursery
                    failure = exc
                    side.cancel_scope.cancel()
            if len(answer.targets) == 1:
                result.warm = transport.used_spare
            if isinstance(failure, _CALLER_ERRORS):
                raise failure
            if failure is not None:  # dead, hung or refusing verifier
                log.info("verifier %s failed (%r); failing over", peer, failure)
                if isinstance(failure, BadVerdict):
                    self.trust.observe_fault(peer)
                answer.fail(peer, repr(failure)[:200])
                continue
            self._add(result.stats, r.stats)
            break
        result.tokens = trim(answer.delivered, max_tokens, self.eos_token_ids)
        result.text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        result.seconds = time.perf_counter() - started
        result.stats.seconds = result.seconds
        if auto and result.tokens:
            old = self.mode_rates.get(mode)
            rate = result.tokens_per_s
            self.mode_rates[mode] = rate if old is None else old + 0.5 * (rate - old)
        return result

    async def _next_verifier(self, answer: Continuation) -> str:
        """The best verifier for what is left of the request that has not failed it yet."""
        found = await self.find_verifiers()
        candidates = self.rank([p for p in found if p not in answer.failures], answer.context)
        if not candidates:
            why = "; ".join(f"{p[-8:]}: {e}" for p, e in answer.failures.items()) or "none found"
            raise NoVerifier(
                f"no verifier for {self.model_id} could serve this request ({why}); "
                "start one with `p2pnode join --role verifier` or check --bootstrap"
            )
        return candidates[0]

    def _pick_mode(self) -> str:
        self._auto_runs += 1
        untried = [m for m in AUTO_MODES if m not in self.mode_rates]
        if untried:
            return untried[0]
        ranked = sorted(AUTO_MODES, key=lambda m: -self.mode_rates[m])
        return ranked[1] if self._auto_runs % AUTO_EXPLORE == 0 else ranked[0]

    async def audit(self, result: EdgeResult, *, scorer: Scorer | None = None, **kw):
        """Greedy: a second opinion (see ``speculation._audit``): re-verifies a window of its
        tokens on other verifiers and blames whoever was wrong in ``self.trust`` -> ``Audit``.
        Sampled: the likelihood test under the target, run by ``scorer`` (a ``Scorer`` of the
        target model, e.g. ``inference.scoring.ModelScorer``) -> ``SampledAudit``."""
        if result.greedy:
            return await audit_result(self, result, **kw)
        if scorer is None:
            raise BadRequest(
                "a sampled result is audited by its likelihood under the target: pass "
                "scorer=ModelScorer(target_model) (the draft is another distribution)"
            )
        return await trio.to_thread.run_sync(
            lambda: audit_sampled(self.trust, result, scorer, **kw)
        )

    async def _session(self, transport, mode, ids, max_tokens, options, on_commit) -> SpecResult:
        depth, gamma, lead = MODES[mode]
        if depth == 0:
            return await remote_generate(
                transport,
                ids,
                max_tokens,
                options=options,
                eos_token_ids=self.eos_token_ids,
                on_commit=on_commit,
            )
        return await speculative_generate(
            self.draft,
            transport,
            ids,
            max_tokens,
            gamma=self.gamma or gamma,
            depth=depth,
            lead=lead,
            options=options,
            eos_token_ids=self.eos_token_ids,
            on_commit=on_commit,
            history=self.histories.setdefault(transport.peer_id, DraftHistory()),
            prefix=self.draft_prefix,
        )

    async def _take_spare(self, peer: str):
        stream, opened_at = self._spares.pop(peer, (None, 0.0))
        if stream is not None and trio.current_time() - opened_at > SPARE_MAX_AGE_S:
            await drop_stream(stream)  # the verifier has dropped it or soon will
            return None
        return stream

    async def _refill_spare(self, peer: str) -> None:
        """Open the stream the next session with ``peer`` will start on (saves 2 RTT)."""
        if peer in self._spares:
            return
        with trio.move_on_after(5):
            try:
                stream = await open_spare(self.node, peer)
            except Exception as exc:  # a dead peer: the next request opens its own stream
                log.debug("no spare stream to %s: %r", peer, exc)
                return
            if peer in self._spares:  # a concurrent request refilled it first
                await drop_stream(stream)
            else:
                self._spares[peer] = (stream, trio.current_time())

    async def aclose(self) -> None:
        """Drop the spare streams (``open_edge`` calls this on exit)."""
        spares, self._spares = self._spares, {}
        for stream, _ in spares.values():
            await drop_stream(stream)

    async def stream(
        self, prompt: str | list[dict] | list[int], max_tokens: int = 64, **kw
    ) -> AsyncIterator[str]:
        """Text pieces as they are committed (same arguments as ``generate``)."""
        send, recv = trio.open_memory_channel[list[int]](math.inf)
        got: list[int] = []
        text = ""
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                async with send:
                    await self.generate(prompt, max_tokens, _sink=send, **kw)

            nursery.start_soon(run)
            async for new in recv:
                got = trim(got + new, max_tokens, self.eos_token_ids)
                full = self.tokenizer.decode(got, skip_special_tokens=True)
                if len(full) > len(text) and not full.endswith("\ufffd"):
                    yield full[len(text) :]
                    text = full

    @staticmethod
    def _add(total: SpecStats, part: SpecStats) -> None:
        for name in (
            "blocks_sent",
            "blocks_verified",
            "blocks_stale",
            "drafted",
            "accepted",
            "rejections",
            "lead_tokens",
            "lead_only",
            "keepalives",
        ):
            setattr(total, name, getattr(total, name) + getattr(part, name))


@asynccontextmanager
async def open_edge(
    bootstrap: Sequence[str] = (),
    *,
    node=None,
    draft: DraftModel | None = None,
    verifiers: Sequence[str] | None = None,
    listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
    gamma: int | None = None,
    result_timeout_s: float = 30.0,
) -> AsyncIterator[EdgeClient]:
    """An ``EdgeClient`` on a new overlay node with role "edge" (or on ``node``)."""
    async with AsyncExitStack() as stack:
        follow: AntiEntropy | None = None
        views = PeerViews()
        if draft is None:
            draft = await trio.to_thread.run_sync(load_draft)
        if node is None:
            from p2pnode.identity import NodeKey
            from p2pnode.overlay.net.node import OverlayConfig, open_overlay_node

            if not bootstrap:
                raise BadRequest(
                    "open_edge needs bootstrap=[MULTIADDR] (or node=) to find verifiers"
                )
            cfg = OverlayConfig(
                key=NodeKey.generate(),
                listen_addrs=list(listen),
                bootstrap=list(bootstrap),
                roles={"edge"},
            )
            node = await stack.enter_async_context(open_overlay_node(cfg))
            # Follow the verifiers' digests: their caches and queues decide which one to use.
            # (Only on a node of our own: a given node may run its own digest handler.)
            follow = AntiEntropy(
                node, None, views, models=[verify_digest_model(draft.target_model_id)]
            )
            await stack.enter_async_context(_running(follow))
        client = EdgeClient(
            node,
            draft,
            verifiers=verifiers,
            gamma=gamma,
            result_timeout_s=result_timeout_s,
            views=views if follow is not None else None,
        )
        try:
            yield client
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()


@asynccontextmanager
async def _running(service: AntiEntropy) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        try:
            yield
        finally:
            nursery.cancel_scope.cancel()


def run_edge_cli(
    bootstrap: list[str],
    prompt: str,
    max_tokens: int,
    mode: str,
    temperature: float,
    timeout: float,
    audit: bool = False,
) -> str:
    """``p2pnode edge``: one generation; returns the text and a stats line (blocking). With
    ``audit`` (greedy only) a second verifier re-checks up to 16 of its tokens.

    The draft runs on ONE torch thread (env ``P2PNODE_TORCH_THREADS`` overrides): torch's
    default of one thread per core made each draft step spin in OpenMP barriers whenever other
    processes held the cores: measured 650-2000 ms/token with 2 threads vs 70-90 ms with 1 at
    load ~6 (20 ms unloaded), which was the CLI's 0.3-0.4 tok/s."""
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("P2PNODE_TORCH_THREADS", "1"))))

    async def main() -> str:
        with trio.fail_after(timeout):
            async with open_edge(bootstrap) as edge:
                with trio.move_on_after(min(10.0, timeout / 2)):  # records/providers propagate
                    for _ in range(20):
                        if await edge.find_verifiers():
                            break
                        await trio.sleep(0.5)
                r = await edge.generate(prompt, max_tokens, temperature, mode=mode)
                checked = ""
                if audit:
                    try:
                        a = await edge.audit(r)
                        blamed = ", ".join(p[-8:] for p in a.blamed) or "nobody"
                        checked = (
                            f"\n[audit: {a.verdict} on tokens {a.start}..{a.start + a.checked - 1};"
                            f" blamed {blamed}]"
                        )
                    except (BadRequest, NoVerifier) as exc:
                        checked = f"\n[audit not done: {exc}]"
        return (
            f"{r.text}\n\n[{len(r.tokens)} tokens in {r.seconds:.2f} s = {r.tokens_per_s:.2f} "
            f"tok/s; acceptance {r.acceptance:.2f} over {r.stats.drafted} drafted "
            f"(per-token alpha {r.stats.alpha:.2f}); {r.stats.lead_tokens} tokens by verifier "
            f"lead; mode {mode}; "
            f"verifiers {', '.join(p[-8:] for p in r.verifiers)}]{checked}"
        )

    try:
        return trio.run(main)
    except trio.TooSlowError:
        raise NoVerifier(f"no answer within {timeout:.0f} s: is a verifier reachable?") from None
