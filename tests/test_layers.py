"""The layer rule and the no-cycle rule, read from the source with `ast`: every import of every
module in dsl/, backend/, grammars/ and kernels/ (module level, inside functions and under
TYPE_CHECKING alike) is mapped to the file it names, through pyproject's package-dir table.

Layers point one way: dsl → backend → grammars → kernels, and dsl may also use grammars; a
layer never imports one to its left. Between files there is no import cycle. Inside a folder,
imports are explicit relative ones (`from .engine import Engine`), so a reader finds the file
without the table; imports that cross folders stay absolute (`radixlm.grammars`,
`radixlm.kernels`) because the folders are siblings on disk but nested in the import namespace.
The checker runs on the real tree and, to show it catches what it looks for, on small fake trees.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Which layers each layer may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "dsl": {"backend", "grammars"},
    "backend": {"grammars", "kernels"},
    "grammars": {"kernels"},
    "kernels": set(),
}
# Cycles known and owned elsewhere, each as the sorted tuple of its files. Empty is the goal.
KNOWN_CYCLES: set[tuple[str, ...]] = set()
# Folders whose intra-folder imports are still absolute. Empty is the goal.
RELATIVE_PENDING: set[str] = set()


@dataclass(frozen=True)
class Edge:
    src: str  # file, relative to the root
    dst: str
    line: int
    name: str  # the module name as written, after resolving a relative import


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject's package-dir: import name → folder (relative to root)."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    return dict(data["tool"]["setuptools"]["package-dir"])


def module_files(root: Path, pkg_dirs: dict[str, str]) -> dict[str, str]:
    """Every module name → its file (relative), for the folders named in package-dir."""
    out: dict[str, str] = {}
    for pkg, folder in pkg_dirs.items():
        base = root / folder
        for path in sorted(base.glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            out[name] = str(path.relative_to(root))
    return out


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(absolute module name, line) for every import; `from X import y` yields X.y as well, so
    a submodule imported by name resolves to its own file."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:
                yield f"{target}.{alias.name}", node.lineno
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


def import_edges(root: Path, pkg_dirs: dict[str, str] | None = None) -> list[Edge]:
    """Every import from one of the tree's files to another (imports of other packages dropped)."""
    pkg_dirs = pkg_dirs if pkg_dirs is not None else package_dirs(root)
    files = module_files(root, pkg_dirs)
    edges: list[Edge] = []
    for module, rel in files.items():
        tree = ast.parse((root / rel).read_text(), filename=rel)
        seen: set[tuple[str, int]] = set()
        for name, line in _imported_names(tree, module, rel.endswith("__init__.py")):
            dst = files.get(name)
            if dst is None or dst == rel or (dst, line) in seen:
                continue
            seen.add((dst, line))
            edges.append(Edge(rel, dst, line, name))
    return _drop_parent_of_submodule(edges, files)


def _drop_parent_of_submodule(edges: list[Edge], files: dict[str, str]) -> list[Edge]:
    """`from radixlm.backend import engine` names both the package and its submodule; keep only
    the submodule's edge unless the statement also took a plain name from the package."""
    by_line: dict[tuple[str, int], list[Edge]] = {}
    for e in edges:
        by_line.setdefault((e.src, e.line), []).append(e)
    keep: list[Edge] = []
    for group in by_line.values():
        names = {e.name for e in group}
        for e in group:
            subs = [n for n in names if n.startswith(e.name + ".")]
            if subs and e.dst.endswith("__init__.py"):
                continue
            keep.append(e)
    return keep


def layer_of(rel: str, pkg_dirs: dict[str, str]) -> str:
    return rel.split("/", 1)[0]


def layer_violations(edges: list[Edge], pkg_dirs: dict[str, str]) -> list[str]:
    bad = []
    for e in edges:
        src, dst = layer_of(e.src, pkg_dirs), layer_of(e.dst, pkg_dirs)
        if src != dst and dst not in ALLOWED.get(src, set()):
            bad.append(f"{e.src}:{e.line} imports {e.name} ({src} → {dst} is against the layers)")
    return bad


