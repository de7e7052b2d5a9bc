"""Check shardtrain's import layers: ``python -m shardtrain.tools.layers [--root DIR]``.

The package is a stack of layers, lowest first, in ``LAYERS`` below (the one home of that order).
Data flows one way: configuration is read, models and data are built, spread over ranks,
checkpointed, diagnosed, and the training loop and the command line sit on top. A module may
import from its own layer or a lower one; a lower layer never knows a higher one, so each part
can be read, tested and reused without dragging in what is built on it. Import circles are
forbidden too, and imports inside functions belong in ``shardtrain/cli`` only: the command line
defers heavy imports (torch) for start-up time, everywhere else an import states a dependency at
the top of the file where a reader sees it.

The check is static (``ast``); it never imports the modules it checks.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["shardtrain.version", "shardtrain.errors", "shardtrain.logs", "shardtrain.faults",
              "shardtrain.accelerator", "shardtrain.durable"]),
    ("config", ["shardtrain.config"]),
    ("models", ["shardtrain.models"]),
    ("data", ["shardtrain.data"]),
    # The task contract (model, data, loss of any kind) and the built-in language-model task.
    ("tasks", ["shardtrain.tasks"]),
    ("distributed", ["shardtrain.distributed"]),
    ("checkpoint", ["shardtrain.checkpoint"]),
    # shardtrain.report reads what runs wrote (metrics.jsonl, config.yaml) and draws it.
    ("diagnostics", ["shardtrain.diagnostics", "shardtrain.report"]),
    ("generation", ["shardtrain.generation"]),
    ("export", ["shardtrain.export"]),
    ("train", ["shardtrain.train"]),
    # "shardtrain" is the root package __init__, the public facade.
    ("cli", ["shardtrain.cli", "shardtrain.__main__", "shardtrain.tools", "shardtrain"]),
]
LAZY_OK = ["shardtrain.cli", "shardtrain.__main__"]  # the only modules that may import inside functions
UPWARD = "a lower layer must not import a higher one"
LAZY = "import inside a function: lazy imports belong in shardtrain/cli only"

def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _rename(name: str, package: str) -> str:
    return package + name.removeprefix("shardtrain")


def layer_of(module: str, package: str = "shardtrain") -> tuple[int, str] | None:
    """(index, name) of the layer whose prefix is the longest match for ``module``, else None.

    The bare package name stands for the root ``__init__`` only, not for everything under it.
    """
    matches = [(len(p), i, name) for i, (name, prefixes) in enumerate(LAYERS)
               for p in (_rename(p, package) for p in prefixes)
               if module == p or (p != package and _within(module, p))]
    return max(matches)[1:] if matches else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(nodes, in_function: bool = False):
    """Yield (import statement, inside a function?), skipping ``if TYPE_CHECKING:`` outside functions."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        elif isinstance(node, ast.If) and not in_function and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse, in_function)
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _import_nodes(ast.iter_child_nodes(node), inner)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: set[str]) -> list[str]:
    """The modules one import statement imports (``from pkg import sub`` imports ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return list(dict.fromkeys(alias.name for alias in node.names))
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return list(dict.fromkeys(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                              for a in node.names))


def _shortest_circle(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """A shortest import circle through ``start`` (breadth first), or None."""
    parent: dict[str, str] = {}
    queue = [start]
    for node in queue:
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """A shortest circle through each module that is in one, each circle once, from its least module."""
    found: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        if circle := _shortest_circle(graph, start):
            i = circle.index(min(circle))
            found.add(tuple(circle[i:] + circle[:i]))
    return [list(c) for c in sorted(found)]


def _analyse(package_dir: Path, package: str = "shardtrain") -> tuple[int, int, list[str]]:
    """(modules, shardtrain imports, violations) of the package in ``package_dir``."""
    files = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        files[".".join((package, *parts)).removesuffix(".__init__")] = path
    modules = set(files)
    violations: list[str] = []
    graph: dict[str, dict[str, int]] = {}
    where: dict[str, str] = {}
    count = 0
    for module, path in files.items():
        where[module] = rel = path.relative_to(package_dir.parent).as_posix()
        layer = layer_of(module, package)
        if layer is None:
            violations.append(f"{rel}:1: module {module} is in no layer; "
                              f"add it to LAYERS in {package}/tools/layers.py")
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except SyntaxError as e:
            violations.append(f"{rel}:{e.lineno}: cannot parse: {e.msg}")
            continue
        lazy_ok = any(_within(module, _rename(p, package)) for p in LAZY_OK)
        for node, in_function in _import_nodes(tree.body):
            targets = _targets(node, module, path.name == "__init__.py", modules)
            if in_function and not lazy_ok:
                violations.append(f"{rel}:{node.lineno}: {module} imports {', '.join(targets)}: {LAZY}")
            for target in (t for t in targets if _within(t, package)):
                count += 1
                if target != module:
                    graph.setdefault(module, {}).setdefault(target, node.lineno)
                theirs = layer_of(target, package)
                if layer and theirs and theirs[0] > layer[0]:
                    violations.append(f"{rel}:{node.lineno}: {module} ({layer[1]}) imports "
                                      f"{target} ({theirs[1]}): {UPWARD}")
    for cycle in _circles({m: {t: n for t, n in ts.items() if t in modules} for m, ts in graph.items()}):
        violations.append(f"{where[cycle[0]]}:{graph[cycle[0]][cycle[1]]}: "
                          f"import circle: {' -> '.join([*cycle, cycle[0]])}")
    return len(files), count, violations


def check(package_dir: Path, package: str = "shardtrain") -> list[str]:
    """The layer violations in the package at ``package_dir``; empty when it is clean."""
    return _analyse(Path(package_dir), package)[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardtrain.tools.layers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the package directory to check (default: this shardtrain)")
    args = parser.parse_args(argv)
    modules, imports, violations = _analyse(args.root)
    for violation in violations:
        print(violation)
    if not violations:
        print(f"layers: {modules} modules, {imports} shardtrain imports, no violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
