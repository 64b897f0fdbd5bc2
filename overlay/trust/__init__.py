"""Checking peers: trust earned from what a node observes, audits and challenges.

Map: ``book.py`` (``TrustBook``: per-peer debt and the usable verdict), ``store.py``
(persistence across restarts), ``audit.py`` (re-scoring a forwarded answer against the target
model), ``challenge.py`` (known-answer challenges).
"""
