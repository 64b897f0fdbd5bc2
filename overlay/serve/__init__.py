"""Serving a model across the overlay: the composition root of routing, forwarding and trust.

Map: ``service.py`` (``RoutedService``: the router's choice, the forward, fallback, audit and
trust), ``forward.py`` (the forward protocol, its server and client call), ``failover.py``
(an answer continued across the targets a request fails over to), ``probation.py`` (new peers
earn trust before their answers are released).
"""
