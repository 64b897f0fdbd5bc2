"""``p2pnode testnet`` and ``p2pnode simulate``: click parses and documents their options.

Light on purpose: ``p2pnode`` registers both commands when it loads, and ``p2pnode --help``
must not load torch, libp2p or simpy, so this module imports click alone; the trial runner
(``run/trial.py``) and the simulator (``sim/``) load when a command runs. The same commands
run as ``python -m p2pnode.testnet.run.trial`` and ``python -m p2pnode.testnet.simulate``.

A simulate flag whose default is a knob of ``SimConfig`` or ``ScopePolicy`` keeps None as its
value (the knob's own default applies) and shows the knob's default in ``--help`` only: read
there, it is defined once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

_CONTEXT = {"help_option_names": ["-h", "--help"]}


def command_line(ctx: click.Context) -> str:
    """The command as typed, rebuilt from the parameters the user gave (recorded with results)."""
    import shlex

    words: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[name]
        if isinstance(param, click.Argument):
            words.append(str(value))
            continue
        flag = param.opts[0]
        if isinstance(param, click.Option) and param.is_flag:
            words.append(flag)
            continue
        for one in value if isinstance(value, tuple) else (value,):
            words += [flag, str(one)]
    return " ".join([ctx.command_path, shlex.join(words)]).strip()  # the path may hold spaces


# -- p2pnode testnet ---------------------------------------------------------------------------


@click.command("testnet", context_settings=_CONTEXT)
@click.argument("spec")
@click.option("--arms", default=None, help="Comma list of routing,baseline (default: the spec's).")
@click.option(
    "--out",
    default=None,
    help="Results folder (default: testnet/results/<spec name>-<UTC time>).",
)
@click.option("--stream", is_flag=True, help="Stream answers (measures TTFT).")
@click.option(
    "--hosts",
    type=click.Choice(["local", "netns"]),
    default="local",
    show_default=True,
    help="local: every node on this host's loopback; netns: every node in a network namespace "
    "of its own with its own address (needs root).",
)
@click.option(
    "--inventory",
    metavar="HOSTS.toml",
    default=None,
    help="Run on the machines of this inventory over SSH (testnet/remote/, docs/testnet.md) "
    "instead of this host.",
)
@click.option(
    "--allow-missing",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="N",
    help="With --inventory: go on without up to N hosts that fail the preflight.",
)
@click.option(
    "--no-churn",
    is_flag=True,
    help="Drop the spec's [[churn]] events (the same trial without churn, for comparison).",
)
@click.pass_context
def testnet(
    ctx: click.Context,
    spec: str,
    arms: str | None,
    out: str | None,
    stream: bool,
    hosts: str,
    inventory: str | None,
    allow_missing: int,
    no_churn: bool,
) -> None:
    """Run a testnet trial of SPEC, a trial TOML file or a built-in name.

    Built-in specs: paper-lan, paper-wan-200, paper-wan-1000 (each also -zipf),
    paper-lan-zipf-real; chat-lan, chat-wan, chat-lan-real; mixed-6; scale-64, scale-128; smoke;
    adversarial-liar; churn-12; tuning-lan-zipf (docs/testnet.md). Each arm runs on fresh
    processes; results, the report and the nodes' logs go to --out. Exit status 1 when an arm
    failed or is inconsistent.
    """
    from dataclasses import replace

    from p2pnode.testnet.spec import ARMS, SpecError, builtin_spec_path, load_spec

    try:
        trial_spec = load_spec(builtin_spec_path(spec))
    except SpecError as exc:
        raise click.BadParameter(str(exc), param_hint="SPEC") from None
    if no_churn:  # the baseline for churn's latency impact
        trial_spec = replace(trial_spec, churn=())
    chosen = trial_spec.arms if arms is None else tuple(a for a in arms.split(",") if a)
    if not chosen or any(a not in ARMS for a in chosen):
        raise click.BadParameter(f"use a comma list of {', '.join(ARMS)}", param_hint="--arms")
    if inventory is not None and hosts != "local":
        raise click.UsageError("--inventory and --hosts exclude each other")
    from p2pnode.testnet.run import trial

    folder = Path(out) if out is not None else None
    if inventory is not None:
        code = trial.run_on_inventory(
            trial_spec,
            chosen,
            inventory,
            out=folder,
            allow_missing=allow_missing,
            command=command_line(ctx),
        )
    else:
        code = trial.run_here(
            trial_spec, chosen, out=folder, stream=stream, hosts=hosts, command=command_line(ctx)
        )
    ctx.exit(code)


# -- p2pnode simulate --------------------------------------------------------------------------


class _KnobOption(click.Option):
    """A flag for a simulator knob: its value stays None unless given (the knob's default
    applies), and ``--help`` shows the default read from ``SimConfig`` or ``ScopePolicy``."""

    def __init__(self, *decls: str, knob: str, **attrs: Any) -> None:
        super().__init__(*decls, default=None, **attrs)
        self.knob = knob

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None:
            return record
        owner, field = self.knob.split(".")
        if owner == "SimConfig":
            from p2pnode.testnet.sim import SimConfig as knobs
        else:
            from p2pnode.overlay.cache.scope import ScopePolicy as knobs
        return record[0], f"{record[1]}  [default: {getattr(knobs, field)}]".strip()


def _knob(*decls: str, knob: str, **attrs: Any) -> Any:
    return click.option(*decls, cls=_KnobOption, knob=knob, **attrs)


@click.command("simulate", context_settings=_CONTEXT)
@click.option(
    "--nodes", default="100,1000,10000", show_default=True, help="Comma list of swarm sizes."
)
@_knob("--duration", type=float, knob="SimConfig.duration_s", help="Simulated seconds.")
@click.option("--rate", type=float, default=None, help="Requests per simulated second.")
@click.option(
    "--churn-per-min", type=float, default=0.0, show_default=True, help="Share of nodes per min."
)
@_knob("--max-views", type=int, knob="ScopePolicy.max_views", help="Scoped views per node.")
@_knob("--k-nearest", type=int, knob="ScopePolicy.k_nearest", help="Nearest peers always kept.")
@_knob("--cell-nodes", type=int, knob="ScopePolicy.cell_nodes", help="Nodes per cell.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the run.")
@click.option(
    "--from-json",
    multiple=True,
    metavar="SIMULATE_JSON",
    help="Run nothing: one table and plot from the rows of earlier runs' simulate.json "
    "(repeat it for several runs).",
)
@click.option(
    "--spec",
    default=None,
    help="Simulate this trial spec instead (its nodes, delays and planned requests), both "
    "arms, and print the figures a trial reports (testnet/sim/simspec.py).",
)
@click.option(
    "--out", default="bench/results/simulate", show_default=True, help="Folder for JSON + plot."
)
@click.pass_context
def simulate(
    ctx: click.Context,
    nodes: str,
    duration: float | None,
    rate: float | None,
    churn_per_min: float,
    max_views: int | None,
    k_nearest: int | None,
    cell_nodes: int | None,
    seed: int,
    from_json: tuple[str, ...],
    spec: str | None,
    out: str,
) -> None:
    """Simulate the real routing code at swarm scale (simpy): `p2pnode simulate --nodes 100,1000`.

    The real router, digests, views and scoped views on a simulated clock and WAN; prints a
    table and writes simulate.json, table.md and simulate.png into --out (docs/testnet.md).
    """
    from p2pnode.testnet.sim import _cli as sim
    from p2pnode.testnet.spec import SpecError

    if spec is not None:
        try:
            sim.run_spec(spec)
        except (SpecError, ValueError, OSError) as exc:
            raise click.BadParameter(str(exc), param_hint="--spec") from None
        return
    if from_json:
        try:
            sim.replot(from_json, Path(out))
        except (OSError, ValueError, KeyError) as exc:
            why = f"{exc} (give simulate.json files of earlier runs)"
            raise click.BadParameter(why, param_hint="--from-json") from None
        return
    try:
        sizes = [int(x) for x in nodes.split(",") if x]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 2:
        why = "a comma list of sizes of at least 2, e.g. 100,1000,10000"
        raise click.BadParameter(why, param_hint="--nodes")
    config = sim.config(
        duration_s=duration,
        rate_per_s=rate,
        churn_per_min=churn_per_min,
        seed=seed,
        max_views=max_views,
        k_nearest=k_nearest,
        cell_nodes=cell_nodes,
    )
    sim.run(sizes, config, Path(out), command=command_line(ctx))
