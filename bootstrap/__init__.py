"""p2pnode.bootstrap: what a person runs: the CLI, node settings, the node assembly, the HTTP API.

Map of the package:
- ``cli.py``: the ``p2pnode`` command (join, bootstrap, invite, id, peers, status, edge, demo,
  testnet, simulate); ``config.py``: ``NodeSettings``, one dataclass filled from defaults, a TOML
  file, then flags; ``invite.py``: invite strings.
- ``node.py``: ``run_node(settings)``, the composition of key, engine, overlay node, routed
  service, verifier and HTTP API; start-up problems are ``NodeStartError`` with a message for
  the person at the terminal. ``extension.py``: ``NodeExtension``, what a caller (a trial) adds
  to a node it starts: ``run_node(settings, extensions=[...])``. ``status.py``: what a node
  reports in ``GET /status`` (views, routing, probation, process cost).
- ``api/``: the OpenAI-compatible HTTP API (its own map in ``api/__init__.py``); ``auth.py``,
  ``health.py``, ``metrics.py`` (Prometheus), ``console/`` (the web console).
- ``demo.py``: ``p2pnode demo``, the main job on one machine.

The names below are lazy re-exports: importing this package loads neither torch nor libp2p, so
``p2pnode --help`` stays quick.
"""

from __future__ import annotations

from p2pnode._lazy import lazy_exports

_EXPORTS = {
    "NodeSettings": "config",
    "ConfigError": "config",
    "settings_from": "config",
    "run_node": "node",
    "NodeStartError": "node",
    "NodeExtension": "extension",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
