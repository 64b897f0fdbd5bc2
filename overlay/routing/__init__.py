"""Routing: which peer serves a request.

Map: ``router.py`` (``Router.decide``: the cost function and the placement of misses; its
contract is at the top), ``netcost.py`` (learned network cost per peer), ``sessions.py``
(sticky chat sessions).
"""