def cycles(edges: list[Edge]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one file (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def nonrelative_intra_folder(root: Path, pkg_dirs: dict[str, str]) -> list[str]:
    """Absolute `radixlm.*` imports between files of the same folder in backend/, grammars/,
    kernels/ (these should be relative so a reader needs no lookup table)."""
    files = module_files(root, pkg_dirs)
    bad = []
    for rel in files.values():
        folder = rel.split("/", 1)[0]
        if folder not in ("backend", "grammars", "kernels"):
            continue
        tree = ast.parse((root / rel).read_text(), filename=rel)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                dst = files.get(name) or files.get(name.rpartition(".")[0])
                if name.startswith("radixlm") and dst and dst.split("/", 1)[0] == folder:
                    bad.append(f"{rel}:{node.lineno} imports {name} absolutely")
    return bad


# ---------------------------------------------------------------- the real tree


def test_layers_point_one_way() -> None:
    pkg_dirs = package_dirs(ROOT)
    bad = layer_violations(import_edges(ROOT, pkg_dirs), pkg_dirs)
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_files() -> None:
    found = [c for c in cycles(import_edges(ROOT)) if c not in KNOWN_CYCLES]
    assert not found, "import cycles:\n" + "\n".join(" ⇄ ".join(c) for c in found)
    stale = KNOWN_CYCLES - set(cycles(import_edges(ROOT)))
    assert not stale, f"listed as known but gone (remove from KNOWN_CYCLES): {stale}"


def test_imports_inside_a_folder_are_relative() -> None:
    found = nonrelative_intra_folder(ROOT, package_dirs(ROOT))
    bad = [b for b in found if b.split("/", 1)[0] not in RELATIVE_PENDING]
    assert not bad, "\n".join(bad)
    done = {p for p in RELATIVE_PENDING if not any(b.startswith(p + "/") for b in found)}
    assert not done, f"no absolute imports left in {done}: remove from RELATIVE_PENDING"


def test_every_folder_is_mapped() -> None:
    folders = set(package_dirs(ROOT).values())
    for top in ALLOWED:
        for init in (ROOT / top).rglob("__init__.py"):
            assert str(init.parent.relative_to(ROOT)) in folders, f"{init.parent} missing from package-dir"


MAX_LIBRARY_LINES = 400


def test_no_library_file_is_over_the_line_limit() -> None:
    files = module_files(ROOT, package_dirs(ROOT)).values()
    long = {f: n for f in files if (n := len((ROOT / f).read_text().splitlines())) > MAX_LIBRARY_LINES}
    assert not long, f"over {MAX_LIBRARY_LINES} lines (split by responsibility): {long}"


# ---------------------------------------------------------------- the checker catches what it looks for

FAKE_DIRS = {
    "radixlm": "dsl",
    "radixlm.backend": "backend",
    "radixlm.backend.server": "backend/server",
    "radixlm.grammars": "grammars",
    "radixlm.kernels": "kernels",
}


def _fake_tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in {
        "dsl/__init__.py": "",
        "backend/__init__.py": "",
        "backend/server/__init__.py": "",
        "grammars/__init__.py": "",
        "kernels/__init__.py": "",
        **files,
    }.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return tmp


def test_checker_flags_an_arrow_against_the_layers(tmp_path: Path) -> None:
    ok = {
        "dsl/program.py": "from radixlm.backend.engine import Engine\nimport radixlm.grammars.fsm\n",
        "backend/engine.py": "from .sched import x\nfrom radixlm.kernels import ops\n",
        "backend/sched.py": "x = 1\n",
        "grammars/fsm.py": "from radixlm.kernels.ops import f\n",
        "kernels/ops.py": "def f(): ...\n",
    }
    root = _fake_tree(tmp_path, ok)
    assert layer_violations(import_edges(root, FAKE_DIRS), FAKE_DIRS) == []
    assert cycles(import_edges(root, FAKE_DIRS)) == []
    assert nonrelative_intra_folder(root, FAKE_DIRS) == []
    # the server reaching into the language, inside a function: caught
    (root / "backend/server/programs.py").write_text("def run():\n    from radixlm.program import Program\n")
    (root / "dsl/program.py").write_text("class Program: ...\n")
    bad = layer_violations(import_edges(root, FAKE_DIRS), FAKE_DIRS)
    assert bad == [
        "backend/server/programs.py:2 imports radixlm.program (backend → dsl is against the layers)"
    ]
    # kernels importing grammars, relative across the mapping: caught too
    (root / "kernels/ops.py").write_text("import radixlm.grammars.fsm as g\n")
    assert any(
        "kernels/ops.py:1" in b and "kernels → grammars" in b
        for b in layer_violations(import_edges(root, FAKE_DIRS), FAKE_DIRS)
    )


def test_checker_flags_cycles_and_absolute_imports_in_a_folder(tmp_path: Path) -> None:
    root = _fake_tree(
        tmp_path,
        {
            "backend/a.py": "from .b import y\nx = 1\n",
            "backend/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from radixlm.backend.a import x\n",
            "backend/c.py": "def f():\n    from radixlm.backend import d\n",
            "backend/d.py": "",
        },
    )
    assert cycles(import_edges(root, FAKE_DIRS)) == [("backend/a.py", "backend/b.py")]
    assert nonrelative_intra_folder(root, FAKE_DIRS) == [
        "backend/b.py:3 imports radixlm.backend.a absolutely",
        "backend/c.py:2 imports radixlm.backend absolutely",
    ]
