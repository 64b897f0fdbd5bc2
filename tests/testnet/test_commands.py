"""``p2pnode testnet`` and ``p2pnode simulate`` (testnet/commands.py): click parses and
documents every option, bad input exits 2 with what to give, and the commands stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from p2pnode.bootstrap.cli import main


@pytest.mark.parametrize(
    ("command", "options"),
    [
        (
            "testnet",
            ["--arms", "--out", "--stream", "--hosts", "--inventory", "--allow-missing"],
        ),
        (
            "simulate",
            ["--nodes", "--duration", "--rate", "--churn-per-min", "--max-views", "--k-nearest"],
        ),
    ],
)
def test_help_lists_every_option(command: str, options: list[str]) -> None:
    from p2pnode.testnet import commands

    out = CliRunner().invoke(main, [command, "--help"])
    assert out.exit_code == 0, out.output
    documented = {
        opt for param in getattr(commands, command).params for opt in param.opts if "--" in opt
    }
    assert set(options) <= documented
    for opt in documented:
        assert opt in out.output, (opt, out.output)


def test_simulate_help_shows_the_knobs_defaults() -> None:
    from p2pnode.overlay.cache.scope import ScopePolicy
    from p2pnode.testnet.sim import SimConfig

    text = " ".join(CliRunner().invoke(main, ["simulate", "--help"]).output.split())
    assert f"Simulated seconds. [default: {SimConfig.duration_s}]" in text
    assert f"Scoped views per node. [default: {ScopePolicy.max_views}]" in text


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["testnet", "no-such-spec"], "Invalid value for SPEC"),
        (["testnet", "smoke", "--arms", "routing,other"], "Invalid value for --arms"),
        (["testnet", "smoke", "--hosts", "cloud"], "Invalid value for '--hosts'"),
        (["testnet", "smoke", "--inventory", "h.toml", "--hosts", "netns"], "exclude each other"),
        (["testnet", "smoke", "--allow-missing", "-1"], "Invalid value for '--allow-missing'"),
        (["simulate", "--nodes", "1,x"], "Invalid value for --nodes"),
        (["simulate", "--nodes", "1"], "Invalid value for --nodes"),
        (["simulate", "--spec", "no-such-spec"], "Invalid value for --spec"),
        (["simulate", "--duration", "soon"], "Invalid value for '--duration'"),
    ],
)
def test_bad_input_exits_2_naming_the_option(argv: list[str], problem: str) -> None:
    out = CliRunner().invoke(main, argv)
    assert out.exit_code == 2, out.output
    assert problem in out.output, out.output


def test_the_recorded_command_is_what_was_typed() -> None:
    import click

    from p2pnode.testnet.commands import command_line, simulate

    argv = ["--nodes", "4,8", "--from-json", "a.json", "--from-json", "b c.json", "--seed", "3"]
    with click.Context(simulate, info_name="p2pnode simulate") as ctx:
        simulate.parse_args(ctx, argv)
        assert command_line(ctx) == "p2pnode simulate --nodes 4,8 --seed 3 " + (
            "--from-json a.json --from-json 'b c.json'"
        )


def test_the_cli_loads_neither_the_trials_nor_torch_nor_simpy() -> None:
    code = (
        "import sys, p2pnode.bootstrap.cli; "
        "print(sorted(m for m in ('torch', 'simpy', 'libp2p', 'p2pnode.testnet.run.trial', "
        "'p2pnode.testnet.sim') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("module", ["p2pnode.testnet.run.trial", "p2pnode.testnet.simulate"])
def test_the_python_m_entry_points_run_the_same_commands(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True
    )
    assert f"Usage: python -m {module}" in out.stdout
    assert "--out" in out.stdout
