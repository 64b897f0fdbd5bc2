"""Lazy re-exports for the package faces.

Why: a package's face names its public classes, but importing it must stay cheap (``p2pnode
--help`` must not load torch or libp2p; an emulated node must not load torch). A face lists
``name -> submodule`` and the name is imported on first use (PEP 562 ``__getattr__``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``exports[name]`` (a submodule) on first use."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
