"""p2pnode.testnet: trials of the overlay, on one machine or across hosts, and the simulator.

Product code never imports this package (checked by import-linter in ``make test``); the CLI's
``testnet`` and ``simulate`` commands load it on demand.

Map of the package:
- A trial: ``spec.py`` (``load_spec``: one TOML file, nodes, regions, links, workload, arms;
  shipped specs under ``specs/``) -> ``run_trial.py`` (``run_trial``: each arm on fresh
  processes) -> ``launch.py`` (node processes, forked by ``zygote.py``; ``capacity.py`` checks
  they fit first; ``formation.py`` judges when the overlay has formed; ``node.py``: a trial's
  node, with ``wan.py``'s userspace WAN delays) ->
  ``driver.py`` (MMLU requests through the nodes' HTTP API; ``chat.py``: chat sessions) ->
  ``report.py`` (tables, plots) and ``results_page.py`` (docs/results.md).
- Trials with faults: ``churn.py`` (nodes leave and join), ``adversary.py`` and ``liars.py``
  (peers that lie, and what they got away with).
- Across hosts: ``netns.py`` (network namespaces, bridges, NAT routers) and ``swarm.py`` (nodes
  started with the flags a user types).
- In one process, for tests and benches: ``apicluster.py`` (full nodes), ``localcluster.py``
  (emulated engines); ``browser.py`` (headless Chromium for the console).
- At swarm scale: ``sim/`` (``p2pnode simulate``: the real router, digests and views on a simpy
  clock; its package doc maps the world, workload, node, run and report modules), entered by
  ``simulate.py``; ``simspec.py`` (a trial spec on the simulator).
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
