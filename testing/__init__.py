"""Fixtures for tests and benches (the ``trio.testing`` pattern): never imported by the product.

- ``apicluster.py``: full nodes with their HTTP API, in one process.
- ``localcluster.py``: nodes with emulated engines, in one process.
- ``browser.py``: headless Chromium for the console.
- ``waiting.py``: ``wait_until``, the one polling wait of the tests and benches.
"""
