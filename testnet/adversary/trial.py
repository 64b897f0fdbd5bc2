"""Adversaries for tests, benches and trials: peers that serve wrong answers for others.

Contract: ``make_adversary(service, kind, rate=..., other=None)`` turns what ``service``
serves to PEERS into lies (its own local requests stay honest, as a careful liar's would):

- ``"wrong-output"``: every ``round(1 / rate)``-th token it serves is replaced by another id
  (deterministic: a counter over everything it serves);
- ``"random-text"``: every token is a random id (seeded);
- ``"other-model"``: the answer comes from ``other`` (an engine on other weights claiming the
  same model id); without one (emulated compute) from a different deterministic function of
  the input, the emulated stand-in for other weights;
- ``"fake-cache"``: honest answers, forged cache and speed claims (``forge_liar``; needs
  ``victim``, a peer whose view it steals).

It swaps the engine behind ``service.server`` for a ``LyingEngine`` that delegates everything
but ``stream``. Used by tests and benchmarks; never by a node.

In a trial (``[[adversary]]`` of the spec), ``install(service, nursery, kind, rate=...)`` is
the hook a trial node runs once its service is up (``testnet/run/node.py``): the answer liars as
above; ``"fake-cache"`` by ``keep_forging``, which every ``interval_s`` re-forges a digest of
every prefix its views say other peers hold, on top of its own (caches fill during a trial,
so one theft at start would claim little), with 10x speeds and an empty queue. ``forge=True``
gives an answer liar that forged digest too: a tempting peer that lies about what it serves.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from typing import Any

import trio

KINDS = ("wrong-output", "random-text", "other-model", "fake-cache")


class _LyingStream:
    def __init__(self, inner: Any, lie: Any, prompt: list[int]) -> None:
        self._inner = inner
        self._lie = lie
        self._seq = list(prompt)

    @property
    def result(self) -> Any:
        return self._inner.result

    def __aiter__(self) -> _LyingStream:
        return self

    async def __anext__(self) -> int:
        token = await self._inner.__anext__()
        out = self._lie(self._seq, token)
        self._seq.append(out)
        return out

    async def aclose(self) -> None:
        await self._inner.aclose()


class LyingEngine:
    """Delegates to ``engine``; ``stream`` answers through ``lie(sequence_so_far, token)``."""

    def __init__(self, engine: Any, kind: str, *, rate: float = 0.05, other: Any = None) -> None:
        if kind not in KINDS or kind == "fake-cache":
            raise ValueError(f"kind {kind!r}: LyingEngine serves {KINDS[:3]}")
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self._engine = engine
        self.kind = kind
        self.every = max(1, round(1 / rate))
        self.other = other
        self.served_tokens = 0
        self.lies = 0
        self._rng = random.Random(zlib.crc32(kind.encode()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stream(self, prompt_ids: Sequence[int], params: Any = None) -> Any:
        if self.kind == "other-model" and self.other is not None:
            return self.other.stream(prompt_ids, params)
        inner = self._engine.stream(prompt_ids, params)
        return _LyingStream(inner, self._lie, list(prompt_ids))

    def _lie(self, seq: list[int], token: int) -> int:
        self.served_tokens += 1
        vocab = int(self._engine.vocab_size)
        if self.kind == "random-text":
            out = self._rng.randrange(vocab)
        elif self.kind == "other-model":  # emulated: another deterministic model
            out = zlib.crc32(f"other:{len(seq)}:{seq[-1]}".encode()) % vocab
        elif self.served_tokens % self.every == 0:
            out = (token + 1 + self._rng.randrange(vocab - 1)) % vocab
        else:
            out = token
        self.lies += out != token
        return out


def make_adversary(
    service: Any,
    kind: str,
    *,
    rate: float = 0.05,
    other: Any = None,
    victim: str | None = None,
    prefill_s: float | None = None,
    decode_s: float | None = None,
) -> LyingEngine | None:
    """See the module contract; returns the ``LyingEngine`` (None for ``fake-cache``)."""
    if kind == "fake-cache":
        from p2pnode.testing.localcluster import forge_liar

        if victim is None or prefill_s is None or decode_s is None:
            raise ValueError("fake-cache needs victim, prefill_s and decode_s")
        forge_liar(service, victim, prefill_s=prefill_s, decode_s=decode_s)
        return None
    if service.server is None:
        raise ValueError("the service runs no engine: it serves nothing to lie about")
    liar = LyingEngine(service.server.engine, kind, rate=rate, other=other)
    service.server.engine = liar
    return liar


def forge_union(service: Any, forged: Any | None = None, *, speedup: float = 10) -> Any | None:
    """One forgery round of ``keep_forging``: the builder that now claims every prefix the
    service's views say other peers hold, on top of its own (the most tempting digest; a
    forward for a prefix it lacks fails the origin's claim check); None while it holds no
    view of another peer yet."""
    from p2pnode.overlay.cache.digest import DigestBuilder, LoadInfo, fingerprint

    me, model = service.node.peer_id, service.model_id
    views = [v for v in service.views.views() if v.model_id == model and v.peer_id != me]
    if not views:
        return forged
    fp_bits = views[0].fp_bits
    if forged is None or forged.fp_bits != fp_bits:
        cost = service.engine.cost
        lie = LoadInfo(
            prefill_s_per_token=cost.prefill_s_per_token / speedup,
            decode_s_per_token=cost.decode_s_per_token / speedup,
        )
        forged = DigestBuilder(me, model, fp_bits=fp_bits)
        forged.load_fn = lambda: lie
        service.antientropy.builders[model] = forged
    own = {fingerprint(h, fp_bits) for h in service.engine.cached_block_hashes()}
    stolen = {fp for v in views if v.fp_bits == fp_bits for fp in v.fingerprints} | own
    # Only fingerprints travel: forge 64-bit "hashes" whose top bits are the stolen ones.
    forged.sync(fp << (64 - fp_bits) for fp in stolen)
    return forged


async def keep_forging(service: Any, *, interval_s: float = 1.0, speedup: float = 10) -> None:
    forged = None
    while True:
        forged = forge_union(service, forged, speedup=speedup)
        await trio.sleep(interval_s)


def install(
    service: Any, nursery: trio.Nursery, kind: str, *, rate: float = 0.05, forge: bool = False
) -> None:
    """Make a trial node's running ``service`` an adversary of ``kind`` (module contract);
    ``forge``: an answer liar that also forges its digest as fake-cache does (the tempting
    peer that draws prompts to lie about)."""
    if kind not in KINDS:
        raise ValueError(f"adversary kind {kind!r}: use one of {', '.join(KINDS)}")
    if kind == "fake-cache" or forge:
        interval = getattr(service.antientropy.config, "interval_s", 1.0)
        nursery.start_soon(lambda: keep_forging(service, interval_s=interval))
    if kind != "fake-cache":
        make_adversary(service, kind, rate=rate)
