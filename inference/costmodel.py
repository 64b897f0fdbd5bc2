"""Latency model of one engine: prefill and decode seconds per token plus a fixed overhead.

Contract:
- ``estimate(prompt_tokens, cached_tokens, max_tokens)`` = overhead
  + (prompt_tokens - cached_tokens) * prefill_s_per_token + max_tokens * decode_s_per_token.
  It is the time one request takes alone; queueing is the engine's ``estimated_wait_s()``.
- ``await calibrate(engine)`` measures the engine's own backend at start-up (one uncached
  prefill of ~96 tokens and a few decode steps, ~1-2 s on the default model on 2 CPU cores).
- ``recalibrate_when_idle(engine)`` measures again an engine that served nothing since it
  last measured (a start-up figure taken while other processes held the cores is not kept
  for good), keeping the faster of each figure.
- ``observe_prefill`` refits the fixed and per-token parts of a prefill chunk from the chunks
  the engine runs (least squares with forgetting, see its doc); ``observe_decode`` folds decode
  steps in with an EWMA (``alpha``), so the model follows load and context length drift;
  ``alpha`` 0 freezes both (an emulated engine, which would measure its own sleeps).
- Defaults (before calibration) are the figures measured for SmolLM2-135M fp32 on 2 cores.
- Calibration files: a real engine that has calibrated writes its figures once to
  ``<cache>/calibration/<model id>.json`` (``save_calibration``; an existing file is kept, so
  delete it to measure again). An emulated engine, which has nothing to measure, reads them
  with ``load_calibration(model_id)``: that file when it exists, else the one shipped with the
  package (``inference/data/calibration.json``: SmolLM2-135M fp32, one torch thread, on the
  2-core development machine), so emulated nodes of one trial agree without loading torch.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from p2pnode.errors import P2PNodeError

if TYPE_CHECKING:
    from p2pnode.inference.engine import Engine

log = logging.getLogger("p2pnode.inference.costmodel")

# The prefill chunk fit (``CostModel.observe_prefill``).
CHUNK_FORGETTING = 0.95
PRIOR_CHUNK_SIZES = (16, 256)
PRIOR_CHUNK_WEIGHT = 0.5
# A decode step slower than the figure counts this share of ``alpha`` (``observe_decode``).
DECODE_SLOWER_SHARE = 0.1


@dataclass
class CostModel:
    prefill_s_per_token: float = 1 / 430
    decode_s_per_token: float = 1 / 16
    overhead_s: float = 0.01
    alpha: float = 0.2
    calibrated: bool = False
    observations: int = 0
    # CPU time of the process over the calibration's wall time: below MIN_CPU_SHARE the
    # figures measured other work's load, not this engine (see ``save_calibration``).
    cpu_share: float = 1.0
    # The chunk fit (``observe_prefill``): decayed sums of 1, n, n^2, t, n*t over observed
    # chunks, the figures it started from, and the figures it last produced.
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5, init=False, repr=False)
    _anchor: tuple[float, float] = field(default=(0.0, 0.0), init=False, repr=False)
    _fitted: tuple[float, float] | None = field(default=None, init=False, repr=False)

    def estimate(self, prompt_tokens: int, cached_tokens: int, max_tokens: int) -> float:
        new = max(0, prompt_tokens - cached_tokens)
        return (
            self.overhead_s
            + new * self.prefill_s_per_token
            + max(0, max_tokens) * self.decode_s_per_token
        )

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """One prefill chunk of ``tokens`` new prompt tokens took ``seconds``.

        Why a fit and not seconds / tokens: a chunk pays a fixed part (one pass over the
        weights) besides its tokens, and a later chat turn is a short chunk. A 40-token chunk
        after a 400-token cached prefix took 140-180 ms (3.5-4.5 ms a token) where a 400-token
        chunk took 2.1 ms a token (SmolLM2 fp32, 2-vCPU Xeon, 2026-12-07), so averaging the
        ratio put the per-token figure at 2-4x the truth, and a cached prefix's saving looked
        that much larger than a forward's cost. Least squares of seconds on tokens, each chunk
        weighing ``CHUNK_FORGETTING`` times the one after it (the last ~20 chunks count), with
        the figures in force when fitting started (calibration's) standing in as two chunks
        of ``PRIOR_CHUNK_SIZES`` tokens, ``PRIOR_CHUNK_WEIGHT`` each, so chunks all of one size
        cannot swing the slope."""
        if tokens < 1 or not seconds > 0 or self.alpha <= 0:  # alpha 0: frozen (emulated)
            return
        current = (self.prefill_s_per_token, self.overhead_s)
        if self._fitted != current:  # figures set from outside (a calibration): start there
            self._anchor, self._sums = current, [0.0] * 5
        g = CHUNK_FORGETTING
        s0, s1, s2, t, u = (g * v for v in self._sums)
        self._sums = [s0 + 1, s1 + tokens, s2 + tokens * tokens, t + seconds, u + tokens * seconds]
        s0, s1, s2, t, u = self._sums
        rate, fixed = self._anchor
        w = PRIOR_CHUNK_WEIGHT
        for n in PRIOR_CHUNK_SIZES:
            y = fixed + n * rate
            s0, s1, s2, t, u = s0 + w, s1 + w * n, s2 + w * n * n, t + w * y, u + w * n * y
        slope = max(1e-6, (s0 * u - s1 * t) / (s0 * s2 - s1 * s1))
        self.prefill_s_per_token = slope
        self.overhead_s = max(0.0, (t - slope * s1) / s0)
        self._fitted = (self.prefill_s_per_token, self.overhead_s)
        self.observations += 1

    def observe_decode(self, seconds_per_step: float) -> None:
        """One decode step (one token for each running request) took ``seconds_per_step``.

        A faster step than the figure moves it by ``alpha``, a slower one by a tenth of it.
        Why: a slow step is mostly other work on the cores (a neighbour's prefill, more rows in
        the batch), gone by the next request, and the queue estimate already counts this
        engine's own backlog; a fast one shows what the hardware does. Routers compare these
        figures across peers, and with a symmetric EWMA four nodes of one 2-core machine
        advertised 49-107 ms a step for one model and sent requests after the difference
        (the trials' decision logs, 2026-12-07). A lasting slowdown still shows within a few
        requests (~20 steps each)."""
        if seconds_per_step > 0 and self.alpha > 0:
            up = seconds_per_step > self.decode_s_per_token
            a = self.alpha * (DECODE_SLOWER_SHARE if up else 1.0)
            self.decode_s_per_token = (1 - a) * self.decode_s_per_token + a * seconds_per_step
            self.observations += 1

    def as_dict(self) -> dict[str, float]:
        return {
            "prefill_s_per_token": self.prefill_s_per_token,
            "decode_s_per_token": self.decode_s_per_token,
            "overhead_s": self.overhead_s,
        }


async def calibrate(
    engine: Engine,
    *,
    prefill_tokens: int = 96,
    decode_steps: int = 4,
    repeats: int = 3,
    keep_faster: bool = False,
) -> CostModel:
    """Measure the engine's backend directly (bypassing the cache) and set ``engine.cost``
    (with ``keep_faster``, each figure only where it is faster than the one it has)."""
    import time

    import trio

    backend = engine._backend
    vocab = engine.vocab_size
    prompt = [(17 + 31 * i) % vocab for i in range(prefill_tokens)]

    def run() -> tuple[float, float, float, float]:
        import torch

        # With one torch thread the forward runs in this thread, and its CPU time is the
        # forward's time without other processes' share of the cores: four trial nodes
        # calibrating at once on 2 cores measured 3.7 ms a prompt token and 89 ms a decode
        # step against 2.2 and 45 alone, and their routers then sent every request to
        # whichever peer had measured itself on a quiet moment (2026-12-07). With a pool of
        # threads this thread's time is not the forward's: wall time, as before.
        solo = torch.get_num_threads() == 1

        def clock() -> tuple[float, float]:
            return time.perf_counter(), time.thread_time()

        def since(t: tuple[float, float]) -> float:
            wall, cpu = time.perf_counter() - t[0], time.thread_time() - t[1]
            return min(wall, cpu) if solo and cpu > 0 else wall

        warm = backend.new_state(None, 0)
        backend.extend(warm, prompt[:4])  # the first forward pays one-off allocations
        backend.free(warm)
        state = backend.new_state(None, 0)
        c0 = time.process_time()
        t0 = time.perf_counter()
        t = clock()
        backend.extend(state, prompt[:8])
        small = since(t)
        t = clock()
        backend.extend(state, prompt[8:])
        big = since(t)
        t = clock()
        for _ in range(decode_steps):
            backend.decode([state], [prompt[0]])
        step = since(t) / decode_steps
        cpu = time.process_time() - c0
        backend.free(state)
        return small, big, step, cpu / max(time.perf_counter() - t0, 1e-9)

    def run_no_grad() -> tuple[float, float, float, float]:
        import torch

        with torch.inference_mode():
            # The fastest of a few runs: other work on the cores only ever adds time.
            runs = [run() for _ in range(repeats)]
        return min(runs, key=lambda r: r[0] + r[1] + r[2])

    small, big, step, share = await trio.to_thread.run_sync(run_no_grad)
    cost = engine.cost
    per_token = big / (prefill_tokens - 8)
    if keep_faster and cost.calibrated:
        # Another run on the same machine: the slower figures measured the neighbours.
        per_token = min(per_token, cost.prefill_s_per_token)
        step = min(step, cost.decode_s_per_token)
        small = min(small, cost.overhead_s + 8 * per_token)
    cost.cpu_share = share
    cost.prefill_s_per_token = per_token
    cost.overhead_s = max(0.0, small - 8 * per_token)
    cost.decode_s_per_token = step
    cost.calibrated = True
    return cost


async def recalibrate_when_idle(
    engine: Engine,
    *,
    idle_s: float = 30.0,
    first_after_s: float = 60.0,
    max_after_s: float = 1800.0,
) -> None:
    """Measure again, now and then, an engine that has served nothing since it last measured.

    Why: the figures a node calibrates at start-up are what its router weighs against its
    peers' advertised ones, and a real request refreshes them (``observe_*``). One measured
    while other processes held the cores (four trial nodes started at once on two cores: 12.7 ms
    a prompt token against its peers' 8.4) looks slower than it is, so its router forwards
    every request, and it never serves one that would correct it. Once the engine has been idle
    for ``idle_s``, ``first_after_s`` after the last measurement and with no real request in
    between, this measures again and keeps the faster of each figure (``calibrate`` with
    ``keep_faster``); the wait doubles each time up to ``max_after_s``, so an idle node spends
    ~1 s of CPU a few times an hour at most. Runs until cancelled."""
    import trio

    after = first_after_s
    while True:
        seen = engine.cost.observations
        await trio.sleep(after)
        if engine.cost.observations != seen:  # it served: real requests keep the figures true
            after = first_after_s
            continue
        # Polled: the engine has no event for "idle this long", and this runs rarely.
        while engine.queue_depth or engine.idle_for_s() < idle_s:  # noqa: ASYNC110
            await trio.sleep(max(1.0, idle_s - engine.idle_for_s()))
        async with engine.compute:  # never beside a step: they would share the backend
            await calibrate(engine, keep_faster=True)
        log.info("recalibrated while idle: %s", engine.cost.as_dict())
        after = min(after * 2, max_after_s)


CALIBRATION_FIELDS = ("prefill_s_per_token", "decode_s_per_token", "overhead_s")
MIN_CPU_SHARE = 0.85
# Share of the last 10 s in which some runnable task waited for a core (Linux PSI). Above this
# the figures measured the neighbours: one file, written while other processes held the cores
# (load average 1.8, the measuring process "on a core" 99 % of the time, because torch's idle
# OpenMP threads spin), held 18x the idle prefill time, and every later emulated trial on the
# machine timed out.
MAX_CPU_PRESSURE = 10.0
_SHIPPED = "calibration.json"


@dataclass(frozen=True)
class Calibration:
    """Measured speeds of one model on one machine (see the module contract)."""

    prefill_s_per_token: float
    decode_s_per_token: float
    overhead_s: float
    source: str  # the file it came from

    def apply_to(self, cost: CostModel) -> CostModel:
        cost.prefill_s_per_token = self.prefill_s_per_token
        cost.decode_s_per_token = self.decode_s_per_token
        cost.overhead_s = self.overhead_s
        cost.calibrated = True
        return cost


class CalibrationError(P2PNodeError, ValueError):
    """A calibration file is unreadable or incomplete; the message names it."""

    reason = "calibration_failed"


def calibration_path(model_id: str) -> Path:
    from p2pnode.inference.models import cache_dir

    safe = "".join(c if c.isalnum() or c in "@.-_" else "_" for c in model_id)
    return cache_dir() / "calibration" / f"{safe}.json"


def _parse(text: str, source: str) -> Calibration:
    try:
        data = json.loads(text)
        values = {k: float(data[k]) for k in CALIBRATION_FIELDS}
    except (ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(
            f"calibration {source} is not valid ({exc}); delete it so a real run writes it again"
        ) from None
    if any(v < 0 or v > 60 for v in values.values()) or values["prefill_s_per_token"] <= 0:
        raise CalibrationError(f"calibration {source} holds implausible figures: {values}")
    return Calibration(**values, source=source)


def load_calibration(model_id: str) -> Calibration:
    """This machine's calibration of ``model_id`` when a real run wrote one, else the shipped."""
    path = calibration_path(model_id)
    if path.is_file():
        return _parse(path.read_text(), str(path))
    shipped = resources.files("p2pnode.inference").joinpath("data", _SHIPPED)
    return _parse(shipped.read_text(), f"{shipped} (shipped)")


def cpu_pressure() -> float | None:
    """Percent of the last 10 s in which some runnable task waited for a CPU (Linux PSI,
    ``/proc/pressure/cpu``), or None where the kernel does not report it."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(f.split("=") for f in first.split()[1:])["avg10"])
    except (OSError, IndexError, KeyError, ValueError):
        return None


def save_calibration(model_id: str, cost: CostModel) -> Path | None:
    """Write ``cost`` as the calibration of ``model_id`` unless one exists; the path written,
    or None (one existed, or the cache is not writable: emulation then uses the shipped one)."""
    path = calibration_path(model_id)
    if path.exists():
        return None
    # Written once and read by every later emulated trial on this machine: figures measured
    # while other work held the cores would slow every one of them (a busy 2-core machine
    # measured 60x the idle prefill time). A busy machine writes nothing; a later run will.
    # The load average lags by a minute, so the measuring thread's own share of a core is
    # checked too (a file written at load 1.3 once held 4x the idle decode time).
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        log.info("calibration not saved: load average %.1f over %s cores", load, os.cpu_count())
        return None
    if cost.cpu_share < MIN_CPU_SHARE:
        log.info(
            "calibration not saved: it ran on a core %.0f %% of the time", 100 * cost.cpu_share
        )
        return None
    pressure = cpu_pressure()
    if pressure is not None and pressure > MAX_CPU_PRESSURE:
        log.info(
            "calibration not saved: tasks waited for a core %.0f %% of the last 10 s", pressure
        )
        return None
    record = {
        **{k: getattr(cost, k) for k in CALIBRATION_FIELDS},
        "model_id": model_id,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg": round(load, 2),
        "cpu_share": round(cost.cpu_share, 3),
        "cpu_pressure": pressure,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        tmp.replace(path)  # atomic: a node reading it at the same time sees all or nothing
    except OSError:
        return None
    return path
