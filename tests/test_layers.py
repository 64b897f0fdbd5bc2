"""No two modules import each other when loaded; the import layers themselves are import-linter's.

The layers and rooms are contracts in pyproject.toml and the load-time cycle check is
``load_time_cycles``, both run by ``tools/lint_imports.py`` (``make test`` runs it before
pytest). These tests run the cycle check over the installed modules too, show that it finds a
cycle and tells a load-time import from a lazy or type-checking one, and check that the link
tree both walk holds every module the checkout has, so neither passes on an empty graph. And
a module over ``LONG_MODULE`` lines says in its docstring's first lines why it is one module
("One file ... on purpose: ..."), so a long module is a choice someone can read, not drift.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lint_tool():
    spec = importlib.util.spec_from_file_location(
        "lint_imports", ROOT / "tools" / "lint_imports.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_between_modules_at_load_time(tmp_path):
    lint = _lint_tool()
    cycles = lint.load_time_cycles(lint.build_tree(ROOT, tmp_path / "tree"))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_check_finds_a_cycle_run_at_load_time_and_no_other(tmp_path):
    lint = _lint_tool()
    tree = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            # a real circle: loading a loads b, which loads c, which loads a
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "import pkg.c\n",
            "pkg/c.py": "from pkg.a import NAME\nNAME = 1\n",
            # pointing back lazily or for the type checker only is no circle
            "pkg/d.py": "import pkg.e\n",
            "pkg/e.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg import d
                def later():
                    from pkg.d import x
                class K:
                    def method(self):
                        import pkg.d
                """,
            # a class body runs when the module loads
            "pkg/f.py": "class K:\n    from pkg import g\n",
            "pkg/g.py": "from . import f\n",
        },
    )
    cycles = lint.load_time_cycles(tree)
    assert sorted(map(tuple, cycles)) == [
        ("pkg.a", "pkg.b", "pkg.c", "pkg.a"),
        ("pkg.f", "pkg.g", "pkg.f"),
    ]


def test_the_check_sees_the_imports_it_judges(tmp_path):
    lint = _lint_tool()
    graph = lint.import_graph(lint.build_tree(ROOT, tmp_path / "tree"))
    assert "p2pnode.overlay.net.addrs" in graph["p2pnode.overlay.net.node"]
    # bootstrap/node.py imports the reachability service inside a function: lazy
    assert "p2pnode.overlay.net.reachability" not in graph["p2pnode.bootstrap.node"]
    assert sum(map(len, graph.values())) > 300


def test_the_import_linter_tree_holds_every_installed_module(tmp_path):
    tree = _lint_tool().build_tree(ROOT, tmp_path / "tree")
    linked = set()
    for path in tree.rglob("*.py"):
        assert path.is_symlink() and path.resolve().is_file(), path
        parts = [p for p in path.relative_to(tree).with_suffix("").parts if p != "__init__"]
        linked.add(".".join(parts))
    # Every Python file under each top-level package's folder, read from the folders rather
    # than from the packages list: a subfolder missing from that list is neither installed
    # nor linted, and this names it.
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for package, folder in setuptools["package-dir"].items():
        if package.count(".") != 1:
            continue
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if rel[0] == "_namespace":  # bootstrap/_namespace is the root package itself
                continue
            found.add(".".join([package, *(p for p in rel if p != "__init__")]))
    root = {
        "p2pnode" if m.stem == "__init__" else f"p2pnode.{m.stem}"
        for m in (ROOT / "bootstrap" / "_namespace").glob("*.py")
    }
    assert len(found) > 60
    assert linked == found | root


LONG_MODULE = 600
REASON_PENDING: set[str] = set()  # none: every long module says why


def test_a_module_over_600_lines_says_why_in_its_first_lines(tmp_path):
    tree = _lint_tool().build_tree(ROOT, tmp_path / "tree")
    unexplained = set()
    for path in tree.rglob("*.py"):
        lines = path.read_text().splitlines()
        if len(lines) > LONG_MODULE and "on purpose" not in " ".join(lines[:8]):
            parts = [p for p in path.relative_to(tree).with_suffix("").parts if p != "__init__"]
            unexplained.add(".".join(parts))
    assert unexplained <= REASON_PENDING, (
        f"over {LONG_MODULE} lines with no reason in the docstring's first lines (split the "
        f"module, or say why it is one): {sorted(unexplained - REASON_PENDING)}"
    )
