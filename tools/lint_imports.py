"""Run import-linter (the contracts in pyproject.toml) on the p2pnode package as installed.

Why a tree of links: our packages sit in several top-level folders and install under one
``p2pnode`` namespace (setuptools ``package-dir``). grimp, import-linter's graph builder, finds
a root package and walks its folder; ``p2pnode`` is ``bootstrap/_namespace`` and holds no
subpackage, and grimp refuses ``p2pnode.overlay`` as a root because its parent is a regular
package. So this lays the installed layout out as a real ``p2pnode/`` folder of symlinks to the
sources (under ``build/import-graph``, from the same ``package-dir`` table setuptools reads),
puts it first on ``PYTHONPATH`` and runs ``lint-imports`` there. Line numbers and file names in
its report are the sources' own, since each link points at the file in the checkout.

Exit status: ``lint-imports``'s (non-zero when a contract is broken).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "import-graph"


def build_tree(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Link every module of every installed package into ``tree``; returns ``tree``."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    shutil.rmtree(tree, ignore_errors=True)
    for package in setuptools["packages"]:
        source = root / package_dir[package]
        target = tree.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        # Only the package's own modules: its subpackages get their own entry in the table,
        # and a folder it happens to hold (bootstrap/_namespace) is no subpackage of it.
        for module in sorted(source.glob("*.py")):
            (target / module.name).symlink_to(module)
    return tree


def main() -> int:
    tree = build_tree()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    lint_imports = Path(sys.executable).with_name("lint-imports")
    command = [
        str(lint_imports),
        "--no-logo",
        "--no-cache",
        str(ROOT / "pyproject.toml"),
        *sys.argv[1:],
    ]
    return subprocess.run(command, cwd=tree, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
