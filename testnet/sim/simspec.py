"""A trial spec on the simulator: the spec's nodes, regions, link delays, node settings and the
very requests ``p2pnode testnet SPEC`` sends (``driver.build_requests``: same prompts, same
entry nodes, same send times), so a small simulated run can be held against a real emulated
trial of the spec (``bench/simcheck.py``).

Mapping, and what it leaves out (read the tolerance with it):
- Round trip between two nodes = ``2 * delay_ms`` of their regions' link (``testnet/netns/wan.py``
  delays every write by the one-way delay on both ends); no access delay, no jitter.
- Compute: the emulated engine's cost model, read from the same calibration the trial's nodes
  read (``costmodel.load_calibration``), one request at a time per node (the engine batches up
  to ``max_batch``; at these loads a batch rarely forms).
- Node settings: cache budget, push-back threshold, gossip interval of the spec.
- Not simulated: probation holds and known-answer challenges (``overlay/trust/audit.py``,
  ``overlay/trust/challenge.py``), the HTTP API and the driver's concurrency cap, and the cores the
  real nodes share: the routing arm of a real trial pays for these, the simulator does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from p2pnode.inference.costmodel import Calibration
from p2pnode.overlay.cache.scope import ScopePolicy
from p2pnode.testnet.sim import (
    Network,
    SimConfig,
    SimResult,
    Simulation,
)
from p2pnode.testnet.spec import TrialSpec


class SpecNetwork(Network):
    """The spec's regions and link delays in place of generated positions."""

    def __init__(self, spec: TrialSpec, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.region = list(spec.placement)
        regions = sorted(set(self.region))
        self._rtt = {
            (a, b): 2 * spec.network.delay_ms(a, b) / 1e3 for a in regions for b in regions
        }
        self.access_s = [0.0] * len(self.region)

    def base_rtt(self, a: int, b: int) -> float:
        return 0.0 if a == b else self._rtt[(self.region[a], self.region[b])]

    def rtt(self, a: int, b: int) -> float:
        return self.base_rtt(a, b)

    def nearest(self, a: int, policy: ScopePolicy, cell: Iterable[int] = ()) -> set[int]:
        pairs = [(str(j), self.base_rtt(a, j)) for j in range(len(self.region)) if j != a]
        return {int(p) for p in policy.select(pairs, cell=(str(j) for j in cell if j != a))}


def spec_config(
    spec: TrialSpec, base: SimConfig | None = None, calibration: Calibration | None = None
) -> SimConfig:
    """The simulator's settings for ``spec``: its node settings and the trial nodes' cost
    model (``calibration``; by default this machine's, as an emulated node reads it)."""
    cal = calibration or _machine_calibration()
    return replace(
        base or SimConfig(),
        nodes=spec.node_count,
        max_tokens=spec.workload.max_tokens,
        gossip_interval_s=spec.node.gossip_interval,
        cache_budget_tokens=spec.node.cache_budget_tokens,
        pushback_high=spec.node.pushback_threshold,
        prefill_s_per_token=cal.prefill_s_per_token,
        decode_s_per_token=cal.decode_s_per_token,
        overhead_s=cal.overhead_s,
        access_ms=0.0,
        jitter_ms=0.0,
        seed=spec.seed,
    )


def _machine_calibration() -> Calibration:
    """This machine's calibration of the default model, as an emulated node reads it."""
    from p2pnode.inference.costmodel import load_calibration
    from p2pnode.inference.models import load_light_model

    return load_calibration(load_light_model().model_id)


def shipped_calibration() -> Calibration:
    """The calibration shipped with the package (what an emulated node reads on a machine
    without its own): the reference trial ran with it, so the reference check uses it too."""
    from importlib import resources

    data = json.loads(
        resources.files("p2pnode.inference").joinpath("data", "calibration.json").read_text()
    )
    return Calibration(
        prefill_s_per_token=float(data["prefill_s_per_token"]),
        decode_s_per_token=float(data["decode_s_per_token"]),
        overhead_s=float(data["overhead_s"]),
        source="shipped",
    )


def spec_plan(spec: TrialSpec) -> tuple[list[list[int]], list[tuple[float, int, int]]]:
    """The trial's planned requests as token ids: the distinct prompts, and per request
    ``(send time, prompt index, entry node)``."""
    from p2pnode.inference.models import load_light_model
    from p2pnode.testnet.workload.driver import build_requests

    if spec.workload.kind != "mmlu":
        raise ValueError(
            f"spec {spec.name}: only MMLU workloads are simulated (chat sessions are not yet)"
        )
    if spec.workload.arrival != "poisson":
        raise ValueError(f"spec {spec.name}: only poisson arrivals have send times to simulate")
    tok = load_light_model().tokenizer
    index: dict[str, int] = {}
    prompts: list[list[int]] = []
    plan = []
    for p in build_requests(spec.workload, spec.seed, spec.node_count):
        if p.prompt not in index:
            index[p.prompt] = len(prompts)
            prompts.append(tok.encode(p.prompt, add_special_tokens=False))
        plan.append((float(p.at_s or 0.0), index[p.prompt], p.arrival_node))
    return prompts, plan


def simulate_spec(
    spec: TrialSpec, base: SimConfig | None = None, calibration: Calibration | None = None
) -> dict[str, Any]:
    """Both arms of ``spec`` on the simulator: per arm the ``SimResult`` fields and the mean
    latency of the second half of the requests (by send order, once the first misses are
    past), and the routing arm's mean latency over the baseline's, whole run and second half.

    A cost model under which the baseline's requests take no time (its latencies round to 0 s)
    gives no ratio: a ``ValueError`` names the calibration."""
    from p2pnode.testnet.workload.driver import oracle_cached

    cal = calibration or _machine_calibration()
    cfg = spec_config(spec, base, cal)
    prompts, plan = spec_plan(spec)
    cfg = replace(cfg, duration_s=max(at for at, _, _ in plan) + 1.0)
    out: dict[str, Any] = {"spec": spec.name, "requests": len(plan)}
    for arm, routing in (("routing", True), ("baseline", False)):
        arm_cfg = replace(cfg, routing=routing)
        sim = Simulation(arm_cfg, prompts, net=SpecNetwork(spec, arm_cfg), plan=plan)
        result = sim.run()
        _set_ceiling(result, oracle_cached([prompts[q] for q in sim.order]), prompts, sim.order)
        out[arm] = _arm_row(result)
        late = [r["latency"] for r in sim.records if r["seq"] >= len(plan) // 2]
        out[arm]["second_half_latency_s"] = round(sum(late) / max(1, len(late)), 4)
    why = (
        f"the cost model makes requests take no time (calibration {cal.source}: prefill "
        f"{cal.prefill_s_per_token:g} s/token, decode {cal.decode_s_per_token:g} s/token, "
        f"overhead {cal.overhead_s:g} s)"
    )
    out["latency_ratio"] = _ratio(out, "mean_latency_s", why)
    out["second_half_ratio"] = _ratio(out, "second_half_latency_s", why)
    return out


def trial_figures(trial_dir: str | Path) -> dict[str, Any]:
    """The same figures from a real trial's output folder (``run_trial --out``): its
    ``results.json`` and each arm's ``requests.jsonl`` (answered requests, by plan index)."""
    from p2pnode.testnet.workload.driver import read_jsonl

    trial_dir = Path(trial_dir)
    results = json.loads((trial_dir / "results.json").read_text())
    out: dict[str, Any] = {"trial": str(trial_dir), "started": results.get("started")}
    for arm in ("routing", "baseline"):
        s = results["arms"][arm]["summary"]
        recs = read_jsonl(trial_dir / arm / "requests.jsonl")
        half = len(recs) // 2
        late = [r["latency_s"] for r in recs if r["status"] == "ok" and r["i"] >= half]
        out[arm] = {
            "requests": s["answered"],
            "hit_rate": s["hit_rate"],
            "hit_rate_ceiling": s["hit_rate_ceiling"],
            "busiest_share": s["max_share"],
            "mean_latency_s": s["latency_s"]["mean"],
            "forwarded": s["forwarded_fraction"],
            "second_half_latency_s": round(sum(late) / max(1, len(late)), 4),
        }
    why = f"{trial_dir}: the baseline arm answered {out['baseline']['requests']} requests"
    out["latency_ratio"] = _ratio(out, "mean_latency_s", why)
    out["second_half_ratio"] = _ratio(out, "second_half_latency_s", why)
    return out


# Why each is as wide as it is: bench/simcheck.py (set before the run that judged it).
TOLERANCE = {
    ("baseline", "hit_rate"): ("abs", 0.01),
    ("baseline", "mean_latency_s"): ("rel", 0.10),
    ("routing", "hit_rate"): ("abs", 0.05),
    ("latency_ratio",): ("abs", 0.20),
    ("second_half_ratio",): ("abs", 0.15),
}


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float:
    for k in path:
        d = d[k]
    return float(d)  # type: ignore[arg-type]


def compare(sim: dict[str, Any], real: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per toleranced figure: both values, the difference, within or not. A relative
    difference to a real figure of 0 has no value: ``None``, and not within."""
    rows = []
    for path, (kind, tol) in TOLERANCE.items():
        s, r = _get(sim, path), _get(real, path)
        if kind == "abs":
            diff: float | None = s - r
        else:
            diff = (s - r) / r if r else None
        rows.append(
            {
                "figure": ".".join(path),
                "simulated": s,
                "real": r,
                "difference": None if diff is None else round(diff, 4),
                "tolerance": f"+-{tol:g}" if kind == "abs" else f"+-{tol * 100:g}%",
                "within": diff is not None and abs(diff) <= tol,
            }
        )
    return rows


def _ratio(out: dict[str, Any], key: str, why: str) -> float:
    """The routing arm's ``key`` over the baseline's; a ``ValueError`` saying ``why`` the
    baseline's may be 0 (or missing) instead of dividing by it."""
    baseline = out["baseline"][key]
    if baseline is None or baseline <= 0:
        raise ValueError(f"the baseline arm's {key} is {baseline}, so no ratio to it: {why}")
    return round(out["routing"][key] / baseline, 3)


def _set_ceiling(r: SimResult, oracle: Sequence[int], prompts, order: Sequence[int]) -> None:
    total = sum(len(prompts[q]) for q in order) or 1
    r.hit_rate_ceiling = round(sum(oracle) / total, 4)


def _arm_row(r: SimResult) -> dict[str, Any]:
    keep = ("requests", "hit_rate", "hit_rate_ceiling", "busiest_share", "mean_latency_s")
    return {k: getattr(r, k) for k in keep} | {"forwarded": r.forwarded}
