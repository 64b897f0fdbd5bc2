"""A trial's inventory: the machines a trial runs on, read from a TOML file.

Contract:
- ``load_inventory(path) -> Inventory`` (``parse_inventory(data, source=...)`` for a dict);
  ``InventoryError`` names the file, the host and the key that is wrong.
- ``[ssh]`` (optional): ``identity_file``, ``known_hosts``, ``strict_host_keys`` (``"yes"`` or
  ``"accept-new"``, the default), ``config`` (a user ssh_config to include),
  ``connect_timeout_s``. ``[env]`` (optional): the default Python environment of every host.
- ``[[host]]``, one per machine: ``name`` (letters, digits, ``-``), ``address``, ``user``
  (default: the controller's), ``port`` (22), ``jump`` (the name of another host, or an
  OpenSSH ``[user@]host[:port]`` jump destination), ``region`` (a label, default ``"default"``),
  ``role`` (``bootstrap``, ``relay``, ``serving``, ``verifier``, ``light``), for serving and
  verifier hosts ``model`` (default ``"default"``) and ``engine`` (``hf``, ``vllm``,
  ``emulated``; default ``emulated``), ``api_port`` (the node's loopback API port there, 8731),
  ``workdir`` (where the run's homes and logs go, ``~/p2pnode-trials``) and ``[host.env]``.
- An env is ``python = "/path/bin/python"`` (an existing environment: the controller checks it
  runs the same code as its own) or ``create = "/path/venv"`` (the controller builds a wheel of
  its checkout and installs it into a fresh venv there, with its dependencies from the host's
  package index).
- Exactly one host is the bootstrap; at least one host takes the workload (serving, verifier
  or light). ``Inventory.redacted()`` is the inventory without key file paths (saved with
  the results).
"""

from __future__ import annotations

import getpass
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from p2pnode.errors import P2PNodeError

__all__ = [
    "ROLES",
    "Host",
    "Inventory",
    "InventoryError",
    "PythonEnv",
    "SshOptions",
    "load_inventory",
    "parse_inventory",
]

ROLES = ("bootstrap", "relay", "serving", "verifier", "light")
WORKLOAD_ROLES = ("serving", "verifier", "light")  # nodes the driver sends requests to
MODEL_ROLES = ("serving", "verifier")
ENGINES = ("hf", "vllm", "emulated")
DEFAULT_WORKDIR = "~/p2pnode-trials"
DEFAULT_API_PORT = 8731
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,39}")
_JUMP = re.compile(r"(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9._:\[\]-]+")


class InventoryError(P2PNodeError, ValueError):
    """The inventory file is missing or wrong; the message says where and why."""

    reason = "bad_inventory"


@dataclass(frozen=True)
class PythonEnv:
    python: str = ""  # an existing interpreter (checked to run the same code)
    create: str = ""  # a venv the controller creates and installs a wheel into

    @property
    def interpreter(self) -> str:
        return self.python or f"{self.create.rstrip('/')}/bin/python"


@dataclass(frozen=True)
class SshOptions:
    identity_file: str = ""
    known_hosts: str = ""
    strict_host_keys: str = "accept-new"
    config: str = ""
    connect_timeout_s: float = 10.0


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    role: str
    env: PythonEnv
    user: str = ""
    port: int = 22
    jump: str = ""  # another host's name, or an OpenSSH jump destination
    region: str = "default"
    model: str = "default"
    engine: str = "emulated"
    api_port: int = DEFAULT_API_PORT
    workdir: str = DEFAULT_WORKDIR

    @property
    def takes_workload(self) -> bool:
        return self.role in WORKLOAD_ROLES


@dataclass(frozen=True)
class Inventory:
    hosts: tuple[Host, ...]
    ssh: SshOptions = field(default_factory=SshOptions)
    path: Path | None = None

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    @property
    def bootstrap(self) -> Host:
        return next(h for h in self.hosts if h.role == "bootstrap")

    @property
    def workload_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.takes_workload]

    def start_order(self) -> list[list[Host]]:
        """Waves of hosts started together: the bootstrap, then relays and verifiers (others
        lean on them), then the rest."""
        waves = [
            [h for h in self.hosts if h.role == "bootstrap"],
            [h for h in self.hosts if h.role in ("relay", "verifier")],
            [h for h in self.hosts if h.role in ("serving", "light")],
        ]
        return [w for w in waves if w]

    def redacted(self) -> dict[str, Any]:
        """The inventory as saved with a run's results: no key or known-hosts paths."""
        ssh = asdict(self.ssh)
        for secret in ("identity_file", "known_hosts", "config"):
            if ssh[secret]:
                ssh[secret] = "(set)"
        return {"ssh": ssh, "hosts": [asdict(h) for h in self.hosts]}


