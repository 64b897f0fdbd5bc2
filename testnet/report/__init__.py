"""Reporting trials: ``tables.py`` (tables, plots) and ``page.py`` (docs/results.md)."""
