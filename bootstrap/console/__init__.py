"""The node's web console: a page at ``/`` and the JSON/SSE endpoints it reads (docs/console.md).

- ``feed.py``: ``ConsoleFeed``, what the console shows, as plain data: the swarm (peers, their
  state, RTT, connection kind, roles, models, queue, cache, trust), this node's history (cache
  size, hit rate, evictions, queue, tokens/s, push-back), recent routing decisions with every
  candidate's estimate and the reason, speculation sessions.
- ``routes.py``: ``console_routes(feed, health)``: the Starlette routes (page, static files,
  ``/console/api/*``).
- ``static/``: the page, its script and style sheet (no outside fetch: nodes may be offline).
"""

from p2pnode.bootstrap.console.feed import ConsoleFeed as ConsoleFeed
from p2pnode.bootstrap.console.routes import console_routes as console_routes

__all__ = ["ConsoleFeed", "console_routes"]