class _Table:
    """One TOML table, read key by key; unknown keys are errors (a typo must not pass)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise InventoryError(f"{where}: expected a table, got {type(data).__name__}")
        self.data, self.where, self.used = data, where, set()

    def fail(self, key: str, message: str) -> InventoryError:
        return InventoryError(f"{self.where}: {key}: {message}")

    def get(self, key: str, kind: type, default: Any) -> Any:
        self.used.add(key)
        if key not in self.data:
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise self.fail(key, f"expected {kind.__name__}, got {value!r}")
        return value

    def text(self, key: str, default: str = "", choices: tuple[str, ...] = ()) -> str:
        value = self.get(key, str, default).strip()
        if choices and value not in choices:
            raise self.fail(key, f"{value!r} is not one of {', '.join(choices)}")
        return value

    def finish(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise InventoryError(f"{self.where}: unknown keys {', '.join(extra)}")


def _env(raw: Any, where: str, default: PythonEnv | None) -> PythonEnv | None:
    if raw is None:
        return default
    t = _Table(raw, where)
    env = PythonEnv(python=t.text("python"), create=t.text("create"))
    t.finish()
    if bool(env.python) == bool(env.create):
        raise InventoryError(
            f"{where}: give either python = PATH (an existing environment) or create = DIR "
            "(a venv the controller makes)"
        )
    return env


def _ssh(raw: Any) -> SshOptions:
    t = _Table(raw or {}, "[ssh]")
    opts = SshOptions(
        identity_file=t.text("identity_file"),
        known_hosts=t.text("known_hosts"),
        strict_host_keys=t.text("strict_host_keys", "accept-new", ("yes", "accept-new")),
        config=t.text("config"),
        connect_timeout_s=t.get("connect_timeout_s", float, 10.0),
    )
    t.finish()
    if not 0 < opts.connect_timeout_s <= 300:
        raise InventoryError("[ssh]: connect_timeout_s must be in (0, 300]")
    return opts


def _host(raw: Any, k: int, default_env: PythonEnv | None) -> Host:
    t = _Table(raw, f"[[host]] #{k + 1}")
    name = t.text("name")
    if not _NAME.fullmatch(name):
        raise t.fail("name", f"{name!r}: use 1-40 letters, digits and '-'")
    t.where = f"host {name!r}"
    address = t.text("address")
    if not address or any(c.isspace() for c in address):
        raise t.fail("address", "a host name or IP address is required")
    role = t.text("role", "", ROLES)
    port = t.get("port", int, 22)
    api_port = t.get("api_port", int, DEFAULT_API_PORT)
    for key, value in (("port", port), ("api_port", api_port)):
        if not 0 < value < 65536:
            raise t.fail(key, f"{value} is not a TCP port")
    jump = t.text("jump")
    if jump and not _JUMP.fullmatch(jump):
        raise t.fail("jump", f"{jump!r}: give a host name of this inventory or user@host[:port]")
    model, engine = t.text("model", "default"), t.text("engine", "emulated", ENGINES)
    if role not in MODEL_ROLES and ("model" in t.data or "engine" in t.data):
        raise t.fail("model", f"a {role} node serves no model (only serving and verifier do)")
    env = _env(t.data.get("env"), f"host {name!r}: env", default_env)
    t.used.add("env")
    if env is None:
        raise t.fail("env", "no Python environment: set [env] or [host.env] (python or create)")
    host = Host(
        name=name,
        address=address,
        role=role,
        env=env,
        user=t.text("user") or getpass.getuser(),
        port=port,
        jump=jump,
        region=t.text("region", "default") or "default",
        model=model,
        engine=engine,
        api_port=api_port,
        workdir=t.text("workdir", DEFAULT_WORKDIR).rstrip("/") or DEFAULT_WORKDIR,
    )
    t.finish()
    return host


def _check_jumps(hosts: tuple[Host, ...], source: str) -> None:
    names = {h.name: h for h in hosts}
    for h in hosts:
        seen, cur = {h.name}, h
        while cur.jump in names:  # a jump through hosts of the inventory: no cycle
            cur = names[cur.jump]
            if cur.name in seen:
                raise InventoryError(f"{source}: host {h.name!r}: jump hosts form a cycle")
            seen.add(cur.name)


def parse_inventory(
    data: Mapping[str, Any], *, source: str = "<inventory>", path: Path | None = None
) -> Inventory:
    top = _Table(data, source)
    ssh = _ssh(top.data.get("ssh"))
    default_env = _env(top.data.get("env"), f"{source}: [env]", None)
    raw_hosts = top.get("host", list, [])
    top.used.update({"ssh", "env"})
    top.finish()
    if not raw_hosts:
        raise InventoryError(f"{source}: no [[host]] tables")
    hosts = tuple(_host(raw, k, default_env) for k, raw in enumerate(raw_hosts))
    names = [h.name for h in hosts]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InventoryError(f"{source}: host names must be unique: {', '.join(dupes)}")
    boots = [h.name for h in hosts if h.role == "bootstrap"]
    if len(boots) != 1:
        raise InventoryError(
            f"{source}: exactly one host has role = 'bootstrap' (found {len(boots)})"
        )
    if not any(h.takes_workload for h in hosts):
        raise InventoryError(f"{source}: no host takes the workload (serving, verifier, light)")
    _check_jumps(hosts, source)
    return Inventory(hosts=hosts, ssh=ssh, path=path)


def load_inventory(path: str | Path) -> Inventory:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InventoryError(f"no inventory file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read the inventory {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InventoryError(f"{path}: not valid TOML: {exc}") from None
    return parse_inventory(data, source=str(path), path=path.resolve())
