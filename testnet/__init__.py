"""p2pnode.testnet: trials of the overlay, on one machine or across hosts, and the simulator.

Product code never imports this package (checked by import-linter in ``make test``); the CLI
registers the ``testnet`` and ``simulate`` commands of ``commands.py`` (click alone) and loads the
rest when one runs.

Map of the package:
- ``commands.py``: ``p2pnode testnet`` and ``p2pnode simulate``, their options and help.
- ``spec.py`` (``load_spec``: one TOML file: nodes, regions, links, the network's kind, workload,
  arms; shipped specs under ``specs/``).
- ``run/``: ``trial.py`` (``run_trial``: each arm on fresh processes) -> ``launch.py`` (node
  processes from a ``TrialNode`` plan, forked by ``zygote.py``; ``capacity.py`` checks they fit;
  ``formation.py`` judges when the overlay has formed; ``node.py``: a trial's node).
- ``workload/``: ``driver.py`` (MMLU requests through the nodes' HTTP API), ``chat.py`` (chat
  sessions), ``churn.py`` (nodes leave and join).
- ``adversary/``: ``trial.py`` (peers that lie, as trial extensions) and ``liars.py`` (what
  they got away with).
- ``report/``: ``tables.py`` (tables, plots) and ``page.py`` (docs/results.md).
- ``netns/``: ``namespaces.py`` (network namespaces, bridges, NAT routers), ``swarm.py`` (nodes
  started with the flags a user types), ``wan.py`` (the userspace WAN delay).
- ``remote/``: trials on an inventory of real hosts over SSH (``--inventory``): ``inventory.py``,
  ``ssh.py``, ``hold.py`` (the remote wrapper), ``probe.py``, ``preflight.py``, ``envs.py``,
  ``controller.py``.
- ``sim/``: ``p2pnode simulate`` (the real router, digests and views on a simpy clock; its
  package doc maps the modules), entered by ``simulate.py``; ``sim/simspec.py`` runs a trial
  spec on it.
- Fixtures for tests and benches live in ``p2pnode.testing``; data sets in ``p2pnode.datasets``.
"""

from __future__ import annotations

from p2pnode._lazy import lazy_exports

_EXPORTS = {
    "TrialSpec": "spec",
    "SpecError": "spec",
    "load_spec": "spec",
    "builtin_specs": "spec",
    "run_trial": "run.trial",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
