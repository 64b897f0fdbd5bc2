"""A trial's node: ``run_node`` with the trial's WAN delays injected into its connections.

``python -m p2pnode.testnet.run.node PLAN`` runs the node a ``TrialNode`` plan (a JSON file the
launcher writes, ``testnet/run/launch.py``) describes: it installs the userspace WAN emulation
of the plan's spec for its region (``testnet/netns/wan.py``), raises the overlay's timeouts to
what the spec's worst link from there needs unless the plan sets them, builds ``NodeSettings``
from the plan's settings and runs ``run_node`` on them. The product's own node assembly knows
nothing of emulated WANs; only trials start nodes through here.

A plan's ``adversary`` (a spec's ``[[adversary]]``) makes the node lie to the peers it serves,
as ``testnet/adversary/trial.py`` says, through the node's own service: an ``Adversary``
extension (``bootstrap/extension.py``) that ``run_node`` calls once the service runs, so its
forward server, its digests, its trust and audits are the product's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2pnode.testnet.netns import wan

if TYPE_CHECKING:
    import trio

    from p2pnode.bootstrap.config import NodeSettings
    from p2pnode.overlay.serve.service import RoutedService

__all__ = ["Adversary", "TrialNode", "listen_ip", "main"]

log = logging.getLogger("p2pnode.testnet.adversary.trial")


@dataclass
class TrialNode:
    """One trial node: its settings (``NodeSettings`` field names, as ``settings_from`` takes
    them), the WAN it runs in and, for a liar, its adversary."""

    settings: dict[str, Any]
    wan_spec: str
    region: str
    adversary: Adversary | None = None

    def __post_init__(self) -> None:
        if isinstance(self.adversary, dict):  # read back from JSON
            self.adversary = Adversary(**self.adversary)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1, default=str) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> TrialNode:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise SystemExit(f"cannot read the trial node plan {path}: {exc}") from None

    def node_settings(self) -> NodeSettings:
        """The plan's settings, with the WAN's suggested timeouts where it sets none;
        ``SystemExit`` naming what is wrong."""
        from p2pnode.bootstrap.config import ConfigError, settings_from

        try:
            suggested = wan.suggested_timeouts(self.wan_spec, self.region)
        except (wan.WanError, OSError, ValueError) as exc:
            raise SystemExit(f"cannot emulate the WAN of {self.wan_spec}: {exc}") from None
        try:
            timeouts = {k: suggested[k] for k in ("ping_timeout", "connect_timeout")}
            return settings_from({**timeouts, **self.settings})
        except ConfigError as exc:
            raise SystemExit(f"trial node settings: {exc}") from None


@dataclass
class Adversary:
    """A ``NodeExtension``: once the service runs, it serves its peers as ``kind`` does."""

    kind: str
    rate: float = 0.05
    forge: bool = False

    def __post_init__(self) -> None:
        from p2pnode.testnet.adversary.trial import KINDS

        if self.kind not in KINDS:
            raise ValueError(f"adversary {self.kind!r}: use one of {', '.join(KINDS)}")
        if not 0 < self.rate <= 1:
            raise ValueError(f"adversary rate must be in (0, 1], got {self.rate}")

    def service_started(self, service: RoutedService, nursery: trio.Nursery) -> None:
        from p2pnode.testnet.adversary import trial as adversary

        adversary.install(service, nursery, self.kind, rate=self.rate, forge=self.forge)
        log.warning(
            "ADVERSARY: this node serves its peers as %r%s%s",
            self.kind,
            f" (rate {self.rate:g})" if self.kind == "wrong-output" else "",
            ", with a forged digest" if self.forge else "",
        )


def _log_to_stderr(level: str) -> None:
    """The emulation logs what it installed before the node starts: set up the node log's
    format first."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    logging.getLogger("p2pnode.testnet.netns.wan").setLevel(logging.INFO)


def listen_ip(listen: Sequence[str]) -> str | None:
    """The IPv4 address of the node's first ``/ip4/<ip>/...`` listen address, if any: its
    connections leave from there (see ``testnet/netns/wan.py``)."""
    for addr in listen:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return None if parts[2] == "0.0.0.0" else parts[2]  # a namespace host's own IP
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        raise SystemExit("usage: python -m p2pnode.testnet.run.node PLAN.json (see launch.py)")
    plan = TrialNode.read(Path(args[0]))
    settings = plan.node_settings()
    _log_to_stderr(settings.log_level)
    try:
        wan.install(plan.wan_spec, plan.region, source_ip=listen_ip(settings.listen))
    except (wan.WanError, OSError, ValueError) as exc:
        raise SystemExit(f"cannot emulate the WAN of {plan.wan_spec}: {exc}") from None
    extensions = [plan.adversary] if plan.adversary is not None else []
    _run(settings, extensions)


def _run(settings: NodeSettings, extensions: list[Adversary]) -> None:
    import trio

    from p2pnode.bootstrap.node import NodeStartError, run_node

    try:
        trio.run(partial(run_node, settings, extensions=extensions))
    except KeyboardInterrupt:
        pass
    except (NodeStartError, BaseExceptionGroup) as exc:
        # A start-up check that fails inside one of the node's nurseries arrives wrapped in a
        # group: the log should say what it was. Anything else keeps its traceback.
        failed = exc.split(NodeStartError)[0] if isinstance(exc, BaseExceptionGroup) else exc
        if failed is None:
            raise
        while isinstance(failed, BaseExceptionGroup):
            failed = failed.exceptions[0]
        raise SystemExit(f"the trial node did not start: {failed}") from None


if __name__ == "__main__":
    main()
