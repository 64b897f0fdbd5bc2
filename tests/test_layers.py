"""No two modules import each other when loaded; the import layers themselves are import-linter's.

The layers (identity and inference at the bottom, overlay, speculation, bootstrap and testnet on
top, product code never importing the node assembly or the trials) are contracts in
pyproject.toml, checked by ``tools/lint_imports.py`` (``make test`` runs it before pytest). What
stays here is what import-linter cannot judge: a cycle among imports run when a module is
loaded. Its graph has one edge per imported module, lazy imports (inside functions) and
``if TYPE_CHECKING`` ones included, and its cycle contract (``acyclic_siblings``) cannot leave
them out without dropping them from the layer contracts too; yet a lazy or type-checking import
is exactly how a module legitimately points back at one that imports it. This reads the imports
with ``ast`` and tells the two kinds apart. It also checks that the link tree the import-linter
run walks holds every installed module, so the contracts never pass on an empty graph.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "identity",
    "inference",
    "datasets",
    "overlay",
    "speculation",
    "bootstrap",
    "testnet",
    "testing",
)


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
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT / package).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join(["p2pnode", package, *parts])] = path
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


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
    node_imports = {t for t, _ in _imports(modules["p2pnode.overlay.net.node"])}
    assert "p2pnode.overlay.net.addrs.AddressBook" in node_imports
    lazy = dict(_imports(modules["p2pnode.bootstrap.node"]))
    # inside a function: lazy
    assert lazy.get("p2pnode.overlay.net.reachability.ReachabilityService") is False


def _lint_tool():
    spec = importlib.util.spec_from_file_location(
        "lint_imports", ROOT / "tools" / "lint_imports.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_import_linter_tree_holds_every_installed_module(tmp_path):
    tree = _lint_tool().build_tree(ROOT, tmp_path / "tree")
    linked = set()
    for path in tree.rglob("*.py"):
        assert path.is_symlink() and path.resolve().is_file(), path
        parts = [p for p in path.relative_to(tree).with_suffix("").parts if p != "__init__"]
        linked.add(".".join(parts))
    # bootstrap/_namespace is the root package itself, not a subpackage of bootstrap
    installed = {m for m in _modules() if not m.startswith("p2pnode.bootstrap._namespace")}
    root = {
        "p2pnode" if m.stem == "__init__" else f"p2pnode.{m.stem}"
        for m in (ROOT / "bootstrap" / "_namespace").glob("*.py")
    }
    assert linked == installed | root
