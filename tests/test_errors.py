"""One error root: every exception class of ours is a ``P2PNodeError`` with a ``reason``.

Walks every module of the product packages (the walk finds new modules and classes by itself)
and checks each public exception class: it derives from ``p2pnode.errors.P2PNodeError``, its
``reason`` is a non-empty slug, and no two classes of one package set the same reason (a
subclass that sets none inherits its parent's, on purpose). ``p2pnode.speculation`` is walked
too; its classes are expected to fail until that package joins the root.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections import defaultdict

import pytest

from p2pnode.errors import P2PNodeError

PACKAGES = ("identity", "inference", "overlay", "speculation", "bootstrap", "testnet")
# A slug, or a wire code that predates the root: the verifier's refusals travel as their class
# names (``VerifierFull``), and older edges read them, so those reasons stay CamelCase.
_SLUG = re.compile(r"[a-z][a-z0-9_]*|[A-Z][A-Za-z]*")
# The folder installed as ``p2pnode`` itself (pyproject's package-dir); walked as a subpackage it
# would load a second, foreign copy of ``p2pnode.errors``.
NOT_A_SUBPACKAGE = "p2pnode.bootstrap._namespace"


def _modules() -> list[str]:
    out = []
    for package in PACKAGES:
        root = importlib.import_module(f"p2pnode.{package}")
        out.append(root.__name__)
        for m in pkgutil.walk_packages(root.__path__, f"{root.__name__}."):
            if not m.name.startswith(NOT_A_SUBPACKAGE):
                out.append(m.name)
    return out


def _exception_classes() -> list[type[BaseException]]:
    """Public exception classes defined (not just imported) in our modules, once each."""
    seen: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not attr.startswith("_")
            ):
                seen[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return sorted(seen.values(), key=lambda c: (c.__module__, c.__qualname__))


CLASSES = _exception_classes()


def _param(cls: type[BaseException]) -> object:
    return pytest.param(cls, id=f"{cls.__module__}.{cls.__qualname__}")


def _package(cls: type) -> str:
    return cls.__module__.split(".")[1]


def test_the_walk_finds_the_known_roots() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"IdentityError", "OverlayError", "EngineError", "WireError", "ApiError"} <= names


@pytest.mark.parametrize("cls", [_param(c) for c in CLASSES])
def test_every_error_derives_from_the_root_and_has_a_reason(cls: type[BaseException]) -> None:
    assert issubclass(cls, P2PNodeError), f"{cls.__qualname__} must derive from P2PNodeError"
    reason = cls.reason
    assert isinstance(reason, str) and _SLUG.fullmatch(reason), f"bad reason {reason!r}"
    assert reason != P2PNodeError.reason, f"{cls.__qualname__} must set a reason of its own"


def test_reasons_are_unique_within_each_package() -> None:
    owners: dict[tuple[str, str], list[str]] = defaultdict(list)
    for cls in CLASSES:
        if not issubclass(cls, P2PNodeError) or "reason" not in vars(cls):
            continue  # off the root (checked above), or an inherited reason: shared on purpose
        owners[(_package(cls), cls.reason)].append(cls.__qualname__)
    clashes = {key: names for key, names in owners.items() if len(names) > 1}
    assert not clashes, f"classes of one package with the same reason: {clashes}"


def test_builtin_bases_are_kept_for_callers_that_catch_them() -> None:
    from p2pnode.inference import EngineClosed, EngineError, PromptTooLong
    from p2pnode.overlay import BadMultiaddr

    assert issubclass(PromptTooLong, EngineError) and issubclass(EngineError, ValueError)
    assert issubclass(EngineClosed, RuntimeError) and not issubclass(EngineClosed, EngineError)
    assert issubclass(BadMultiaddr, ValueError)


def test_every_reason_the_api_answers_names_a_class() -> None:
    from p2pnode.bootstrap.api._errors import _ANSWERS

    reasons = {c.reason for c in CLASSES if issubclass(c, P2PNodeError)}
    assert set(_ANSWERS) <= reasons, set(_ANSWERS) - reasons


def test_the_wire_refusal_words_are_unchanged() -> None:
    """Peers of older versions read these: ``fwd-error`` code, ``digest-unavailable`` prefix."""
    from p2pnode.overlay.cache.digest import DROP_REASONS
    from p2pnode.overlay.limits import LimitExceeded

    assert LimitExceeded.reason == "limited"
    from p2pnode import identity

    for cls in (
        identity.MalformedEnvelope,
        identity.EnvelopeTooLarge,
        identity.BadSignature,
        identity.ExpiredEnvelope,
        identity.WrongSigner,
    ):
        assert cls.reason in DROP_REASONS  # digest drops count under the identity reason
