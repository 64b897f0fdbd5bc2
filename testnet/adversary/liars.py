"""What a trial's adversaries did: wrong answers kept by clients and liars demoted.

Contract:
- ``honest_texts(spec, prompt_ids, loaded=None) -> list[str] | None``: per planned request
  the text an honest node answers (greedy, emulated compute only: the emulated model's
  tokens are a function of the input, ``inference.scoring.emulated_answer``), decoded as the
  node's API decodes it (``bootstrap.api.TextAssembler``). None, with no guessing, for real
  compute or sampled workloads: there is no single honest answer to compare with then.
- ``adversary_summary(spec, records, peer_ids, homes, honest)`` -> dict:
  - ``wrong_answers``: answered requests whose text differs from the honest text (None
    without honest texts); ``wrong_by_node``: the same per serving node index;
  - ``wrong_answers_after_detection``: of those, the ones an origin kept from a liar after
    that origin had caught it: a request of that origin whose route had an ``audit_failed``
    attempt on the liar ended before this one was sent (trust is local to each origin, so
    detection is per origin; an origin that demotes a liar by a background audit or by its
    cache claims routes nothing to it afterwards, so all it kept came before);
  - per liar (``liars``, keyed by node index): kind, ``routed`` (attempts routed to it, by
    origin), ``kept`` (answers of it clients kept), ``audit_failed`` (held audits it
    failed), ``first_detected_s`` (end of the first request whose route caught it; None
    when none did), ``attempts_until_detection`` (per origin that caught it: how many of
    its attempts went to the liar up to the one that failed), ``demoted_by`` /
    ``routed_by`` (indices of the other nodes whose trust file, written at shutdown, has it
    demoted at least once / that routed to it; every other node counts as an origin: a liar
    lies only to peers, so its own clients are protected by its own, honest, origin code);
    ``caught_by``: the origins whose held audit of one of its answers failed (a liar that
    lies on some answers only may be routed to and never caught lying: nothing to catch);
    ``released_by``: the origins that passed one of its answers to a client (an attempt that
    ended ``ok``);
  - ``digest_ignored_by``: the nodes whose router stopped believing its digest (first tokens
    that contradicted its cache claims: how a fake-cache liar is caught);
  - ``liars_demoted``: liars that every origin routing to them demoted or stopped believing
    (and at least one did); ``undemoted``: the others (a liar nobody routed to is among them: nothing could
    catch it).
- ``homes`` are the nodes' home folders (their ``trust.json``, ``overlay/trust/store.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pnode.testnet.spec import TrialSpec


def honest_texts(
    spec: TrialSpec, prompt_ids: Sequence[Sequence[int]] | None, loaded: Any = None
) -> list[str] | None:
    if spec.compute != "emulated" or spec.workload.temperature != 0.0 or prompt_ids is None:
        return None
    from p2pnode.bootstrap.api import TextAssembler
    from p2pnode.inference.models import load_model
    from p2pnode.inference.scoring import emulated_answer

    if loaded is None:
        loaded = load_model(None if spec.model == "default" else spec.model)
    tok = loaded.tokenizer

    def decode(ids: Sequence[int]) -> str:  # as EngineFront.decode
        return tok.decode(list(ids), skip_special_tokens=True)

    out = []
    for ids in prompt_ids:
        text = TextAssembler(decode)
        for t in emulated_answer(
            ids, spec.workload.max_tokens, loaded.vocab_size, loaded.eos_token_ids
        ):
            text.push(t)
        text.finish()
        out.append(text.text)
    return out


def _demoted_in(home: Path, field: str = "demotions") -> dict[str, int]:
    """Peer id -> demotions (or another count of ``field``) in the node's trust file ({} when
    it has none)."""
    try:
        data = json.loads((home / "trust.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}
    peers = data.get("peers", data) if isinstance(data, dict) else {}
    return {
        str(p): int(d.get(field, 0))
        for p, d in peers.items()
        if isinstance(d, dict) and isinstance(d.get(field, 0), int)
    }


def adversary_summary(
    spec: TrialSpec,
    records: Sequence[dict[str, Any]],
    peer_ids: Sequence[str],
    homes: Sequence[Path],
    honest: Sequence[str] | None,
) -> dict[str, Any]:
    liar_nodes = {a.node: a for a in spec.adversaries}
    index_of = {pid: k for k, pid in enumerate(peer_ids)}
    ok = sorted((r for r in records if r["status"] == "ok"), key=lambda r: r["sent_s"] or 0.0)

    wrong: list[dict[str, Any]] = []
    if honest is not None:
        wrong = [r for r in ok if r.get("text") != honest[r["i"]]]

    # (origin, liar) -> end of the first request of that origin whose route caught the liar
    caught: dict[tuple[int, int], float] = {}
    until: dict[tuple[int, int], int] = {}
    routed: dict[tuple[int, int], int] = {}
    failed: dict[int, int] = {}
    released: set[tuple[int, int]] = set()  # (origin, liar): an answer of it reached a client
    for r in ok + [r for r in records if r["status"] != "ok"]:
        origin = r["arrival_node"]
        for target, outcome in r.get("route_attempts") or []:
            liar = index_of.get(target)
            if liar not in liar_nodes:
                continue
            key = (origin, liar)
            routed[key] = routed.get(key, 0) + 1
            if outcome == "ok":
                released.add(key)
            if outcome == "audit_failed":
                failed[liar] = failed.get(liar, 0) + 1
                end = (r["sent_s"] or 0.0) + (r["latency_s"] or 0.0)
                if key not in caught or end < caught[key]:
                    caught[key] = end
                    until.setdefault(key, routed[key])

    after = [
        r
        for r in wrong
        if r["served_node"] in liar_nodes
        and (r["arrival_node"], r["served_node"]) in caught
        and (r["sent_s"] or 0.0) > caught[(r["arrival_node"], r["served_node"])]
    ]
    # Every other node is an origin to a liar: a liar's own clients are served by that node's
    # honest origin code (it lies only to peers), so its audits protect them as any node's.
    demotions = {k: _demoted_in(homes[k]) for k in range(len(peer_ids))}
    ignored = {k: _demoted_in(homes[k], "digest_ignored") for k in range(len(peer_ids))}
    liars: dict[str, Any] = {}
    demoted_count = 0
    undemoted = []
    for node, adv in sorted(liar_nodes.items()):
        pid = peer_ids[node]
        routed_by = sorted(o for (o, liar) in routed if liar == node and o != node)
        demoted_by = [k for k in demotions if k != node and demotions[k].get(pid, 0) > 0]
        digest_ignored_by = [k for k in ignored if k != node and ignored[k].get(pid, 0) > 0]
        ends = [t for (o, liar), t in caught.items() if liar == node]
        liars[str(node)] = {
            "kind": adv.kind,
            "rate": adv.rate,
            "forge_digest": adv.forge_digest,
            "peer_id": pid,
            "routed": {str(o): n for (o, liar), n in sorted(routed.items()) if liar == node},
            "kept": sum(r["served_node"] == node for r in ok),
            "wrong_kept": sum(r["served_node"] == node for r in wrong),
            "audit_failed": failed.get(node, 0),
            "first_detected_s": round(min(ends), 3) if ends else None,
            "attempts_until_detection": {
                str(o): n for (o, liar), n in sorted(until.items()) if liar == node
            },
            "routed_by": routed_by,
            "demoted_by": demoted_by,
            "caught_by": sorted(o for (o, liar) in caught if liar == node),
            "released_by": sorted(o for (o, liar) in released if liar == node),
            "digest_ignored_by": digest_ignored_by,
        }
        # A fake-cache liar serves right answers: it is caught when its digest is ignored.
        stopped = sorted(set(demoted_by) | set(digest_ignored_by))
        if stopped and set(routed_by) <= set(stopped):
            demoted_count += 1
        else:
            undemoted.append(node)
    wrong_by_node = [0] * len(peer_ids)
    for r in wrong:
        if r["served_node"] is not None:
            wrong_by_node[r["served_node"]] += 1
    return {
        "wrong_answers": len(wrong) if honest is not None else None,
        "wrong_by_node": wrong_by_node if honest is not None else None,
        "wrong_answers_after_detection": len(after) if honest is not None else None,
        "liars": liars,
        "liars_demoted": demoted_count,
        "undemoted": undemoted,
        "honest_reference": "emulated model, recomputed" if honest is not None else None,
    }
