"""Dependencies point one way, checked on the source (every import, lazy ones included).

identity at the bottom; inference alone; overlay above identity and inference; speculation
above overlay; bootstrap (the CLI and node assembly) and testnet (trials) on top. No product
package imports the trials or the node assembly, and no two modules import each other when
loaded. import-linter would be the tool for this, but its graph builder (grimp) walks the
root package's folder, and ours install from several top-level folders under one namespace
(setuptools ``package-dir``), so it sees no subpackage at all; this reads the same imports
with ``ast``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package -> the packages of ours it may import (itself always)
ALLOWED = {
    "identity": set(),
    "inference": set(),
    "overlay": {"identity", "inference"},
    "speculation": {"identity", "inference", "overlay"},
    "bootstrap": {"identity", "inference", "overlay", "speculation", "testnet"},
    "testnet": {"identity", "inference", "overlay", "speculation", "bootstrap"},
}
PRODUCT = ("identity", "inference", "overlay", "speculation")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported p2pnode module or module.name, loaded with the module?) for every import
    in ``path``:
    module level and not under ``if TYPE_CHECKING`` counts as loaded with it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, at_load) for a in child.names if a.name.startswith("p2pnode."))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("p2pnode"):
                # "from p2pnode.x import y": y may be a module of x or a name in it
                out.extend((f"{child.module}.{a.name}", at_load) for a in child.names)
            elif (
                isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
                or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            ):
                visit(child, False)
            else:
                visit(child, at_load)

    visit(tree, True)
    return out


def _modules() -> dict[str, Path]:
    out = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT / package).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join(["p2pnode", package, *parts])] = path
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_package_imports_only_the_layers_below_it():
    bad = []
    for module, path in _modules().items():
        own = _package(module)
        for target, _ in _imports(path):
            other = _package(target)
            if other is not None and other != own and other not in ALLOWED[own]:
                bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_product_code_never_imports_trials_or_the_node_assembly():
    bad = [
        f"{path.relative_to(ROOT)} imports {target}"
        for module, path in _modules().items()
        if _package(module) in PRODUCT
        for target, _ in _imports(path)
        if _package(target) in ("bootstrap", "testnet")
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules_at_load_time():
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for target, at_load in _imports(path):
            hit = target if target in modules else target.rsplit(".", 1)[0]
            hit = hit if hit in modules else None
            if at_load and hit is not None and hit != module:
                graph[module].add(hit)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_the_imports_it_judges():
    modules = _modules()
    assert len(modules) > 60
    node_imports = {t for t, _ in _imports(modules["p2pnode.overlay.node"])}
    assert "p2pnode.overlay.addrs.AddressBook" in node_imports
    lazy = dict(_imports(modules["p2pnode.bootstrap.node"]))
    # inside a function: lazy
    assert lazy.get("p2pnode.overlay.reachability.ReachabilityService") is False
