"""Node-wide starvation figures (overlay/net/starvation.py) and the close rule liveness builds on
them, with a fake clock: no sleeps, no hosts."""

from __future__ import annotations

from collections import Counter

import pytest

from p2pnode.identity import NodeKey
from p2pnode.overlay import OverlayConfig, PeerTable
from p2pnode.overlay.net.liveness import Liveness, _Probe
from p2pnode.overlay.net.starvation import (
    FLOOR_FACTOR,
    MAX_FLOOR_FACTOR,
    MIN_CROWD,
    WINDOW_S,
    Starvation,
)

from testkit import FakeClock


def quiet_node(clock: FakeClock) -> Starvation:
    """A healthy node: loopback echoes of a few ms from 8 peers, no loop lag."""
    s = Starvation(1.0, clock)
    for peer in range(8):
        for _ in range(3):
            s.note_echo(peer, 0.004)
    for _ in range(40):
        s.note_loop_lag(0.002)
    return s


def test_quiet_machine_keeps_the_base_floor_and_may_close() -> None:
    clock = FakeClock()
    s = quiet_node(clock)
    assert s.floor() == 1.0  # a hung peer is still found within ~3.5 s
    assert s.close_withheld(missing=1, total=8) is None
    assert Starvation(1.0, clock).floor() == 1.0  # nothing measured yet


def test_floor_follows_most_peers_echo_delays_not_a_few_slow_ones() -> None:
    clock = FakeClock()
    s = quiet_node(clock)
    for peer in range(3):  # 3 of 8 far or stalled: their own RTO covers them
        for _ in range(5):
            s.note_echo(peer, 2.5)
    assert s.floor() == 1.0
    for peer in range(3, 6):  # now 6 of 8 answer in ~1.2 s: the CPU is busy
        for _ in range(5):
            s.note_echo(peer, 1.2)
    assert s.floor() == pytest.approx(FLOOR_FACTOR * 1.2)


def test_floor_follows_own_loop_lag_and_is_capped() -> None:
    clock = FakeClock()
    s = quiet_node(clock)
    for _ in range(40):
        s.note_loop_lag(0.8)  # half of the ticks late by 0.8 s: sustained, not one GC pause
    assert s.floor() == pytest.approx(FLOOR_FACTOR * 0.8)
    for peer in range(8):
        for _ in range(5):
            s.note_echo(peer, 60.0)
    assert s.floor() == MAX_FLOOR_FACTOR * 1.0


def test_samples_age_out_of_the_window() -> None:
    clock = FakeClock()
    s = Starvation(1.0, clock)
    for peer in range(8):
        s.note_echo(peer, 2.0)
    s.note_loop_lag(0.9)
    assert s.floor() == pytest.approx(6.0)
    assert s.close_withheld(missing=0, total=8) == "own event loop starved"
    clock.now += WINDOW_S + 1
    assert s.floor() == 1.0
    assert s.close_withheld(missing=0, total=8) is None
    assert s.status() == {"probe_floor_s": 1.0, "echo_delay_s": None, "loop_lag_s": 0.0}


def test_forgotten_peers_no_longer_count() -> None:
    clock = FakeClock()
    s = Starvation(1.0, clock)
    s.note_echo("a", 3.0)
    assert s.echo_delay() == 3.0
    s.forget("a")
    assert s.echo_delay() is None


def test_stalled_sees_only_lags_since_the_probe() -> None:
    clock = FakeClock()
    s = Starvation(1.0, clock)
    s.note_loop_lag(2.0)
    clock.now += 5
    started = clock.now
    s.note_loop_lag(0.1)
    assert not s.stalled(started, 0.5)
    s.note_loop_lag(0.7)
    assert s.stalled(started, 0.5)


def test_most_peers_missing_at_once_withholds_the_close() -> None:
    s = Starvation(1.0, FakeClock())
    assert s.close_withheld(missing=5, total=8) == "5 of 8 peers miss probes at once"
    assert s.close_withheld(missing=4, total=8) is None  # half is not most
    # Too few peers to tell a starved machine from a hung peer: the hung one is closed.
    assert s.close_withheld(missing=MIN_CROWD - 1, total=MIN_CROWD - 1) is None


def test_base_floor_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        Starvation(0.0)


def liveness_with(missing: int, total: int, bootstrap: set[str]) -> tuple[Liveness, Counter]:
    counters: Counter[str] = Counter()
    cfg = OverlayConfig(key=NodeKey.generate())
    live = Liveness(None, PeerTable(), cfg, counters, lambda pid: None, lambda: bootstrap)  # type: ignore[arg-type]
    for i in range(total):
        live._probes[f"p{i}"] = _Probe(misses=1 if i < missing else 0)  # type: ignore[index]
    return live, counters


def test_liveness_never_closes_the_bootstrap_on_probe_misses() -> None:
    live, counters = liveness_with(missing=1, total=8, bootstrap={"boot"})
    assert live._close_withheld("boot")
    assert not live._close_withheld("p0")  # a lone silent peer on a quiet node: closed
    assert counters["probe_closes_withheld"] == 1


def test_liveness_keeps_links_when_most_peers_miss() -> None:
    live, counters = liveness_with(missing=6, total=8, bootstrap=set())
    assert live._close_withheld("p0")
    assert counters["probe_closes_withheld"] == 1
