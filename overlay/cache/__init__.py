"""Cache digests: what a node's KV cache holds, and how others learn it.

Map: ``digest.py`` (the format, ``DigestBuilder``), ``antientropy.py`` (gossipsub deltas, full
digests, pulls on a version gap; its settings in ``aeconfig.py``), ``views.py`` (``PeerViews``:
what we believe each peer holds), ``scope.py`` (views scoped to a model and tenant),
``privacy.py`` (what a digest may reveal).
"""
