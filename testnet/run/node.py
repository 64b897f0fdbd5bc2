"""A trial's node: ``p2pnode`` with the trial's WAN delays injected into its connections.

``python -m p2pnode.testnet.run.node <p2pnode args> --wan-spec SPEC --region R`` installs the
userspace WAN emulation of ``SPEC`` for region ``R`` (``testnet/netns/wan.py``), raises the
overlay's timeouts to what the spec's worst link from ``R`` needs unless the arguments set
them, and then runs the ``p2pnode`` command line with the remaining arguments. The product's
own node assembly knows nothing of emulated WANs; only trials start nodes through here.

``--adversary KIND [--adversary-rate R] [--adversary-forge]`` (a spec's ``[[adversary]]``) makes the node lie to
the peers it serves, as ``testnet/adversary/trial.py`` says, through the node's own service
(``bootstrap.node.SERVICE_HOOKS``): its forward server, its digests, its trust and audits are
the product's.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from p2pnode.testnet.netns import wan

__all__ = ["listen_ip", "main", "split_adversary_args", "split_wan_args"]


def split_adversary_args(argv: Sequence[str]) -> tuple[str | None, float, bool, list[str]]:
    """(kind or None, rate, forge, the other arguments); ``SystemExit`` for a bad value."""
    rest: list[str] = []
    kind: str | None = None
    rate = 0.05
    forge = False
    args = list(argv)
    i = 0
    while i < len(args):
        if args[i] == "--adversary-forge":
            forge = True
            i += 1
            continue
        if args[i] in ("--adversary", "--adversary-rate"):
            if i + 1 >= len(args):
                raise SystemExit(f"{args[i]} needs a value")
            if args[i] == "--adversary":
                kind = args[i + 1]
            else:
                try:
                    rate = float(args[i + 1])
                except ValueError:
                    raise SystemExit(f"--adversary-rate: {args[i + 1]!r} is not a number") from None
            i += 2
            continue
        rest.append(args[i])
        i += 1
    from p2pnode.testnet.adversary.trial import KINDS

    if kind is not None and kind not in KINDS:
        raise SystemExit(f"--adversary {kind!r}: use one of {', '.join(KINDS)}")
    if not 0 < rate <= 1:
        raise SystemExit(f"--adversary-rate must be in (0, 1], got {rate}")
    if forge and kind is None:
        raise SystemExit("--adversary-forge needs --adversary KIND")
    return kind, rate, forge, rest


def split_wan_args(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """(spec, region, the other arguments); ``SystemExit`` naming what is missing."""
    rest: list[str] = []
    found: dict[str, str] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        if args[i] in ("--wan-spec", "--region"):
            if i + 1 >= len(args):
                raise SystemExit(f"{args[i]} needs a value")
            found[args[i]] = args[i + 1]
            i += 2
            continue
        rest.append(args[i])
        i += 1
    missing = [flag for flag in ("--wan-spec", "--region") if flag not in found]
    if missing:
        raise SystemExit(f"a trial node needs {' and '.join(missing)}")
    return found["--wan-spec"], found["--region"], rest


def _log_wan_to_stderr() -> None:
    """The emulation logs what it installed before the CLI sets up logging: give its logger
    a handler of its own, in the node log's format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
    )
    log = logging.getLogger("p2pnode.testnet.netns.wan")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def listen_ip(args: Sequence[str]) -> str | None:
    """The IPv4 address of the node's first ``--listen /ip4/<ip>/...`` argument, if any: its
    connections leave from there (see ``testnet/netns/wan.py``)."""
    for flag, value in zip(args, args[1:], strict=False):
        parts = value.split("/")
        if flag == "--listen" and len(parts) > 2 and parts[1] == "ip4":
            return None if parts[2] == "0.0.0.0" else parts[2]  # a namespace host's own IP
    return None


def main(argv: Sequence[str] | None = None) -> None:
    spec, region, rest = split_wan_args(sys.argv[1:] if argv is None else argv)
    kind, rate, forge, rest = split_adversary_args(rest)
    _log_wan_to_stderr()
    try:
        wan.install(spec, region, source_ip=listen_ip(rest))
        suggested = wan.suggested_timeouts(spec, region)
    except (wan.WanError, OSError, ValueError) as exc:
        raise SystemExit(f"cannot emulate the WAN of {spec}: {exc}") from None
    for flag, key in (("--ping-timeout", "ping_timeout"), ("--connect-timeout", "connect_timeout")):
        if flag not in rest:
            rest += [flag, str(suggested[key])]
    if kind is not None:
        _become_adversary(kind, rate, forge)
    from p2pnode.bootstrap.cli import main as cli_main

    cli_main(rest)


def _become_adversary(kind: str, rate: float, forge: bool) -> None:
    from p2pnode.bootstrap.node import SERVICE_HOOKS
    from p2pnode.testnet.adversary import trial as adversary

    def hook(service, nursery) -> None:
        adversary.install(service, nursery, kind, rate=rate, forge=forge)
        logging.getLogger("p2pnode.testnet.adversary.trial").warning(
            "ADVERSARY: this node serves its peers as %r%s%s",
            kind,
            f" (rate {rate:g})" if kind == "wrong-output" else "",
            ", with a forged digest" if forge else "",
        )

    SERVICE_HOOKS.append(hook)


if __name__ == "__main__":
    main()
