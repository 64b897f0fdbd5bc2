"""Run import-linter (the contracts in pyproject.toml) on the p2pnode package as installed.

Why a tree of links: our packages sit in several top-level folders and install under one
``p2pnode`` namespace (setuptools ``package-dir``). grimp, import-linter's graph builder, finds
a root package and walks its folder; ``p2pnode`` is ``bootstrap/_namespace`` and holds no
subpackage, and grimp refuses ``p2pnode.overlay`` as a root because its parent is a regular
package. So this lays the installed layout out as a real ``p2pnode/`` folder of symlinks to the
sources (under ``build/import-graph``, from the same ``package-dir`` table setuptools reads),
puts it first on ``PYTHONPATH`` and runs ``lint-imports`` there. Line numbers and file names in
its report are the sources' own, since each link points at the file in the checkout.

Then it checks what import-linter cannot judge: that no two p2pnode modules import each other
when loaded (``load_time_cycles``). import-linter's graph holds every import, those inside
functions and under ``if TYPE_CHECKING`` too, and its cycle contract cannot leave them out
without dropping them from the layer contracts as well; yet a lazy import is exactly how a module
legitimately points back at one that imports it. So this reads the imports of the same link tree
with ``ast`` and keeps those that run when the module is loaded.

Exit status: non-zero when a contract is broken or a load-time cycle exists.
"""

from __future__ import annotations

import ast
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


def _modules(tree: Path) -> dict[str, Path]:
    """Every module in the link tree, by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(tree.rglob("*.py")):
        parts = path.relative_to(tree).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def load_time_imports(path: Path, module: str) -> list[str]:
    """What loading ``module`` (the file ``path``) imports: the dotted names of its imports at
    module level and in class bodies, not inside functions nor under ``if TYPE_CHECKING``
    (``from a import b`` gives ``a`` and ``a.b``, whichever of them is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue  # runs when called, not when loaded
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for branch in child.orelse:  # the else branch does run
                    visit(ast.Module(body=[branch], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                names.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package, up level - 1 more
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                names.append(base)
                names.extend(f"{base}.{alias.name}" for alias in child.names)
            else:
                visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return names


def import_graph(tree: Path) -> dict[str, set[str]]:
    """Module -> the modules of the tree that loading it loads first (a target's enclosing
    packages too, except those of the importer itself, which are loading already)."""
    modules = _modules(tree)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        own = {".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 1)}
        for name in load_time_imports(path, module):
            parts = name.split(".")
            for k in range(1, len(parts) + 1):
                target = ".".join(parts[:k])
                if target in modules and target != module and target not in own:
                    graph[module].add(target)
    return graph


def load_time_cycles(tree: Path) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) through each group of modules that import each
    other when loaded (strongly connected components, Tarjan's algorithm); [] when none."""
    graph = import_graph(tree)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, inside the group (breadth first)."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if nxt not in came:
                    came[nxt] = node
                    following.append(nxt)
        frontier = following
    return sorted(group)  # unreachable for a strongly connected group


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
    code = subprocess.run(command, cwd=tree, env=env, check=False).returncode
    cycles = load_time_cycles(tree)
    for cycle in cycles:
        print("load-time import cycle: " + " -> ".join(cycle), file=sys.stderr)
    if not cycles:
        print("No load-time import cycle among p2pnode modules.")
    return code or (1 if cycles else 0)


if __name__ == "__main__":
    sys.exit(main())
