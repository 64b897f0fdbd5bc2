"""The chat workload's plan and summary, and the results page (no nodes: pure functions)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from p2pnode.testnet.report import page as results_page
from p2pnode.testnet.spec import Workload
from p2pnode.testnet.workload import chat

WORKLOAD = replace(Workload(), kind="chat", sessions=12, turns=3, system_prompts=3)


def test_sessions_are_a_pure_function_of_the_spec_and_never_reuse_a_question() -> None:
    a = chat.build_sessions(WORKLOAD, seed=7, n_nodes=4)
    assert a == chat.build_sessions(WORKLOAD, seed=7, n_nodes=4)
    assert a != chat.build_sessions(WORKLOAD, seed=8, n_nodes=4)
    questions = [q for s in a for q in s.questions]
    assert len(questions) == 36 == len(set(questions))
    assert all(0 <= s.arrival_node < 4 and 0 <= s.system_prompt < 3 for s in a)
    assert all(len(s.think_s) == 2 for s in a)
    assert [s.at_s for s in a] == sorted(s.at_s for s in a)


def test_chat_summary_counts_turns_history_and_copies() -> None:
    s0, s1 = chat.build_sessions(replace(WORKLOAD, sessions=2, turns=2), seed=1, n_nodes=2)
    recs = [
        chat._record(s0, 0, 2, "ok", latency_s=2.0, served_by="A"),
        chat._record(s0, 1, 2, "ok", latency_s=1.0, served_by="A", history_cached=True),
        chat._record(s1, 0, 2, "ok", latency_s=4.0, served_by="B"),
        chat._record(s1, 1, 2, "ok", latency_s=3.0, served_by="A", history_cached=False),
    ]
    out = chat.chat_summary(recs)
    assert out["latency_s_by_turn"] == {0: 3.0, 1: 2.0}
    assert out["history_cached_share"] == 0.5
    copies = out["serving_nodes_per_system_prompt"]
    if s0.system_prompt == s1.system_prompt:
        assert copies == {s0.system_prompt: 2}
    else:
        assert copies == {s0.system_prompt: 1, s1.system_prompt: 2}


def test_results_page_rewrites_only_its_section(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    summary = {
        "answered": 10,
        "requests": 10,
        "latency_s": {"mean": 0.5},
        "hit_rate": 0.8,
        "hit_of_ceiling": 0.9,
        "hit_rate_ceiling": 0.88,
        "max_share": 0.3,
        "forwarded_fraction": 0.2,
        "latency_floor_s": 0.3,
    }
    base = {**summary, "latency_s": {"mean": 1.0}, "forwarded_fraction": 0.0}
    results = {
        "spec": {"name": "demo", "compute": "emulated", "nodes": 4, "max_delay_ms": 2.0},
        "arms": {"routing": {"summary": summary}, "baseline": {"summary": base}},
        "started": "2026-12-01T00:00:00Z",
        "command": "p2pnode testnet demo",
    }
    (run / "results.json").write_text(json.dumps(results))
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nhand-written text\n")
    results_page.update_page(page, results_page.load_runs([run]))
    results_page.update_page(page, results_page.load_runs([run]))  # twice: still one section
    text = page.read_text()
    assert text.count(results_page.BEGIN) == 1 and "hand-written text" in text
    assert "| demo |" in text and "**0.500** (floor 0.300)" in text
    # Another machine's run of another spec adds its row and keeps this one.
    other = tmp_path / "other"
    other.mkdir()
    results2 = {**results, "spec": {**results["spec"], "name": "other"}, "command": "x other"}
    (other / "results.json").write_text(json.dumps(results2))
    results_page.update_page(page, results_page.load_runs([other]))
    text = page.read_text()
    assert "| demo |" in text and "| other |" in text
    assert "- demo: `p2pnode testnet demo`" in text and "- other: `x other`" in text
