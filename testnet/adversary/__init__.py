"""Peers that lie: ``liars.py`` (how each kind lies) and ``trial.py`` (what they got away with)."""
