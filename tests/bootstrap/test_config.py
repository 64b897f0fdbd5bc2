"""A node setting has one default: the CLI, ``NodeSettings()``, the trial specs, the engine and
the overlay agree on it (each read from the others, compared here without restating a number).
"""

from __future__ import annotations

import dataclasses
import inspect

import click
import pytest

from p2pnode.bootstrap import cli
from p2pnode.bootstrap.config import ConfigError, NodeSettings, settings_from
from p2pnode.inference.engine import Engine, open_engine
from p2pnode.overlay import OverlayConfig
from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
from p2pnode.overlay.serve.service import RoutedService
from p2pnode.overlay.trust.audit import AuditConfig
from p2pnode.overlay.trust.challenge import ChallengeConfig
from p2pnode.testnet.spec import NodeSettingsSpec, parse_spec

SETTINGS = {f.name for f in dataclasses.fields(NodeSettings)}
# The commands that start a node from NodeSettings, and what they set themselves.
NODE_COMMANDS = {"join": {}, "bootstrap": {"model": "none", "role": ("bootstrap",)}}


def _default(fn, name: str):
    return inspect.signature(fn).parameters[name].default


def _field_default(cls, name: str):
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default


@pytest.mark.parametrize("command", sorted(NODE_COMMANDS))
def test_cli_without_flags_gives_the_default_settings(command):
    ctx = cli.main.commands[command].make_context(command, [])
    flags = {k: v for k, v in ctx.params.items() if k != "config_file"}
    assert set(flags) <= SETTINGS, "a node flag with no setting of the same name"
    # no flag carries a default of its own: an absent flag leaves the setting's default
    assert cli._given(**flags) == {}
    fixed = NODE_COMMANDS[command]
    expected = dataclasses.replace(
        NodeSettings(), **{k: list(v) if isinstance(v, tuple) else v for k, v in fixed.items()}
    )
    assert settings_from(cli._given(**flags, **fixed)) == expected.validate()


def test_cli_help_shows_the_settings_defaults():
    command = cli.main.commands["join"]
    ctx = command.make_context("join", ["--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x"])
    shown = {
        p.name: p.get_help_record(ctx)[1]
        for p in command.params
        if isinstance(p, cli._SettingOption)
    }
    assert {"cache_budget_tokens", "max_batch", "pushback_threshold", "max_connections"} <= set(
        shown
    )
    defaults = NodeSettings()
    for name, text in shown.items():
        assert "{default}" not in text
        assert f"(default {getattr(defaults, name)}" in text, (name, text)


def test_trial_specs_default_to_the_node_settings():
    defaults = NodeSettings()
    spec = NodeSettingsSpec()
    for f in dataclasses.fields(NodeSettingsSpec):
        assert f.name in SETTINGS
        assert getattr(spec, f.name) == getattr(defaults, f.name), f.name
    # a spec without a [node] table gets them too
    parsed = parse_spec({"network": {"regions": ["eu"]}, "nodes": {"count": 2}})
    assert parsed.node == spec


def test_node_settings_read_the_engine_and_overlay_defaults():
    s = NodeSettings()
    assert s.cache_budget_tokens == _default(open_engine, "cache_budget_tokens")
    assert s.max_batch == _default(open_engine, "max_batch") == _default(Engine, "max_batch")
    overlay = {
        "ping_interval": "ping_interval",
        "ping_timeout": "ping_timeout",
        "connect_timeout": "connect_timeout",
        "gossip_interval": "gossip_heartbeat",
        "min_connections": "conn_low",
        "max_connections": "conn_high",
        "gossip_degree": "gossip_degree",
    }
    for setting, field in overlay.items():
        assert getattr(s, setting) == _field_default(OverlayConfig, field), setting
    assert s.gossip_budget == _field_default(AntiEntropyConfig, "topic_budget_msgs_per_s")
    assert s.pushback_threshold == _default(RoutedService, "pushback_high")
    assert s.audit_rate == _field_default(AuditConfig, "trusted_rate")
    assert s.audit_budget == _field_default(AuditConfig, "budget_share")
    assert s.probation_answers == _field_default(AuditConfig, "probation_answers")
    assert s.probation_challenges == _field_default(ChallengeConfig, "enabled")


def test_a_gossip_budget_over_gossipsubs_spam_cap_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="gossipsub drops"):
        NodeSettings(gossip_budget=12.0).validate()
    NodeSettings(gossip_budget=2.0).validate()


def test_a_gossip_degree_outside_2_to_12_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="gossip_degree must be between 2"):
        NodeSettings(gossip_degree=1).validate()
    with pytest.raises(ConfigError, match="got 13"):
        NodeSettings(gossip_degree=13).validate()
    NodeSettings(gossip_degree=3).validate()


def test_setting_flags_keep_no_default_of_their_own():
    defaults = {
        (command, p.name): p.default
        for command in NODE_COMMANDS
        for p in cli.main.commands[command].params
        if isinstance(p, click.Option) and p.name in SETTINGS and not p.multiple
    }
    # The flags this rule is about are there, in both commands, so the check cannot pass empty.
    for command in NODE_COMMANDS:
        checked = {name for c, name in defaults if c == command}
        assert {"api_port", "ping_timeout", "connect_timeout", "log_level"} <= checked, command
    assert {"gossip_budget", "max_batch", "model"} <= {n for c, n in defaults if c == "join"}
    assert {k: v for k, v in defaults.items() if v is not None} == {}
